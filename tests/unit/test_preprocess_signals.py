"""``python -m data_tools.preprocess --workers 2`` stopped at any moment: SIGTERM or SIGINT to its
process group (a scheduler's kill, Ctrl-C) or to the main process alone ends every process within
seconds, with no temporary and no half-written output left, and no worker outliving it; SIGKILL of
the main process leaves no orphaned worker.

Regression (issue 22): SIGTERM to the process group while the workers started left the main process
hung in ``multiprocessing.Pool.terminate()`` (a worker killed while holding the task queue's lock)
and a worker orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.signal_state import describe, session_processes

REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 15  # generous: the main process normally ends in well under a second


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _default_stop_signals() -> None:
    """In the child, before exec: SIGINT and SIGTERM at their defaults, as a terminal's foreground job
    or a scheduler's step has them. A test run started in the background by a non-interactive shell
    (``cmd &``) inherits SIGINT ignored, and Python then installs no Ctrl-C handler: the signal would
    be dropped and the run finish, which says nothing about preprocess."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _blocked_stop_signals() -> None:
    """:func:`_default_stop_signals`, then SIGINT and SIGTERM blocked: how a Python parent inside a
    ``pthread_sigmask`` block starts a command (multiprocessing's resource tracker blocks them
    around its spawn)."""
    _default_stop_signals()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _start(
    inputs: Path, out_dir: Path, gpt2_flags: list[str], preexec_fn: Callable[[], None] = _default_stop_signals
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "data_tools.preprocess", "--input", str(inputs)]
        + ["--output-prefix", str(out_dir / "gut"), *gpt2_flags, "--append-eod", "--workers", "2"]
        + ["--log-interval", "0"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session and process group, as under a scheduler
        preexec_fn=preexec_fn,
    )


def _reach(moment: str, proc: subprocess.Popen, out_dir: Path) -> None:
    """Waits until ``moment``: a delay after the start, the first worker forked, or mid-run."""
    if moment.endswith("s"):
        time.sleep(float(moment[:-1]))
    elif moment == "workers starting":  # the main process and at least one worker
        assert _wait_for(lambda: len(session_processes(proc.pid)) >= 2, 60), "no worker started"
    elif moment == "mid-run":  # a few MB of tokens written
        tmp_bin = out_dir / "gut_text_document.bin.tmp"
        assert _wait_for(lambda: tmp_bin.exists() and tmp_bin.stat().st_size > 4 << 20, 60), "no progress"
    else:
        raise AssertionError(moment)
    assert proc.poll() is None, f"the run ended before {moment}: {proc.communicate()[1]}"


def _stop_and_check(proc: subprocess.Popen, out_dir: Path, signum: int, *, group: bool) -> str:
    """Sends ``signum`` and checks: the main process ends with 130 or by the signal, every process
    of its session is gone, nothing is left in the output directory. Returns its stderr."""
    (os.killpg if group else os.kill)(proc.pid, signum)
    try:
        _, stderr = proc.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        left = session_processes(proc.pid)
        states = [describe(pid) for pid in left]  # blocked, ignored, caught or pending where it went
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise AssertionError(
            f"the main process still ran {EXIT_TIMEOUT_S} s after the signal; this test process: "
            f"{describe(os.getpid())}; the run's processes: {states}; stderr: {stderr[-2000:]!r}"
        ) from None
    assert proc.returncode in (130, -signum), (proc.returncode, stderr)
    # Workers see their parent go within a moment; a poll, not a fixed sleep.
    left_over = _wait_for(lambda: not session_processes(proc.pid), EXIT_TIMEOUT_S)
    left = session_processes(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left_over and not left, f"processes outlived the main process: {left}"
    assert sorted(p.name for p in out_dir.iterdir()) == [], stderr
    assert "Traceback" not in stderr or proc.returncode == -signum, stderr  # before main() is reached
    return stderr


MOMENTS = ["0.2s", "0.5s", "workers starting", "1.0s", "mid-run"]


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_to_the_process_group_at_any_moment(tmp_path, novels_corpus, gpt2_flags, signum):
    inputs = novels_corpus(tmp_path / "inputs", 10)
    for moment in MOMENTS:
        out_dir = tmp_path / f"out-{moment.replace(' ', '-')}"
        out_dir.mkdir()
        proc = _start(inputs, out_dir, gpt2_flags)
        _reach(moment, proc, out_dir)
        stderr = _stop_and_check(proc, out_dir, signum, group=True)
        if proc.returncode == 130:
            assert "interrupted" in stderr, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_run_started_with_the_stop_signals_blocked_still_stops(tmp_path, novels_corpus, gpt2_flags, signum):
    """Started with SIGINT and SIGTERM blocked, ``preprocess`` unblocks them as its ``main``
    begins: a signal that came while it imported is raised there, one that comes later as usual.
    Before, the signal stayed pending and the run went on to its end (a CI failure: 15 s)."""
    inputs = novels_corpus(tmp_path / "inputs", 10)
    for moment in ["0.2s", "workers starting"]:
        out_dir = tmp_path / f"out-{moment.replace(' ', '-')}"
        out_dir.mkdir()
        proc = _start(inputs, out_dir, gpt2_flags, _blocked_stop_signals)
        _reach(moment, proc, out_dir)
        stderr = _stop_and_check(proc, out_dir, signum, group=True)
        assert proc.returncode == 130 and "interrupted" in stderr, (proc.returncode, stderr)


@pytest.mark.parametrize("moment", ["workers starting", "mid-run"])
def test_sigterm_to_the_main_process_alone_ends_its_workers(tmp_path, novels_corpus, gpt2_flags, moment):
    """``kill PID`` (not the group): the main process ends its workers itself."""
    inputs = novels_corpus(tmp_path / "inputs", 10)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _start(inputs, out_dir, gpt2_flags)
    _reach(moment, proc, out_dir)
    _stop_and_check(proc, out_dir, signal.SIGTERM, group=False)


def test_workers_do_not_outlive_a_killed_main_process(tmp_path, novels_corpus, gpt2_flags):
    """SIGKILL (no cleanup possible in the main process): the workers notice and exit, none is
    orphaned. Only the temporaries of the killed process may remain; a rerun replaces them."""
    inputs = novels_corpus(tmp_path / "inputs", 10)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _start(inputs, out_dir, gpt2_flags)
    _reach("mid-run", proc, out_dir)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=EXIT_TIMEOUT_S)
    gone = _wait_for(lambda: not session_processes(proc.pid), EXIT_TIMEOUT_S)
    left = session_processes(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert gone and not left, f"workers outlived the killed main process: {left}"
    assert not (out_dir / "gut_text_document.bin").exists()  # nothing looks finished
    assert not (out_dir / "gut_text_document.idx").exists()


def test_a_worker_killed_alone_ends_the_run_with_an_error(tmp_path, novels_corpus, gpt2_flags):
    """One worker killed (the out-of-memory killer's SIGKILL): the run stops with an error naming it,
    instead of waiting forever for the lost work unit; the other worker goes too, no output left."""
    inputs = novels_corpus(tmp_path / "inputs", 10)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _start(inputs, out_dir, gpt2_flags)
    _reach("mid-run", proc, out_dir)
    worker = next(pid for pid in session_processes(proc.pid) if pid != proc.pid)
    os.kill(worker, signal.SIGKILL)
    try:
        _, stderr = proc.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the main process still ran {EXIT_TIMEOUT_S} s after a worker died") from None
    assert proc.returncode == 2, stderr
    assert f"error: worker process {worker} was killed by SIGKILL" in stderr and "Traceback" not in stderr
    assert _wait_for(lambda: not session_processes(proc.pid), EXIT_TIMEOUT_S)
    assert sorted(p.name for p in out_dir.iterdir()) == []


@pytest.mark.parametrize("inherited", [signal.SIG_IGN, signal.SIG_DFL], ids=["ignored", "default"])
def test_a_command_started_with_ctrl_c_ignored_keeps_it_ignored(inherited):
    """A shell starts a script's background jobs (``cmd &``) with SIGINT ignored, so that Ctrl-C on
    the script leaves them running; every command's ``sigterm_as_interrupt`` keeps it so, and
    installs its handler for SIGINT otherwise. SIGTERM always gets it (a scheduler's kill)."""
    from data_tools import atomic

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, inherited)
    try:
        atomic.sigterm_as_interrupt()
        expected = signal.SIG_IGN if inherited is signal.SIG_IGN else atomic._raise_interrupt
        assert signal.getsignal(signal.SIGINT) is expected
        assert signal.getsignal(signal.SIGTERM) is atomic._raise_interrupt
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_an_interrupt_as_the_block_begins_leaves_the_mask_as_it_was(monkeypatch):
    """A stop signal that came just before :func:`stop_signals_blocked` has its handler run as the
    blocking call returns; the ``KeyboardInterrupt`` it raises must not leave the stop signals
    blocked in this thread (and in every process it starts later). Simulated: the blocking call
    raises once it has blocked."""
    from data_tools import atomic

    real = signal.pthread_sigmask

    def handler_runs_on_return(how, mask):
        previous = real(how, mask)
        if how == signal.SIG_BLOCK and signal.SIGTERM in set(mask):
            raise KeyboardInterrupt  # what the Python handler does at the next bytecode
        return previous

    before = real(signal.SIG_BLOCK, ())
    monkeypatch.setattr(signal, "pthread_sigmask", handler_runs_on_return)
    with pytest.raises(KeyboardInterrupt), atomic.stop_signals_blocked():
        raise AssertionError("the block's body must not run")
    assert real(signal.SIG_BLOCK, ()) == before


def test_sigterm_as_interrupt_unblocks_the_stop_signals_and_raises_one_pending():
    """A command started with the stop signals blocked unblocks them in ``sigterm_as_interrupt``;
    one that came meanwhile is raised there, inside the caller's ``try``."""
    from data_tools import atomic

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        # to this thread: a process-directed signal could go to another thread that does not block it
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # pending: blocked
        assert signal.SIGTERM in signal.sigpending()
        with pytest.raises(KeyboardInterrupt):
            atomic.sigterm_as_interrupt()
        assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, ())
        with pytest.raises(KeyboardInterrupt):
            atomic.raise_if_stopped()  # recorded too
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        atomic._stop_signal = None
