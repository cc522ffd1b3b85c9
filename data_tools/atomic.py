"""Failed writes as errors that name the output and the fix, and stop signals that clean up.

A data tool writes its outputs under ``.tmp`` names and renames them when complete; when a write
fails (a full disk, a quota, a file-size limit, a read-only directory) the temporaries are
removed by the writer, and :func:`write_error` turns the ``OSError`` into a
:class:`~data_tools.errors.OutputError` whose message names what was being written, says that
the temporaries are gone and gives the fix, instead of a traceback.
"""

from __future__ import annotations

import errno
import os
import signal

from data_tools.errors import OutputError

__all__ = ["OutputError", "is_output_error", "sigterm_as_interrupt", "write_error"]

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(e: OSError, output: str | os.PathLike[str]) -> OutputError | None:
    """The user-facing error for an ``OSError`` raised while writing ``output``, or ``None`` when
    ``e`` is not a write failure the user can fix (then it stays a bug with its traceback).

    Args:
        e: the error, e.g. ``OSError(ENOSPC)`` from ``write()`` or ``close()``.
        output: the output being written (a prefix or a file), for the message.

    Returns:
        An :class:`OutputError` naming ``output`` (and ``e.filename`` when known), the reason and
        the fix, for ENOSPC / EDQUOT / EFBIG (no space, quota, file-size limit) and EROFS /
        EACCES / EPERM (not writable); ``None`` otherwise.
    """
    where = f"{output}" + (f" ({e.filename})" if e.filename else "")
    if e.errno in _NO_SPACE:
        return OutputError(
            f"writing {where} failed: {e.strerror or os.strerror(e.errno)}; the partial output and "
            "its temporaries were removed: free some space (or raise the quota / file-size limit) or "
            "write to another disk, then rerun"
        )
    if e.errno in _NOT_WRITABLE:
        return OutputError(
            f"cannot write {where}: {e.strerror or os.strerror(e.errno)}; choose an output directory "
            "you can write to (or fix its permissions), then rerun"
        )
    return None


def is_output_error(e: OSError, output_prefix: str) -> bool:
    """Whether ``e`` happened on an output of ``output_prefix`` (a failed ``write()`` has no file
    name, an ``open()`` or ``mkdir()`` has one: the output, or a directory above it that had to be
    created), and not on an input."""
    if e.filename is None:
        return True
    out_dir = os.path.abspath(os.path.dirname(output_prefix) or ".")
    failed = os.path.abspath(os.fspath(e.filename))
    return failed.startswith(out_dir) or out_dir.startswith(failed)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    """Make SIGTERM (a scheduler's kill, ``timeout``) unwind like Ctrl-C, so that ``except`` and
    ``finally`` blocks remove temporaries instead of the process dying with them on disk."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
