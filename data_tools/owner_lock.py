"""One writer per output: an exclusive OS file lock, with who holds it written inside.

A training run's ``output.dir`` and a preprocessing run's output prefix each have one lock file
(``OUTPUT_DIR/run.lock``, ``PREFIX.lock``). The process that writes there takes an exclusive
``fcntl.flock`` on it for as long as it writes and writes into it a JSON record of itself: host,
PID, Slurm job ID (``SLURM_JOB_ID``, when set), start time, command. A second process that wants
the same output finds the lock taken and is refused with that record (:class:`LockHeldError`).

Why an OS lock and not a file that exists while a run runs: the kernel drops the lock when the
holder's last descriptor closes, so a run killed by ``kill -9``, the out-of-memory killer or a
power loss leaves no stale lock; nothing has to guess whether a PID is still the same process. A
free lock file with an old record in it (what a killed holder leaves) is simply taken over. The
holder deletes the file when it ends normally, while it still holds the lock; whoever locks a file
checks afterwards that the path still names the file it locked (and starts again if not), so a
deletion can never leave two processes holding locks on two files of one name.

Limits: ``flock`` is per machine unless the file system forwards it. NFS clients on Linux
(since 2.6.12) emulate it with POSIX byte-range locks through the NFS lock manager, so it holds
across nodes there, but not on mounts with ``nolock`` or ``local_lock=flock``/``all``, where each
node sees only its own locks; some FUSE file systems refuse locks altogether (``ENOLCK``,
``EOPNOTSUPP``), and :meth:`OwnerLock.acquire` then returns without a lock and says so (a warning
on stderr). No lease or heartbeat is kept for those file systems: there, launch only one run per
output yourself.

Bad lock files are reported, never deleted: one that is not ours (not our JSON record) or one that
cannot be opened (permissions, a directory in its place) is a :class:`LockFileError` naming the file
and the fix.
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
import time

from data_tools.errors import DataToolsError

FORMAT = "megaformer-owner-lock/1"
"""The ``format`` field of every record this module writes; a file without it is not ours."""

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""``flock`` errors of a file system that keeps no locks."""


class LockFileError(DataToolsError):
    """A lock file that cannot be used: not ours (another format), or not openable."""


class LockHeldError(DataToolsError):
    """The output is held by another live process; :attr:`holder` is its record (or None)."""

    def __init__(self, message: str, holder: dict | None) -> None:
        super().__init__(message)
        self.holder = holder


def holder_record(what: str) -> dict:
    """This process's record: what it is doing, host, PID, Slurm job, start time, command."""
    now = time.time()
    return {
        "format": FORMAT,
        "what": what,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "started": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds"),
        "started_unix": now,
        "command": " ".join(sys.argv)[:500],
    }


def describe(holder: dict | None) -> str:
    """``"a training run on host h, PID 123, Slurm job 77, since 2026-11-28T14:00:00+00:00 (3 min
    ago)"``; a lock taken a moment ago whose record is not written yet: said so."""
    if not holder:
        return "a process that has just taken it (its record is not written yet)"
    parts = [f"host {holder.get('host', '?')}", f"PID {holder.get('pid', '?')}"]
    if holder.get("slurm_job_id"):
        parts.append(f"Slurm job {holder['slurm_job_id']}")
    since = f"since {holder.get('started', '?')}"
    started = holder.get("started_unix")
    if isinstance(started, (int, float)):
        since += f" ({_ago(time.time() - started)})"
    return f"{holder.get('what', 'a process')} on {', '.join(parts)}, {since}"


def _ago(seconds: float) -> str:
    if seconds < 0:
        return "in the future: the clocks of the two hosts differ"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def read_record(path: str, text: str) -> dict | None:
    """The record in a lock file's ``text``: None when empty (a holder that has just taken the lock).

    Raises:
        LockFileError: the text is not a record of this module (another program's file).
    """
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LockFileError(
            f"{path}: not a megaformer lock file (it starts {text[:60]!r}; ours are JSON records with "
            f'"format": "{FORMAT}"); nothing was changed: move that file away if it is not needed, '
            "or choose another output"
        )
    return record


def _open(path: str, create: bool) -> int | None:
    """A read-write descriptor of ``path`` (close-on-exec); None when it does not exist and
    ``create`` is false.

    Raises:
        LockFileError: an existing file that cannot be opened (permissions, a directory there),
            naming it and the fix.
        OSError: a missing file that cannot be created (its directory missing, not writable, a
            full disk): the caller's own output error says that best.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        if create and not os.path.lexists(path):
            raise
        raise LockFileError(
            f"{path}: cannot open the lock file ({e.strerror}); nothing was changed: make it readable "
            f"and writable by this user (chmod u+rw {path}) or choose another output"
        ) from None


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data.decode("utf-8", errors="replace")


def _try_lock(fd: int, path: str) -> bool | None:
    """Take the exclusive lock without waiting: True, False (held elsewhere), None (no locks here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in NO_LOCKS:
            return None
        raise LockFileError(f"{path}: cannot lock it ({e.strerror})") from None


def _still_names(path: str, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (not deleted or replaced since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _held_error(path: str, fd: int, way_on: str) -> LockHeldError:
    text = _read(fd)
    try:
        holder = read_record(path, text)
    except LockFileError:
        return LockHeldError(
            f"{path} is locked by another process, and it is not a megaformer lock file (it starts "
            f"{text[:60]!r}); nothing was changed: {way_on}",
            None,
        )
    return LockHeldError(f"{path} is held by {describe(holder)}: {way_on}", holder)


def check_free(path: str, way_on: str) -> None:
    """Refuse if another process holds ``path``'s lock; take nothing, create nothing.

    Args:
        path: the lock file (it may not exist: then the output is free).
        way_on: what the user can do, appended to the message (wait, another output).

    Raises:
        LockHeldError: held, naming the holder (host, PID, Slurm job, since when) and ``way_on``.
        LockFileError: a lock file that is not ours, or one that cannot be opened.
    """
    fd = _open(path, create=False)
    if fd is None:
        return
    try:
        taken = _try_lock(fd, path)
        if taken is False:
            raise _held_error(path, fd, way_on)
        read_record(path, _read(fd))  # free: but not another program's file
    finally:
        os.close(fd)  # drops a lock taken just now


class OwnerLock:
    """The exclusive lock of one output, held from :meth:`acquire` to :meth:`release` (or the
    process's end).

    Args:
        path: the lock file (created if missing; deleted by :meth:`release`).
        what: what the holder does, for the record (``"a training run"``).
        way_on: appended to the refusal a second process gets (``"wait for it to end, or ..."``).

    Raises:
        LockHeldError: from :meth:`acquire`, when another process holds it.
        LockFileError: from :meth:`acquire`, for a lock file that is not ours or cannot be opened.
        OSError: from :meth:`acquire`, when the lock file cannot be created (a directory that is
            missing or not writable, a full disk).
    """

    def __init__(self, path: str, what: str, way_on: str) -> None:
        self.path, self.what, self.way_on = path, what, way_on
        self.fd: int | None = None
        self.locked = False

    def acquire(self) -> OwnerLock:
        """Take the lock and write this process's record into the file; returns ``self``. On a
        file system without locks: no lock, a warning on stderr, :attr:`locked` false."""
        while True:
            fd = _open(self.path, create=True)
            try:
                taken = _try_lock(fd, self.path)
                if taken is False:
                    raise _held_error(self.path, fd, self.way_on)
                if taken and not _still_names(self.path, fd):
                    os.close(fd)  # its holder deleted it as it ended: lock the new one
                    continue
                read_record(self.path, _read(fd))  # another program's file is not overwritten
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            break
        self.fd = fd
        if taken is None:
            print(
                f"warning: {self.path}: this file system keeps no file locks, so nothing stops a "
                "second run from writing the same output; launch only one",
                file=sys.stderr,
                flush=True,
            )
            return self
        self.locked = True
        data = (json.dumps(holder_record(self.what), indent=1) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        with contextlib.suppress(OSError):
            os.fsync(fd)
        return self

    def release(self, remove: bool = True) -> None:
        """Drop the lock; with ``remove``, delete the lock file first (while still holding it, and
        only if the path still names the file this process locked)."""
        if self.fd is None:
            return
        if remove and self.locked and _still_names(self.path, self.fd):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd, self.locked = None, False

    def __enter__(self) -> OwnerLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
