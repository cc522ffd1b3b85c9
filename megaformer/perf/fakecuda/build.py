"""Build the fake-CUDA shim (``fake_cuda.cpp``) against the installed torch, once, cached.

The shim registers c10's fake CUDA device guard and a CUDA hooks object reporting one device, so
that a CPU-only torch lets FakeTensors on device ``"cuda"`` go through autograd, SDPA, fused AdamW
and dropout (``../shared/docs/FACTS-FAKE-CUDA.md``). It must be loaded before ``import torch``
(``LD_PRELOAD``), so every fake-CUDA run is its own process (:mod:`megaformer.perf.fakecuda.launch`).

No torch import here: the build reads the torch installation's paths from its package metadata.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cuda.cpp")


class ShimUnavailableError(RuntimeError):
    """The shim cannot be built here: no C++ compiler, no torch headers, or a CUDA build of torch
    (which needs no shim: run on its GPUs). The message names what is missing and the fix."""


def torch_dir() -> Path:
    """The installed torch package's directory, found without importing torch.

    Raises:
        ShimUnavailableError: torch is not installed.
    """
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        raise ShimUnavailableError("torch is not installed (run scripts/install.sh)") from None
    return Path(str(dist.locate_file("torch")))


def cache_dir() -> Path:
    """Where built shims are kept: ``$MEGAFORMER_CACHE/fakecuda`` or ``~/.cache/megaformer/perf/fakecuda``."""
    root = os.environ.get("MEGAFORMER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megaformer")
    return Path(root) / "fakecuda"


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else ``g++``, else ``c++``, else None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build_shim(out_dir: Path | None = None) -> Path:
    """Compile ``fake_cuda.cpp`` against the installed torch (about 2 s) unless a build for the same
    source, torch version and compiler is cached; return the shared library's path.

    Raises:
        ShimUnavailableError: a CUDA or ROCm build of torch, no C++ compiler (names ``$CXX``/g++
            and the Debian package), no torch headers (``torch/include`` is missing from this torch
            installation), or the compile failed (with the compiler's last lines).
    """
    tdir = torch_dir()
    version = metadata.version("torch")
    if "+cu" in version or "+rocm" in version:
        raise ShimUnavailableError(
            f"torch {version} is a GPU build, which registers its own CUDA hooks: fake CUDA needs a "
            "CPU build (a separate venv with pip install torch==<version> --index-url "
            "https://download.pytorch.org/whl/cpu), or run on the GPUs themselves"
        )
    include = tdir / "include"
    header = include / "ATen" / "detail" / "CUDAHooksInterface.h"
    if not header.exists():
        raise ShimUnavailableError(
            f"torch's C++ headers are missing ({header} not found); install a torch wheel that "
            "ships torch/include (PyPI's wheels do)"
        )
    cxx = compiler()
    if cxx is None:
        raise ShimUnavailableError(
            "no C++ compiler found (tried $CXX, g++, c++); install one, e.g. apt-get install g++"
        )
    key = hashlib.sha256(SOURCE.read_bytes() + f"{version}|{tdir}|{cxx}|{sys.platform}".encode()).hexdigest()[
        :16
    ]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"libmegaformer_fakecuda-{key}.so"
    if lib.exists():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home (some CI runners): the machine's temporary directory
        import tempfile

        out_dir = Path(tempfile.gettempdir()) / f"megaformer-fakecuda-{os.getuid()}"
        out_dir.mkdir(parents=True, exist_ok=True)
        lib = out_dir / lib.name
        if lib.exists():
            return lib
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    cmd = [
        cxx, "-shared", "-fPIC", "-std=c++17", "-O1", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi(tdir)}",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE), "-o", str(tmp),
        f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{tdir / 'lib'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ShimUnavailableError(f"compiling {SOURCE.name} with {cxx} failed:\n{tail}")
    os.replace(tmp, lib)  # atomic: a concurrent build never sees half a library
    return lib


def _cxx11_abi(tdir: Path) -> int:
    """1 if this torch was built with the C++11 string ABI (every wheel since 2.7), else 0; read
    from its ``TorchConfig.cmake`` without importing torch."""
    for path in tdir.glob("share/cmake/Torch/TorchConfig.cmake"):
        text = path.read_text(errors="replace")
        if "_GLIBCXX_USE_CXX11_ABI=0" in text:
            return 0
    return 1
