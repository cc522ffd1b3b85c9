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
``EOPNOTSUPP``). Where ``flock`` is refused, ``mode="auto"`` holds the output by a lease with a
heartbeat instead (:mod:`data_tools.lease`, said on stderr); where it succeeds but is not shared
between nodes (which no process can detect), ``mode="lease"`` asks for the lease. The two ways
respect each other: a ``flock`` holder refuses while the file holds a live lease, and a lease is
refused while another process holds the file's ``flock``.

Bad lock files are reported, never deleted: one that is not ours (not our JSON record) or one that
cannot be opened (permissions, a directory in its place) is a :class:`LockFileError` naming the file
and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys

from data_tools.lease import DEFAULT_TIMEOUT_S, Lease, check_lease_free, check_timeout, held_message, judge
from data_tools.lock_record import FORMAT, LockFileError, LockHeldError, describe, holder_record, read_record

__all__ = [  # the record and its errors live in lock_record (the lease shares them); named here too
    "FORMAT",
    "MODES",
    "LockFileError",
    "LockHeldError",
    "OwnerLock",
    "check_free",
    "check_mode",
    "describe",
    "holder_record",
    "read_record",
]

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""``flock`` errors of a file system that keeps no locks."""


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


MODES = ("auto", "lease")
"""``auto``: ``flock``, and a lease where the file system refuses locks; ``lease``: a lease only (for
mounts where ``flock`` succeeds but is not shared between nodes: NFS with ``local_lock``)."""


def check_mode(mode: str, name: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else ValueError naming ``name`` and the choices."""
    if mode not in MODES:
        raise ValueError(
            f"{name}={mode!r}: one of {', '.join(MODES)} (lease: for file systems whose locks are not "
            "shared between nodes)"
        )
    return mode


def check_free(path: str, way_on: str, mode: str = "auto", lease_timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Refuse if another process holds ``path`` (its ``flock``, or a live lease); take nothing,
    create nothing.

    Args:
        path: the lock file (it may not exist: then the output is free).
        way_on: what the user can do, appended to the message (wait, another output).
        mode: one of :data:`MODES`.
        lease_timeout: seconds after which a lease without a heartbeat counts as free.

    Raises:
        LockHeldError: held, naming the holder (host, PID, Slurm job, since when) and ``way_on``.
        LockFileError: a lock file that is not ours, cannot be opened, or whose lease's heartbeat
            lies in the future.
    """
    if check_mode(mode, "lock mode") == "auto":
        fd = _open(path, create=False)
        if fd is None:
            return
        try:
            if _try_lock(fd, path) is False:
                raise _held_error(path, fd, way_on)
        finally:
            os.close(fd)  # drops a lock taken just now
    check_lease_free(path, way_on, lease_timeout)  # not another program's file; no live lease in it


class OwnerLock:
    """The exclusive hold of one output, from :meth:`acquire` to :meth:`release` (or the process's
    end): an OS lock, or a lease (:mod:`data_tools.lease`) where ``mode`` says so or the file system
    keeps no locks.

    Args:
        path: the lock file (created if missing; deleted by :meth:`release`).
        what: what the holder does, for the record (``"a training run"``).
        way_on: appended to the refusal a second process gets (``"wait for it to end, or ..."``).
        mode: one of :data:`MODES`.
        lease_timeout: seconds without a heartbeat after which a lease may be taken over.

    Raises:
        ValueError: from the constructor, a ``mode`` or ``lease_timeout`` out of range.
        LockHeldError: from :meth:`acquire`, when another process holds it.
        LockFileError: from :meth:`acquire`, for a lock file that is not ours, cannot be opened,
            or holds a lease whose heartbeat lies in the future.
        OSError: from :meth:`acquire`, when the lock file cannot be created (a directory that is
            missing or not writable, a full disk).
    """

    def __init__(
        self, path: str, what: str, way_on: str, mode: str = "auto", lease_timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.path, self.what, self.way_on = path, what, way_on
        self.mode = check_mode(mode, "lock mode")
        self.lease_timeout = check_timeout(lease_timeout, "lease timeout")
        self.fd: int | None = None
        self.locked = False
        self.lease: Lease | None = None

    def _lock_once(self) -> tuple[int, bool | None] | None:
        """Open and ``flock`` the file: ``(fd, taken)``, or None to start again (its holder deleted
        it as it ended)."""
        fd = _open(self.path, create=True)
        try:
            taken = _try_lock(fd, self.path)
            if taken is False:
                raise _held_error(self.path, fd, self.way_on)
            if taken and not _still_names(self.path, fd):
                os.close(fd)
                return None
            text = _read(fd)
            record = read_record(self.path, text)  # another program's file is not overwritten
            if taken and record and "lease" in record:  # a lease holder (mode lease) may live elsewhere
                state, record, age = judge(self.path, text, os.fstat(fd).st_mtime, self.lease_timeout)
                if state == "live":
                    raise LockHeldError(
                        held_message(self.path, record, age, self.lease_timeout, self.way_on), record
                    )
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return fd, taken

    def acquire(self) -> OwnerLock:
        """Take the lock (or the lease) and write this process's record into the file; returns
        ``self``. On a file system without locks: a lease, said on stderr."""
        if self.mode == "lease":
            self.lease = Lease(self.path, self.what, self.way_on, self.lease_timeout).acquire()
            return self
        existed = os.path.lexists(self.path)
        while (got := self._lock_once()) is None:
            pass
        fd, taken = got
        if taken is None:
            if not existed and os.fstat(fd).st_size == 0 and _still_names(self.path, fd):
                os.unlink(self.path)  # the empty file just created to try the lock: the lease makes its own
            os.close(fd)
            print(
                f"warning: {self.path}: this file system keeps no file locks; holding the output by a lease "
                f"instead (a heartbeat every {self.lease_timeout / 4:g} s; a killed holder's lease lapses "
                f"after {self.lease_timeout:g} s)",
                file=sys.stderr,
                flush=True,
            )
            self.lease = Lease(self.path, self.what, self.way_on, self.lease_timeout).acquire()
            return self
        self.fd, self.locked = fd, True
        data = (json.dumps(holder_record(self.what), indent=1) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        with contextlib.suppress(OSError):
            os.fsync(fd)
        return self

    def release(self, remove: bool = True) -> None:
        """Drop the lock (or end the lease); with ``remove``, delete the lock file first (while
        still holding it, and only if the path still names the file this process locked)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
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
