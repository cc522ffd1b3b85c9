"""Settings every test tier shares, made before any test module imports torch."""

from __future__ import annotations

import os
import signal

import pytest

# Inductor compiles its C++ kernels in a pool of worker processes by default (one per core), each
# of which imports torch first. On the 2-core CI machine the suite already runs two pytest workers,
# so the pool only adds those imports: tests/unit/test_compiled_block.py took 91-92 s with one
# compile thread against 113-115 s with the default two, from an empty inductor cache, paired, on
# 2026-12-07's VM. Set in the environment so the launched ranks inherit it; a value the caller
# exported wins.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_stop_signal_left_blocked():
    """Fails the test that leaves this process's main thread with a signal blocked that was not
    before it: every process a later test of this worker starts would inherit the block, and a
    stop test there would wait on a signal that never comes (one possible cause of stop 54's two
    SIGINT hangs in CI, not pinned down). The mask is put back for the tests that follow, also
    where a test unblocked a signal (the code under test unblocks the stop signals it handles)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    after = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    if after != before:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    if after - before:
        left = sorted(s.name for s in after - before)
        pytest.fail(f"the test left signal(s) {left} blocked in the test process (put back)", pytrace=False)
