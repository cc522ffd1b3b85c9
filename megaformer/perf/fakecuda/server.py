"""A warm fake-CUDA interpreter that forks one session per request: the start-up paid once per GPU.

``python -m megaformer.perf.fakecuda.server GPU`` (started by :class:`.launch.WarmSessions`, the
shim preloaded as for any fake-CUDA process) does what every session does before its first
tensor: imports torch, installs the CUDA stand-ins for ``GPU`` (:func:`.runtime.install_cuda_stubs`)
and imports DeepSpeed and the trainer onto them (:data:`PRELOAD`; about 4 s of CPU on the 2-core CI
machine). Then, for each line on its standard input (JSON ``[request_path, log_path]``), it forks; the
child is a fresh process (its own pid, generator states, process group) that runs
:func:`.session.main` on the request with its output in ``log_path``, exactly as
``python -m megaformer.perf.fakecuda.session REQUEST`` would after those imports. The child's exit
status comes back as one line on standard output. One request at a time per server.

What the fork must not inherit: autograd's device threads (a backward in the parent makes every
child's backward fail), so the server runs no tensor code; the shim check
(:func:`.runtime.check_shim_loaded`) runs in each child, as in a fresh session.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys

PRELOAD = [
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.pipe.engine",
    "torch._dynamo",  # every torch.optim optimizer's constructor imports it
    "torch.utils.tensorboard",  # the loop's metrics writer
    # DeepSpeed imports it in every ZeRO engine's optimizer check (is_zero_supported_optimizer); its
    # module-level torch.compile pulls in inductor: about 1.3 s per session. Optional: a DeepSpeed
    # without Muon has no such module and no such cost.
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "megaformer.perf.fakecuda.session",
    "megaformer.training.builders",
    "megaformer.training.trainer",
    "megaformer.training.ds_adapter",
    "megaformer.training.preflight",
]
"""Imported once by the server after the CUDA stand-ins, in the session's order (:mod:`.session`)."""


def _child(request_path: str, log_path: str) -> None:
    """The forked session: output to ``log_path``, standard input closed, then the session's main
    (which leaves through ``os._exit``)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    try:
        # lazy: imported by the server already (PRELOAD); named here, where the child needs it
        from megaformer.perf.fakecuda.session import main as session_main

        session_main([request_path])
    finally:  # session_main leaves through os._exit; only an error before it gets here
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring): ``GPU`` is a key of :data:`.gpus.GPUS`."""
    argv = sys.argv[1:] if argv is None else argv
    # lazy: the runtime imports torch, which must load after the shim (LD_PRELOAD) and before the
    # stand-ins; DeepSpeed and the trainer after them (PRELOAD)
    from megaformer.perf.fakecuda.runtime import GPUS, install_cuda_stubs

    install_cuda_stubs(GPUS[argv[0]])
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # only an optional module itself may be missing
                raise
    # Every object of the imports is permanent: out of the collector's reach, each forked session's
    # collections (automatic ones and DeepSpeed's gc.collect() in see_memory_usage) skip them
    gc.freeze()
    reply = sys.stdout
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request_path, log_path = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request_path, log_path)
        _, status = os.waitpid(pid, 0)
        reply.write(f"{os.waitstatus_to_exitcode(status)}\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
