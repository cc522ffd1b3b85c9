"""Where a run writes: an unwritable directory refused before the run starts, and the cause of a
failed checkpoint write named (a full disk, a quota, a read-only file system).

``torch.save`` writes through its own C++ stream: on a full disk it raises
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 3988``, without
the errno. :func:`write_failure` recovers the cause after the fact: the errno of an ``OSError`` in
the exception's chain (Python's own writes keep it), or else the errno of a small probe write into
the same directory, which a full disk (ENOSPC), an exhausted quota (EDQUOT) or a read-only file
system (EROFS) refuses as it refused the checkpoint.

Pure Python (no torch): the preflight imports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

from megaformer.config import ConfigError

PROBE_BYTES = 1 << 20
"""Bytes of the probe write that asks the file system why a checkpoint write failed."""

_CAUSES = {
    errno.ENOSPC: (
        "no space left on device",
        "free space there (the partial checkpoint first), or set output.dir on a larger disk, and resume",
    ),
    errno.EDQUOT: (
        "disk quota exceeded",
        "free space under your quota or have it raised (quota -s, or the cluster's storage-quota "
        "command), and resume",
    ),
    errno.EROFS: (
        "read-only file system",
        "remount it read-write or set output.dir on a writable file system, and resume",
    ),
    errno.EACCES: (
        "permission denied",
        "make the directory writable for this user (chmod u+w) or set output.dir elsewhere, and resume",
    ),
}


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor (absolute)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def unwritable(path: str) -> str | None:
    """Why this process could not create or write the directory ``path``; None when it can.

    A missing ``path`` is judged by its closest existing ancestor (where it would be created). A
    read-only file system is named as such (``statvfs``), also for root, whom permissions do not
    stop.
    """
    anchor = nearest_existing(path)
    if not os.path.isdir(anchor):
        return f"{anchor} is a file, not a directory"
    if os.access(anchor, os.W_OK | os.X_OK):
        return None
    if os.statvfs(anchor).f_flag & os.ST_RDONLY:
        return f"{anchor} is on a read-only file system"
    mode = stat.filemode(os.stat(anchor).st_mode)
    return f"{anchor} is not writable by this user (uid {os.getuid()}, permissions {mode})"


def check_writable(path: str, key: str, what: str) -> None:
    """Refuse a directory the run must write (or create) but cannot.

    Args:
        path: the directory (it may not exist yet).
        key: the config key that names it, for the message.
        what: what the run writes there, for the message.

    Raises:
        ConfigError: naming the key, the path, why (read-only file system, permissions, a file in
            the way) and the fix.
    """
    why = unwritable(path)
    if why is not None:
        raise ConfigError(
            f"{key}='{path}': the run writes {what} there, but {why}; set {key} to a writable "
            "directory, or make it writable (chmod u+w, or remount the file system read-write)"
        )


def os_errno(error: BaseException) -> int | None:
    """The errno of the first ``OSError`` in ``error``'s chain (itself, its cause, its context)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno
        error = error.__cause__ or error.__context__
    return None


def probe(directory: str, size: int = PROBE_BYTES) -> OSError | None:
    """Write ``size`` bytes into ``directory`` (or its closest existing ancestor), fsync them and
    remove the file; return the ``OSError`` the file system raised, or None."""
    path = os.path.join(nearest_existing(directory), f".megaformer-probe.{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    return None


def bytes_under(directory: str) -> int:
    """Total size of the files under ``directory`` (0 when it is gone)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def write_failure(directory: str, error: BaseException) -> tuple[str, bool]:
    """Say why writing under ``directory`` failed with ``error``.

    Returns:
        ``(sentence, named)``: the cause (no space left on device, quota, read-only, permission)
        where the errno or a probe write tells it, with the bytes written under ``directory``, the
        free space on its file system and the fix (``named`` True); else the error itself with the
        same figures (``named`` False).
    """
    code = os_errno(error)
    if code not in _CAUSES:
        refused = probe(directory)
        code = refused.errno if refused is not None else code
    written = bytes_under(directory)
    free = shutil.disk_usage(nearest_existing(directory)).free
    figures = f"{written:,} bytes written under {directory}, {free:,} bytes free on its file system"
    original = f"{type(error).__name__}: {error}"
    if code in _CAUSES:
        cause, fix = _CAUSES[code]
        return f"{cause} ({figures}; {original}): {fix}", True
    return f"{original} ({figures})", False
