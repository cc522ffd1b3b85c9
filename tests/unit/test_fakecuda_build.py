"""The fake-CUDA shim's build says why it cannot happen: no C++ compiler, no torch headers, a GPU
build of torch (the tier then skips with that reason, and fails where g++ is present)."""

from __future__ import annotations

from importlib import metadata

import pytest

from megaformer.perf.fakecuda import build


def test_no_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.ShimUnavailableError, match=r"no C\+\+ compiler found .*apt-get install g\+\+"):
        build.build_shim(tmp_path)


def test_missing_torch_headers_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "torch_dir", lambda: tmp_path / "torch")
    with pytest.raises(
        build.ShimUnavailableError, match=r"torch's C\+\+ headers are missing .*CUDAHooksInterface\.h"
    ):
        build.build_shim(tmp_path)


def test_a_gpu_build_of_torch_is_refused(monkeypatch, tmp_path):
    real = metadata.version
    monkeypatch.setattr(
        build.metadata, "version", lambda name: "2.11.0+cu130" if name == "torch" else real(name)
    )
    with pytest.raises(build.ShimUnavailableError, match=r"torch 2\.11\.0\+cu130 is a GPU build"):
        build.build_shim(tmp_path)


def test_a_compile_error_is_shown_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    monkeypatch.setattr(build.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    with pytest.raises(build.ShimUnavailableError, match=r"compiling fake_cuda\.cpp with false failed"):
        build.build_shim(tmp_path)
    assert not list(tmp_path.iterdir())
