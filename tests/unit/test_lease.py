"""The lease with a heartbeat (issue 39): where the file system's locks cannot be trusted, an output
is held by a lease that a live holder renews and a dead holder's successor takes over after its
timeout; bad lease files (not ours, unreadable, a heartbeat in the future) are clear errors and
are never deleted; ``output.lock=auto`` falls back to a lease where ``flock`` is refused, and the
two ways of holding an output respect each other."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import data_tools.owner_lock as owner_lock
from data_tools.lease import Lease, check_lease_free
from data_tools.owner_lock import LockFileError, LockHeldError, OwnerLock, check_free
from megaformer.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
HOLD = textwrap.dedent(
    """
    import sys, time
    from data_tools.lease import Lease
    Lease(sys.argv[1], "a training run", "wait", float(sys.argv[2])).acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def _lease_holder(path: Path, timeout_s: float) -> subprocess.Popen:
    """Another process holding a lease on ``path`` (until killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(timeout_s)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _record(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_lease_names_its_holder_refuses_a_second_and_is_gone_after_release(tmp_path):
    path = tmp_path / "run.lock"
    lease = Lease(str(path), "a training run", "wait, or choose another output.dir", timeout_s=60).acquire()
    record = _record(path)
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert record["lease"]["timeout_s"] == 60 and record["lease"]["token"] == lease.token
    with pytest.raises(
        LockHeldError,
        match=r"held by a training run on host .*PID \d+.*a lease: heartbeat \d+ s ago.*wait, or",
    ):
        Lease(str(path), "a training run", "wait, or choose another output.dir", timeout_s=60).acquire()
    with pytest.raises(LockHeldError, match="a lease: heartbeat"):
        check_lease_free(str(path), "wait", 60)
    lease.release()
    assert not path.exists()
    Lease(str(path), "x", "wait").acquire().release()  # free again


def test_the_heartbeat_keeps_a_lease_alive_past_its_timeout(tmp_path):
    path = tmp_path / "run.lock"
    lease = Lease(str(path), "a training run", "wait", timeout_s=0.8).acquire()
    try:
        first = _record(path)["lease"]["heartbeat_unix"]
        time.sleep(2.0)  # 2.5 timeouts: without a renewal the lease would be stale
        assert _record(path)["lease"]["heartbeat_unix"] > first
        with pytest.raises(LockHeldError):
            Lease(str(path), "x", "wait", timeout_s=0.8).acquire()
    finally:
        lease.release()


def test_a_killed_holder_is_taken_over_only_after_its_timeout(tmp_path):
    path = tmp_path / "run.lock"
    proc = _lease_holder(path, timeout_s=1.5)
    dead_pid = proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(LockHeldError, match=r"may be taken over in [01] s"):  # the heartbeat is fresh
        Lease(str(path), "x", "wait", timeout_s=1.5).acquire()
    time.sleep(1.7)
    check_lease_free(str(path), "wait", 1.5)  # stale now: free
    lease = Lease(str(path), "the successor", "wait", timeout_s=1.5).acquire()
    try:
        record = _record(path)
        assert record["pid"] == os.getpid() != dead_pid and record["what"] == "the successor"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]  # nothing left aside
    finally:
        lease.release()


def test_a_lost_lease_is_noticed_by_its_holder(tmp_path, capfd):
    path = tmp_path / "run.lock"
    lease = Lease(str(path), "a training run", "wait", timeout_s=0.4).acquire()
    other = _record(path)
    other["lease"]["token"] = "someone-else"
    path.write_text(json.dumps(other))  # what a successor's take-over leaves
    time.sleep(0.5)
    assert lease.lost
    assert "lease was taken over by another" in capfd.readouterr().err
    lease.release()
    assert _record(path)["lease"]["token"] == "someone-else"  # the successor's file is kept


@pytest.mark.parametrize("mode", ["lease", "auto"])
def test_bad_lease_files_are_clear_errors_and_nothing_is_deleted(tmp_path, mode):
    foreign = tmp_path / "foreign.lock"
    foreign.write_text("pid 77 on host x\n")
    future = tmp_path / "future.lock"
    record = owner_lock.holder_record("a training run")
    record["lease"] = {"timeout_s": 60, "heartbeat_unix": time.time() + 3600, "token": "t"}
    future.write_text(json.dumps(record))
    unreadable = tmp_path / "unreadable.lock"
    unreadable.mkdir()  # root passes permission checks: a directory cannot be read as a file
    cases = [
        (foreign, r"foreign\.lock: not a megaformer lock file .*pid 77"),
        (
            future,
            r"future\.lock: its heartbeat .* is 3600 s in the future .*clocks differ.*nothing was changed",
        ),
        (unreadable, r"unreadable\.lock: cannot (read the lease|open the lock) file .*nothing was changed"),
    ]
    before = {p: (p.read_text() if p.is_file() else None) for p, _ in cases}
    for path, message in cases:
        for attempt in (
            lambda p=path: check_free(str(p), "wait", mode, 60),
            lambda p=path: OwnerLock(str(p), "x", "wait", mode, 60).acquire(),
        ):
            with pytest.raises(LockFileError, match=message):
                attempt()
    assert {p: (p.read_text() if p.is_file() else None) for p, _ in cases} == before
    assert unreadable.is_dir()


def test_auto_falls_back_to_a_lease_where_flock_is_refused(tmp_path, monkeypatch, capfd):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(owner_lock.fcntl, "flock", no_locks)
    path = tmp_path / "run.lock"
    lock = OwnerLock(str(path), "a training run", "wait", "auto", 30).acquire()
    try:
        assert "keeps no file locks; holding the output by a lease" in capfd.readouterr().err
        assert lock.lease is not None and _record(path)["lease"]["token"] == lock.lease.token
        with pytest.raises(LockHeldError, match="a lease: heartbeat"):
            OwnerLock(str(path), "x", "wait", "auto", 30).acquire()
        with pytest.raises(LockHeldError, match="a lease: heartbeat"):
            check_free(str(path), "wait", "auto", 30)
    finally:
        lock.release()
    assert not path.exists()


def test_a_flock_holder_refuses_a_lease_and_a_lease_refuses_flock(tmp_path):
    path = tmp_path / "run.lock"
    with OwnerLock(str(path), "a flock holder", "wait"):  # flock taken, record without a lease
        with pytest.raises(LockHeldError, match="held by a flock holder"):
            Lease(str(path), "x", "wait", timeout_s=30).acquire()
        with pytest.raises(LockHeldError):
            check_free(str(path), "wait", "lease", 30)
    lease = OwnerLock(str(path), "a lease holder", "wait", "lease", 30).acquire()
    try:  # on another node flock would succeed: the live lease in the file still refuses it
        with pytest.raises(LockHeldError, match=r"held by a lease holder .*a lease: heartbeat"):
            OwnerLock(str(path), "x", "wait", "auto", 30).acquire()
        with pytest.raises(LockHeldError, match="a lease: heartbeat"):
            check_free(str(path), "wait", "auto", 30)
    finally:
        lease.release()
    assert not path.exists()


def test_a_stale_flock_record_is_taken_over_by_a_lease(tmp_path):
    path = tmp_path / "run.lock"
    path.write_text(json.dumps(owner_lock.holder_record("a killed run")))  # what kill -9 leaves
    lease = Lease(str(path), "a lease holder", "wait", timeout_s=30).acquire()
    assert _record(path)["what"] == "a lease holder"
    lease.release()


def test_lock_settings_are_checked_with_the_config():
    assert load_config(None, ["output.lock=lease", "output.lease_timeout_seconds=30"]).output.lock == "lease"
    with pytest.raises(ConfigError, match=r"output\.lock='nfs': use 'auto' or 'lease'"):
        load_config(None, ["output.lock=nfs"])
    with pytest.raises(ConfigError, match=r"output\.lease_timeout_seconds=-1\.0: a positive number"):
        load_config(None, ["output.lease_timeout_seconds=-1"])
    with pytest.raises(ValueError, match=r"lock mode='x': one of auto, lease"):
        OwnerLock("run.lock", "x", "wait", "x")


def test_preprocess_under_a_lease_refuses_a_live_one_and_takes_a_stale_one(tmp_path, gpt2_flags):
    """``--lock lease``: a second preprocess into a prefix whose lease is live exits 2 naming it;
    once the holder is dead and its lease past ``--lease-timeout``, the run takes it and finishes."""
    doc = tmp_path / "in.jsonl"
    doc.write_text('{"text": "one short document"}\n{"text": "and another"}\n')
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "data_tools.preprocess", "--input", str(doc)]
    command += ["--output-prefix", str(out / "corpus"), *gpt2_flags, "--append-eod"]
    command += ["--lock", "lease", "--lease-timeout", "2"]
    proc = _lease_holder(out / "corpus.lock", timeout_s=2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    assert f"PID {proc.pid}" in second.stderr and "a lease: heartbeat" in second.stderr
    assert sorted(p.name for p in out.iterdir()) == ["corpus.lock"]
    time.sleep(2.2)
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "corpus.lock" not in names and "corpus_text_document.idx" in names
    bad = subprocess.run([*command[:-1], "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (
        bad.returncode != 0 and "--lease-timeout must be a positive number of seconds, got 0.0" in bad.stderr
    )


def test_a_training_run_holds_its_directory_by_a_lease_when_asked(tmp_path, monkeypatch):
    """``output.lock=lease``: rank 0 holds ``run.lock`` by a lease; the launcher's check refuses
    a second launch naming it, and the supervisor does so before it starts anything."""
    from megaformer.training.run_lock import RunDirBusyError, check_run_dir_free, hold_run_dir, lock_path

    out = tmp_path / "run"
    config = str(REPO / "configs" / "normformer-quickstart.yaml")
    settings = [f"output.dir={out}", "output.lock=lease", "output.lease_timeout_seconds=30"]
    cfg = load_config(config, settings)
    monkeypatch.delenv("RANK", raising=False)
    with hold_run_dir(cfg) as lock:
        assert lock.lease is not None and not lock.locked
        assert _record(Path(lock_path(str(out))))["lease"]["timeout_s"] == 30
        with pytest.raises(
            RunDirBusyError, match=r"output\.dir: .*run\.lock is held by a training run .*a lease"
        ):
            check_run_dir_free(str(out), "lease", 30)
        marker = tmp_path / "started"
        supervisor = [sys.executable, "-m", "megaformer.training.supervisor", config, *settings]
        result = subprocess.run(
            [*supervisor, "--", "touch", str(marker)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and not marker.exists(), result.stderr
        assert "a lease: heartbeat" in result.stderr and f"PID {os.getpid()}" in result.stderr
    assert not out.exists()  # released, and the directory made for the run removed
