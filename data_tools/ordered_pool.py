"""Worker processes that return results in input order and stop cleanly on SIGTERM / Ctrl-C.

:class:`OrderedPool` replaces ``multiprocessing.Pool`` in ``preprocess``. The pool's workers share
one task queue whose read lock a worker holds while it waits for a task; a worker killed by SIGTERM
in that moment (a signal to the whole process group while the workers start, as Slurm and
``kill -- -PGID`` send it) takes the lock with it, and ``Pool.terminate()`` then waits for it
forever: the main process hung and a worker was orphaned (issue 22). Here each worker has its own
pipe, so no lock is shared, and stopping a pool is ``SIGKILL`` to each worker and a ``waitpid``:

* workers ignore SIGINT (a terminal's Ctrl-C reaches the whole group; the main process handles it)
  and die on SIGTERM; both arrive blocked until those handlers are in place (see
  :func:`data_tools.atomic.stop_signals_blocked`);
* a worker holds no end of any other pipe, so when the main process dies, even by SIGKILL, every
  worker reads end-of-file and exits: none is orphaned;
* a worker that dies in the middle of the run is noticed (its pipe closes, its sentinel fires) and
  reported as a :class:`~data_tools.errors.WorkerError`, instead of a result waited for forever.

Throughput (issue 24): each worker has two one-way pipes, items in and results out. The results'
pipe is enlarged to 1 MiB where Linux allows it, so that a worker hands over a result of a few
hundred KB in one write and goes on, instead of waiting for the main process to drain a 64 KiB
pipe; and a worker gets its next item while it still works on the current one when that item is
small (at most ``PIPE_BUF``, e.g. a byte range of a file for the worker to read), so it never waits
for the main process between items. A larger item goes only to a worker with nothing in flight,
which is reading, so the main process never blocks on a worker that is itself blocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import multiprocessing.connection
import select
import signal
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from data_tools.atomic import STOP_SIGNALS, raise_if_stopped, stop_signals_blocked
from data_tools.errors import DataToolsError, WorkerError

__all__ = ["OrderedPool"]

_JOIN_TIMEOUT_S = 10.0  # a worker told to exit normally that has not, after this, is killed
_RESULT_PIPE_BYTES = 1 << 20  # the results' pipe size asked for (Linux's default cap, pipe-max-size)
_READ_AHEAD_BYTES = select.PIPE_BUF  # an item this small is sent to a worker busy with another


def _worker_main(
    conn: multiprocessing.connection.Connection,
    function: Callable[[Any], Any],
    initializer: Callable[..., None] | None,
    initargs: tuple,
    inherited: list[multiprocessing.connection.Connection],
    results: multiprocessing.connection.Connection | None = None,
) -> None:
    """A worker's loop: receive an item on ``conn``, send back ``(True, result)`` or ``(False, error,
    traceback)`` on ``results`` (``conn`` itself if ``None``); return at end-of-file (the main
    process closed its end, or died) or on ``None``."""
    out = conn if results is None else results
    # Ctrl-C and SIGTERM are for the main process, which then kills the workers and cleans up; a
    # SIGTERM sent to the whole group ends a worker at once (it holds nothing anyone waits for).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for other in inherited:  # the main process's ends of the pipes, inherited by fork
        other.close()
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        try:
            reply: tuple = (True, function(item))
        except Exception as e:
            reply = (False, e, traceback.format_exc())
        try:
            out.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as e:  # an error that does not pickle goes back as text
            out.send((False, RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc()))


def _describe_exit(process: multiprocessing.process.BaseProcess) -> str:
    process.join(timeout=1.0)
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (the out-of-memory killer?)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


class OrderedPool:
    """``workers`` processes that apply ``function`` to items, results given back in input order.

    Use as a context manager: leaving it normally lets the workers finish and exit; leaving it by an
    exception (``KeyboardInterrupt`` from SIGINT / SIGTERM included) kills them with SIGKILL and
    waits for them, so no worker outlives the block.

    Args:
        workers: number of processes, >= 1.
        function: applied to each item in a worker; a module-level function (picklable).
        initializer: called once in each worker with ``initargs``, before the first item.
        initargs: its arguments.

    Raises:
        OSError: a worker could not be started (the ones started are killed first).
        KeyboardInterrupt: a stop signal came while the workers started (they are killed first).
    """

    def __init__(
        self,
        workers: int,
        function: Callable[[Any], Any],
        initializer: Callable[..., None] | None = None,
        initargs: tuple = (),
    ) -> None:
        assert workers >= 1, workers
        ctx = multiprocessing.get_context()
        forked = ctx.get_start_method() == "fork"
        self._conns: list[multiprocessing.connection.Connection] = []  # items to worker i
        self._results: list[multiprocessing.connection.Connection] = []  # results from worker i
        self._processes: list[multiprocessing.process.BaseProcess] = []
        try:
            with stop_signals_blocked():  # the workers start with the stop signals blocked
                for _ in range(workers):
                    items_in, items_out = ctx.Pipe(duplex=False)
                    results_in, results_out = ctx.Pipe(duplex=False)
                    _enlarge_pipe(results_out)
                    self._conns.append(items_out)
                    self._results.append(results_in)
                    inherited = [*self._conns, *self._results] if forked else []
                    process = ctx.Process(
                        target=_worker_main,
                        args=(items_in, function, initializer, initargs, inherited, results_out),
                        daemon=True,  # killed by multiprocessing at exit should anything miss it
                    )
                    process.start()
                    self._processes.append(process)
                    items_in.close()
                    results_out.close()
        except BaseException:  # a stop signal that came during the start is raised as the block lifts
            self.kill()
            raise

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()

    def imap(self, items: Iterable[Any], max_pending: int) -> Iterator[Any]:
        """The results of ``function`` on ``items``, in the items' order.

        At most ``max_pending`` items are taken from ``items`` and not yet given back (a slow item
        holds the later ones back), so memory stays bounded whatever the input's size. An idle
        worker gets the next item; a busy worker with one item in flight gets a second one when
        that pickles to at most ``PIPE_BUF`` bytes, so that it goes on to it without waiting for
        the main process. Sending never waits on a worker that waits itself: a large item goes
        to an idle worker, which is reading its pipe; a small one fits the pipe of a busy worker
        (whose unread bytes, if any, are the tail of the item it is reading).

        Raises:
            WorkerError: a worker died before it sent its result.
            Exception: what ``function`` raised in a worker (a ``DataToolsError`` as it is; others
                with the worker's traceback as the cause).
        """
        items = iter(items)
        in_flight: list[deque[int]] = [deque() for _ in self._processes]  # sequence numbers, oldest first
        done: dict[int, Any] = {}  # sequence number -> result
        sent = given = 0
        held: memoryview | None = None  # the next item, pickled, waiting for a worker that can take it
        exhausted = False
        while True:
            raise_if_stopped()  # an interrupt dropped in a __del__ is raised here after all
            while not exhausted and sent - given < max_pending:
                if held is None:
                    item = next(items, _END)
                    if item is _END:
                        exhausted = True
                        break
                    held = ForkingPickler.dumps(item)
                worker = self._taker(in_flight, len(held))
                if worker is None:
                    break
                self._send(worker, held)
                in_flight[worker].append(sent)
                sent += 1
                held = None
            if given in done:
                yield done.pop(given)
                given += 1
                continue
            if exhausted and given == sent:
                return
            for worker in self._wait(in_flight):
                done[in_flight[worker].popleft()] = self._receive(worker)

    @staticmethod
    def _taker(in_flight: list[deque[int]], size: int) -> int | None:
        """The worker to send an item of ``size`` pickled bytes to: an idle one, else (a small
        item) the busy one with a single item in flight that has worked on it longest; ``None``
        when none can take it now."""
        idle = [w for w, queue in enumerate(in_flight) if not queue]
        if idle:
            return idle[0]
        if size > _READ_AHEAD_BYTES:
            return None
        single = [w for w, queue in enumerate(in_flight) if len(queue) == 1]
        return min(single, key=lambda w: in_flight[w][0]) if single else None

    def _send(self, worker: int, payload: memoryview) -> None:
        try:
            self._conns[worker].send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None

    def _wait(self, in_flight: list[deque[int]]) -> list[int]:
        """The busy workers that have a result to read (or died)."""
        busy = [w for w, queue in enumerate(in_flight) if queue]
        conns = {self._results[w]: w for w in busy}
        sentinels = {self._processes[w].sentinel: w for w in busy}
        ready = multiprocessing.connection.wait([*conns, *sentinels])
        return sorted({conns[r] if r in conns else sentinels[r] for r in ready})

    def _receive(self, worker: int) -> Any:
        conn = self._results[worker]
        try:
            if not conn.poll():  # its sentinel fired, and it sent nothing
                raise EOFError
            reply = conn.recv()
        except (EOFError, OSError):
            raise self._died(worker) from None
        if reply[0]:
            return reply[1]
        _, error, remote_traceback = reply
        if isinstance(error, DataToolsError):
            raise error
        raise error from RuntimeError(f"in worker process {self._processes[worker].pid}:\n{remote_traceback}")

    def _died(self, worker: int) -> WorkerError:
        process = self._processes[worker]
        return WorkerError(
            f"worker process {process.pid} {_describe_exit(process)} in the middle of the run; the "
            "other workers were stopped and nothing was written: rerun (with fewer --workers if the "
            "machine ran out of memory)"
        )

    def close(self) -> None:
        """Tells the workers to exit and waits for them (killing any that has not after 10 s)."""
        with stop_signals_blocked():  # a stop signal now is raised once the workers are gone
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(None)
            for process in self._processes:
                process.join(timeout=_JOIN_TIMEOUT_S)
            self.kill()

    def kill(self) -> None:
        """Kills every worker (SIGKILL) and waits for each: none outlives this call."""
        with stop_signals_blocked():  # not cut short by a second signal
            for process in self._processes:
                if process.exitcode is None:
                    with contextlib.suppress(OSError):
                        process.kill()
            for process in self._processes:
                process.join()
            for conn in [*self._conns, *self._results]:
                conn.close()
            self._processes, self._conns, self._results = [], [], []


def _enlarge_pipe(conn: multiprocessing.connection.Connection) -> None:
    """Asks Linux for a ``_RESULT_PIPE_BYTES`` pipe behind ``conn``; keeps the default size (64 KiB)
    where that is refused (another OS, or the per-user limit on pipe memory reached)."""
    with contextlib.suppress(AttributeError, OSError):  # F_SETPIPE_SZ: Linux, Python >= 3.10
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, _RESULT_PIPE_BYTES)


_END = object()
