"""StopCheck: a configured signal or the wall-clock limit says stop; nothing configured, never."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megaformer.training.stopping import EXIT_CODE_STOPPED, StopCheck


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_configured_signal_stops_at_the_next_check(restore_handlers):
    stop = StopCheck("SIGTERM,SIGUSR1", 0.0)
    assert stop() is None
    os.kill(os.getpid(), signal.SIGUSR1)  # without the handler this would end the test process
    assert stop() == "signal SIGUSR1"
    assert EXIT_CODE_STOPPED == 75


def test_a_rank_started_with_its_stop_signal_blocked_unblocks_it(restore_handlers):
    """A rank whose parent started it with the stop signals blocked would never see them; StopCheck
    unblocks its signals, and one that came while they were blocked says stop."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        # to this thread: a process-directed signal could go to another thread that does not block it
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # pending while blocked
        stop = StopCheck("SIGTERM,SIGUSR1", 0.0)
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, ())
        assert stop() == "signal SIGUSR1"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def test_the_time_limit_stops_and_nothing_configured_never_does(restore_handlers):
    assert StopCheck("SIGTERM", 1.0, started=time.monotonic())() is None
    assert StopCheck("", 1.0, started=time.monotonic() - 61)() == "train.exit_duration_mins=1 reached"
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    off = StopCheck("", 0.0)
    assert not off.enabled and off() is None
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # empty train.exit_signals: untouched
