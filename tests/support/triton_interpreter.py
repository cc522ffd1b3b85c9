"""Triton kernels on the CPU in Triton's interpreter, inside a pytest session.

The interpreter is chosen when Triton is imported (``TRITON_INTERPRET=1`` at that moment: Triton's
own library functions, ``tl.sum`` among them, are decorated then) and it is one mode for the whole
process. Many test modules import ``torch._dynamo``, which imports Triton, so a kernel test module
collected after them cannot switch the mode. :func:`enable` sets the mode when it still can (Triton
not imported yet, no GPU) and says whether this process runs kernels in the interpreter; where it
cannot, the module's tests run in a fresh process instead (:func:`run_in_fresh_process`), with the
variable set and no GPU visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def enable() -> bool:
    """Put this process in Triton's interpreter mode if it can still be chosen; True when kernels
    defined from now on run in the interpreter. Call before anything imports ``torch._dynamo``."""
    if "triton" in sys.modules:
        import triton.language as tl

        return type(tl.standard.sum).__name__ == "InterpretedFunction"
    import torch  # does not import Triton

    if torch.cuda.is_available():  # this session's Triton is the GPU's; do not change its mode
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def library_interpreted() -> bool:
    """Whether Triton's own library functions (``tl.sum`` ...) run in its interpreter in this
    process (they are decorated once, when Triton is imported)."""
    import triton.language as tl

    return type(tl.standard.sum).__name__ == "InterpretedFunction"


def run_in_fresh_process(test_file: str, deselect: str, timeout_s: int = 600) -> None:
    """Run ``test_file``'s tests but ``deselect`` (a ``-k`` expression) in a new pytest process under
    the interpreter, the GPU hidden; raise AssertionError with the output's tail if any fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", f"not {deselect}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
    assert done.returncode == 0, f"{' '.join(cmd)} failed (exit {done.returncode}):\n{tail}"
