"""One run, one directory, one signal (issue 39), through launch/pretrain.sh on 2 gloo processes.

* A second launch into a live run's ``output.dir`` exits 2 within seconds, before any worker,
  naming the first run (host, PID, since when) and the way on; the first run finishes undisturbed.
* After ``kill -9`` of a run's process group, a relaunch with ``train.resume=auto`` takes the
  directory at once (the OS lock died with the ranks).
* ``timeout`` (a SIGTERM to its process group) and ``kill PID`` of the launcher (a SIGTERM to the
  PID ``launch/pretrain.sh`` returns) reach every rank: they save a checkpoint and exit, the
  launcher exits 75 (``timeout`` itself 124), and no process of the run is left after 60 s.
* SIGTERM to every process of the launch at once (how ``scancel`` delivers it) and to the
  launcher's process group: every rank saves and exits, the next launch resumes there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megaformer.training.stopping import EXIT_CODE_STOPPED
from tests.distributed.conftest import LIFECYCLE_TINY, REPO, run_pretrain

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
SCANCEL_EXIT = 128 + signal.SIGTERM  # the runner's death (it has no handler on one node), passed on
# by the supervisor once the ranks, re-parented to it, have saved and exited


def _overrides(prefix: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [*LIFECYCLE_TINY, f"data.prefix={prefix}", "train.resume=auto", f"train.steps={steps}", *extra,
            f"output.dir={out}"]  # fmt: skip


def _start(overrides: list[str], log: Path, prefix_cmd: tuple[str, ...] = ()) -> subprocess.Popen:
    """launch/pretrain.sh (behind ``prefix_cmd``, e.g. ``timeout``) in its own session."""
    env = {**os.environ, "NPROC_PER_NODE": "2"}
    env.pop("MASTER_PORT", None)
    with open(log, "w") as f:
        return subprocess.Popen(
            [*prefix_cmd, "bash", str(REPO / "launch" / "pretrain.sh"), CONFIG, *overrides],
            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before '{text}':\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no '{text}' within {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _run_processes(out: Path) -> list[psutil.Process]:
    """Live processes of the run into ``out`` (the launcher, DeepSpeed's runner and launch.py, ranks)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and f"output.dir={out}" in " ".join(
                proc.info["cmdline"] or []
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _assert_none_left(out: Path, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while (left := _run_processes(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in left:  # do not leave them to the next test
        proc.kill()
    assert not left, f"processes of the run still alive after {within_s} s: {[p.cmdline() for p in left]}"


@pytest.fixture
def reap(tmp_path):
    """Whatever the test's assertions, no process of a run under ``tmp_path`` outlives the test
    (on the code before issue 39, SIGTERM to the launcher left both ranks training)."""
    yield
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if f"output.dir={tmp_path}" in " ".join(proc.info["cmdline"] or []):
                proc.kill()


def _ranks(launcher: subprocess.Popen) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if "--local_rank=" in " ".join(p.cmdline())
    ]


def _stopped_and_saved(log: Path, out: Path) -> int:
    """The step the run stopped at; asserts it saved there on every rank and did not crash."""
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    step = int(text.split("stopping at step ")[1].split("/")[0])
    tag = out / "checkpoints" / f"global_step{step}"
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{step}"
    assert (tag / "manifest.json").is_file()
    assert sorted(p.name for p in (tag / "rng_state").iterdir()) == ["rank00000.pt", "rank00001.pt"]
    return step


def test_a_live_run_owns_its_directory(gutenberg_prefix, tmp_path, reap):
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = _start(_overrides(gutenberg_prefix, out, 60, "train.save_interval=20"), log)
    try:
        _wait_for(first, log, "step 2/60")
        holder_pid = next(p.pid for p in _ranks(first) if "--local_rank=0" in " ".join(p.cmdline()))
        started = time.monotonic()
        second = run_pretrain(
            CONFIG, _overrides(gutenberg_prefix, out, 60, "train.save_interval=20"), timeout=120
        )
        took = time.monotonic() - started
        assert second.returncode == 2, second.stderr[-3000:]
        assert took < 30, f"the refusal took {took:.0f} s"
        text = second.stdout + second.stderr
        assert (
            f"run.lock is held by a training run on host {socket.gethostname()}, PID {holder_pid}, since"
            in text
        )
        assert "launch into another output.dir" in text and "train.resume=auto" in text
        assert "launch.py" not in text and "Traceback" not in text  # no worker was started
        assert first.poll() is None, "the first run must not be disturbed"
        assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert (out / "checkpoints" / "latest").read_text() == "global_step60"
    assert (out / "checkpoints" / "global_step60" / "manifest.json").is_file()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one run's curve
    assert not (out / "run.lock").exists()  # released and removed at the end
    _assert_none_left(out)


def test_kill9_frees_the_directory_and_stop_signals_reach_every_rank(gutenberg_prefix, tmp_path, reap):
    out = tmp_path / "run"
    overrides = _overrides(gutenberg_prefix, out, 1000)

    # kill -9 of the whole group: no stale lock, a relaunch takes the directory at once ...
    killed = _start(overrides, tmp_path / "killed.log")
    _wait_for(killed, tmp_path / "killed.log", "step 2/1000")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # ... under `timeout`, whose SIGTERM (to its child, then its process group) stops every rank with
    # a checkpoint. Its time runs out once the run trains: GNU timeout's timer is a SIGALRM, and one
    # sent from here is its expiry (the same two SIGTERMs, exit 124), without a fixed wait that
    # must outlast the start-up on a loaded machine.
    timed = _start(overrides, tmp_path / "timed.log", ("timeout", "-s", "TERM", "600"))
    try:
        _wait_for(timed, tmp_path / "timed.log", "step 2/1000")
        timed.send_signal(signal.SIGALRM)
        assert timed.wait(timeout=300) == 124, (tmp_path / "timed.log").read_text()[-3000:]
    finally:
        if timed.poll() is None:
            os.killpg(timed.pid, signal.SIGKILL)
    text = (tmp_path / "timed.log").read_text()
    assert "is held by" not in text and "step 1/1000" in text, text[-3000:]
    step = _stopped_and_saved(tmp_path / "timed.log", out)
    _assert_none_left(out)

    # SIGTERM to the PID launch/pretrain.sh returned: every rank saves and exits, the launcher 75
    log = tmp_path / "sigterm.log"
    launcher = _start(overrides, log)
    try:
        _wait_for(launcher, log, f"step {step + 2}/1000")
        ranks = _ranks(launcher)
        assert len(ranks) == 2
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=180) == EXIT_CODE_STOPPED, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "SIGTERM received: sending SIGTERM to 2 rank(s)" in log.read_text()
    assert _stopped_and_saved(log, out) > step + 1
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    _assert_none_left(out)


def test_sigterm_to_every_process_at_once_and_to_the_group_stop_every_rank_with_a_save(
    gutenberg_prefix, tmp_path, reap
):
    """How Slurm's ``scancel`` delivers its SIGTERM (to every process of the job's step at the same
    moment; Slurm itself is not here) and ``kill -- -PGID``: the supervisor, DeepSpeed's
    ``launch.py`` (whose own handler then terminates the ranks again and waits 30 s for them) and
    the ranks all get it. Every rank still saves at one step and exits, nothing of the run is left
    after 60 s, and the next launch resumes from that checkpoint."""
    out = tmp_path / "run"
    overrides = _overrides(gutenberg_prefix, out, 1000)
    log = tmp_path / "every.log"
    launcher = _start(overrides, log)
    try:
        _wait_for(launcher, log, "step 2/1000")
        job = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
        assert len(_ranks(launcher)) == 2 and any(
            "deepspeed.launcher.launch" in " ".join(p.cmdline()) for p in job
        )
        for proc in job:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert code == SCANCEL_EXIT, log.read_text()[-3000:]
    step = _stopped_and_saved(log, out)
    _assert_none_left(out)

    log = tmp_path / "group.log"
    launcher = _start(overrides, log)
    try:
        _wait_for(launcher, log, f"step {step + 2}/1000")
        os.killpg(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=180) == EXIT_CODE_STOPPED, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert f"at step {step}" in log.read_text().split("resumed from", 1)[1].splitlines()[0]
    assert _stopped_and_saved(log, out) > step + 1
    _assert_none_left(out)
