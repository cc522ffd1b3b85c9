"""The fake-CUDA tier: GPU code paths (CUDA tensors, NCCL's rules, DeepSpeed's GPU engines) run on
this CPU machine through a shim built from the installed torch's headers
(``megaformer/perf/fakecuda``). Marked ``fakecuda``; each case is its own subprocess.

Skipped, with the reason printed, only where the shim cannot be built because there is no C++
compiler or no torch headers; on a machine with g++ a failed build fails the tier (CI must not
pass it by skipping).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from megaformer.perf.fakecuda.build import ShimUnavailableError, build_shim, compiler
from megaformer.perf.fakecuda.launch import WarmSessions


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/fakecuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.fakecuda)


@pytest.fixture(scope="session")
def shim() -> Path:
    """The shim's shared library (built once per torch version, cached)."""
    try:
        return build_shim()
    except ShimUnavailableError as e:
        if compiler() is not None and shutil.which("g++"):
            pytest.fail(f"the fake-CUDA shim did not build although g++ is here: {e}")
        pytest.skip(f"fake-CUDA tier skipped: {e}")


@pytest.fixture(scope="session")
def warm_sessions(shim) -> Iterator[WarmSessions]:
    """Warm fake-CUDA servers for this test session: each session a fork of an interpreter that
    has imported torch, DeepSpeed and the trainer onto the CUDA stand-ins (about 4 s of CPU saved
    per session; ``MEGAFORMER_TEST_FRESH_RANKS=1`` starts every session fresh instead, to rule the
    fork out when a test fails)."""
    if os.environ.get("MEGAFORMER_TEST_FRESH_RANKS", "") not in ("", "0"):
        yield None
        return
    with WarmSessions(shim) as sessions:
        yield sessions
