"""Failed writes as errors that name the output and the fix, and stop signals that clean up.

A data tool writes its outputs under ``.tmp`` names and renames them when complete; when a write
fails (a full disk, a quota, a file-size limit, a read-only directory) the temporaries are
removed by the writer, and :func:`write_error` turns the ``OSError`` into a
:class:`~data_tools.errors.OutputError` whose message names what was being written, says that
the temporaries are gone and gives the fix, instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator

from data_tools.errors import OutputError

__all__ = [
    "STOP_SIGNALS",
    "OutputError",
    "is_output_error",
    "sigterm_as_interrupt",
    "stop_signals_blocked",
    "write_error",
]

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


_stop_signal: int | None = None  # the stop signal that came, once one has (see raise_if_stopped)


def _raise_interrupt(signum, frame) -> None:
    global _stop_signal
    _stop_signal = signum
    raise KeyboardInterrupt


def raise_if_stopped() -> None:
    """Raise ``KeyboardInterrupt`` if a stop signal came since :func:`sigterm_as_interrupt`.

    The handler raises at whatever bytecode the main thread is running, and when that is inside a
    ``__del__`` (a pipe's ``Connection`` collected, say) Python prints "Exception ignored in" and
    drops the exception: the run goes on as if no signal had come (seen on a loaded CI machine: a
    SIGTERM'd ``preprocess`` worked on for more than 30 s). Loops that run for long call this once
    an iteration, so a dropped interrupt is raised again at the next one. The signal stays recorded
    until the next :func:`sigterm_as_interrupt` (each command's ``main`` calls it first).

    Raises:
        KeyboardInterrupt: a stop signal came.
    """
    if _stop_signal is not None:
        raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    """Make SIGTERM (a scheduler's kill, ``timeout``) unwind like Ctrl-C, so that ``except`` and
    ``finally`` blocks remove temporaries instead of the process dying with them on disk.

    Ctrl-C gets the same handler (Python's own raises the same ``KeyboardInterrupt``), so that
    :func:`raise_if_stopped` sees both, unless the process started with SIGINT ignored: a shell
    starts a script's background jobs (``cmd &``) so, and Ctrl-C on the script must not stop them."""
    global _stop_signal
    _stop_signal = None
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _raise_interrupt)
    # A parent that started this process inside a block of its own (a Python program's
    # ``pthread_sigmask``, as multiprocessing's resource tracker does around its spawn) leaves the
    # stop signals blocked: they would wait, pending, for the run to end. One already pending is
    # raised here, as ``KeyboardInterrupt``: callers call this inside their ``try``.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block Ctrl-C and SIGTERM in this thread, and so in every thread or process started inside;
    a stop signal that came meanwhile is raised (as ``KeyboardInterrupt``) once the block is left.

    For three things. A process-directed signal goes to any thread that does not block it, and on
    CPython < 3.12 one that lands on a helper thread (tqdm's monitor) only sets a flag the main
    thread may not look at until much later: seen here, a SIGTERM went unanswered for 30 s while
    the main thread waited on a worker's result; started under this block, helper threads never
    take the stop signals. A Python handler that raises in the middle of a fork runs inside an
    at-fork hook, where the exception is printed and dropped. And a few steps must not be cut in
    two: putting an output's files in place (``.bin``, sidecar, ``.idx``), removing temporaries.
    """
    # The mask to restore is read before blocking, and the block is inside the ``try``: a handler
    # for a signal that came just before the block runs as the blocking call returns, and its
    # ``KeyboardInterrupt`` must not skip the restore (the thread, and every process it starts
    # later, would keep the stop signals blocked for good).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
