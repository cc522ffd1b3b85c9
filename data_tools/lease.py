"""A lease with a heartbeat, for file systems whose locks cannot be trusted.

:mod:`data_tools.owner_lock` holds an output with ``fcntl.flock``. Where that is unreliable (a
FUSE mount that refuses locks; NFS mounted with ``nolock`` or ``local_lock=flock``/``all``, where
each node sees only its own locks and ``flock`` *succeeds* on both nodes), the output is held by a
lease instead: the same JSON record (host, PID, Slurm job, start, command) plus a ``lease`` field::

    "lease": {"timeout_s": 120.0, "heartbeat_unix": 1764338400.2, "heartbeat": "2026-...", "token": "9f..."}

* **Taking it** needs no lock: the file is created with ``O_CREAT | O_EXCL``, which is atomic on
  local file systems and on NFSv3 and later (the server creates it or refuses).
* **Holding it**: a daemon thread rewrites the record every ``timeout_s / 4`` seconds (a new file
  renamed over the old one, so a reader never sees half a record), after checking that the file
  still carries this holder's token.
* **A dead holder** (``kill -9``, a lost node) stops its heartbeat; a later process takes the lease
  over only once the heartbeat is older than the lease's own ``timeout_s``: it renames the old file
  aside (one rename wins), checks that what it moved is the record it judged stale, deletes it and
  creates its own. A relaunch after a kill therefore waits up to ``timeout_s`` (the refusal says
  how long).
* **Bad lease files are reported, never deleted**: one that is not ours (another format), one that
  cannot be opened, and one whose heartbeat lies more than :data:`CLOCK_SKEW_S` in the future of
  this host's clock (the hosts' clocks differ, or the file was edited) are :class:`LockFileError`
  naming the file and the fix.

Limits, stated: the heartbeat is compared across hosts' clocks, so they must agree to well within
``timeout_s`` (NTP does); a holder stalled longer than ``timeout_s`` (a frozen VM) can be taken over
while it still lives, and then finds at its next heartbeat that the token is no longer its own and
says so on stderr (:attr:`Lease.lost`). A holder cannot stop its own process from writing after
that; choose ``timeout_s`` well above the longest stall you expect (default 120 s).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid

from data_tools.lock_record import (
    LockFileError,
    LockHeldError,
    describe,
    holder_record,
    read_record,
)

DEFAULT_TIMEOUT_S = 120.0
"""A lease whose heartbeat is older than this (seconds) is taken over; its holder beats 4× as often."""

CLOCK_SKEW_S = 60.0
"""A heartbeat further than this (seconds) ahead of this host's clock is refused as bad input."""

_ATTEMPTS = 5  # create / take over races lost in a row before giving up


def _now_iso(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds")


def check_timeout(timeout_s: float, name: str) -> float:
    """``timeout_s`` as a float, or ValueError naming ``name`` and the fix (a positive number)."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"{name}={timeout_s!r}: a lease timeout is a positive number of seconds "
            f"(default {DEFAULT_TIMEOUT_S:g})"
        )
    return value


def _read_text(path: str) -> tuple[str, float] | None:
    """``(text, mtime)`` of ``path``; None when it does not exist.

    Raises:
        LockFileError: it exists but cannot be read (permissions, a directory in its place).
    """
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace"), os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LockFileError(
            f"{path}: cannot read the lease file ({e.strerror}); nothing was changed: make it readable "
            f"and writable by this user (chmod u+rw {path}) or choose another output"
        ) from None


def _flock_held(path: str) -> bool:
    """Whether another process holds ``path``'s ``flock`` (a holder in lock mode beside a lease)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks on this file system: nothing to ask
    finally:
        os.close(fd)


def judge(
    path: str, text: str, mtime: float, timeout_s: float, now: float | None = None
) -> tuple[str, dict | None, float]:
    """Whether the lease file ``path`` (its ``text`` and ``mtime``) is held.

    Returns:
        ``(state, record, age_s)``: ``state`` is ``"live"`` (held), ``"stale"`` (may be taken over)
        or ``"free"`` (a record of a lock-mode holder that has ended); ``age_s`` the heartbeat's age.
        A record without a lease (written by a ``flock`` holder) is live while its ``flock`` is held.
        An empty file (a holder between creating and writing it) is judged by its ``mtime``.

    Raises:
        LockFileError: not ours, or a heartbeat more than :data:`CLOCK_SKEW_S` in the future.
    """
    now = time.time() if now is None else now
    record = read_record(path, text)
    if record is not None and "lease" not in record:
        return ("live" if _flock_held(path) else "free"), record, 0.0
    lease = (record or {}).get("lease") or {}
    beat = lease.get("heartbeat_unix", mtime)
    timeout = lease.get("timeout_s", timeout_s)
    if not isinstance(beat, (int, float)) or not isinstance(timeout, (int, float)):
        raise LockFileError(
            f"{path}: its lease has no numeric heartbeat_unix / timeout_s ({lease!r}); nothing was "
            f"changed: if no run writes this output, delete {path}"
        )
    age = now - beat
    if age < -CLOCK_SKEW_S:
        raise LockFileError(
            f"{path}: its heartbeat ({_now_iso(beat)}) is {-age:.0f} s in the future of this host's clock "
            f"(held by {describe(record)}): the hosts' clocks differ, or the file was edited; nothing was "
            f"changed: synchronise the clocks (NTP), or, if no run writes this output, delete {path}"
        )
    return ("live" if age <= timeout else "stale"), record, max(age, 0.0)


def held_message(path: str, record: dict | None, age: float, timeout_s: float, way_on: str) -> str:
    """The refusal a second process gets from a live lease: who, the heartbeat's age, when it lapses."""
    timeout = ((record or {}).get("lease") or {}).get("timeout_s", timeout_s)
    left = max(float(timeout) - age, 0.0)
    return (
        f"{path} is held by {describe(record)} (a lease: heartbeat {age:.0f} s ago; if its holder has died "
        f"it may be taken over in {left:.0f} s): {way_on}"
    )


def check_lease_free(path: str, way_on: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Refuse if a live lease (or a live ``flock`` holder) holds ``path``; take nothing.

    Raises:
        LockHeldError: held, naming the holder and when the lease lapses.
        LockFileError: a file that is not ours, unreadable, or with a heartbeat in the future.
    """
    found = _read_text(path)
    if found is None:
        return
    state, record, age = judge(path, found[0], found[1], timeout_s)
    if state == "live":
        raise LockHeldError(held_message(path, record, age, timeout_s, way_on), record)


def _take_over(path: str, judged_text: str) -> None:
    """Move a stale lease aside and delete it, if it is still the one judged stale; a fresh one
    (another process took it over first) is put back."""
    aside = f"{path}.stale.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another process moved it first: try to create ours
    found = _read_text(aside)
    if found is not None and found[0] != judged_text:
        with contextlib.suppress(OSError):
            os.link(aside, path)  # not the stale record: put the other holder's lease back
    with contextlib.suppress(OSError):
        os.unlink(aside)


class Lease:
    """A lease on ``path`` (see the module's docstring), from :meth:`acquire` to :meth:`release`.

    Args:
        path: the lease file (created by :meth:`acquire`, deleted by :meth:`release`).
        what: what the holder does, for the record (``"a training run"``).
        way_on: appended to the refusal a second process gets.
        timeout_s: seconds without a heartbeat after which others may take the lease over.

    Raises:
        LockHeldError: from :meth:`acquire`, when a live holder has it.
        LockFileError: from :meth:`acquire`, for a file not ours, unreadable, or from the future.
        OSError: from :meth:`acquire`, when the file cannot be created (missing directory, full disk).
    """

    def __init__(self, path: str, what: str, way_on: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path, self.what, self.way_on = path, what, way_on
        self.timeout_s = check_timeout(timeout_s, "lease timeout")
        self.token = uuid.uuid4().hex
        self.record: dict | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _payload(self) -> bytes:
        now = time.time()
        assert self.record is not None
        self.record["lease"] = {
            "timeout_s": self.timeout_s,
            "heartbeat_unix": now,
            "heartbeat": _now_iso(now),
            "token": self.token,
        }
        return (json.dumps(self.record, indent=1) + "\n").encode("utf-8")

    def _create(self) -> bool:
        """Create the file with this holder's record; False if it exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._payload())
            with contextlib.suppress(OSError):
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def acquire(self) -> Lease:
        """Take the lease (creating the file, or taking over a stale one) and start the heartbeat."""
        self.record = holder_record(self.what)
        for _ in range(_ATTEMPTS):
            if self._create():
                self._thread = threading.Thread(
                    target=self._beat, name=f"lease-heartbeat:{self.path}", daemon=True
                )
                self._thread.start()
                return self
            found = _read_text(self.path)
            if found is None:
                continue  # its holder released it just now
            state, record, age = judge(self.path, found[0], found[1], self.timeout_s)
            if state == "live":
                raise LockHeldError(held_message(self.path, record, age, self.timeout_s, self.way_on), record)
            _take_over(self.path, found[0])
        raise LockHeldError(
            f"{self.path}: other processes took this lease {_ATTEMPTS} times in a row as this one "
            f"tried: {self.way_on}",
            None,
        )

    def is_mine(self) -> bool:
        """Whether the file still carries this holder's token."""
        try:
            found = _read_text(self.path)
            record = read_record(self.path, found[0]) if found else None
        except LockFileError:
            return False
        return bool(record) and (record.get("lease") or {}).get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            if not self.is_mine():
                self.lost = True
                print(
                    f"warning: {self.path}: this process's lease was taken over by another (its heartbeat "
                    f"stalled longer than {self.timeout_s:g} s?): two runs may now write the same output",
                    file=sys.stderr,
                    flush=True,
                )
                return
            tmp = f"{self.path}.{self.token[:8]}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(self._payload())
                os.replace(tmp, self.path)
            except OSError as e:  # a full disk, a lost mount: keep trying; others see the age grow
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ESTALE):
                    print(
                        f"warning: {self.path}: cannot renew the lease ({e.strerror})",
                        file=sys.stderr,
                        flush=True,
                    )

    def release(self) -> None:
        """Stop the heartbeat and delete the file if it is still this holder's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.record is not None and not self.lost and self.is_mine():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.record = None
