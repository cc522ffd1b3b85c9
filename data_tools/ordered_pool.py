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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from data_tools.atomic import STOP_SIGNALS, stop_signals_blocked
from data_tools.errors import DataToolsError, WorkerError

__all__ = ["OrderedPool"]

_JOIN_TIMEOUT_S = 10.0  # a worker told to exit normally that has not, after this, is killed


def _worker_main(
    conn: multiprocessing.connection.Connection,
    function: Callable[[Any], Any],
    initializer: Callable[..., None] | None,
    initargs: tuple,
    inherited: list[multiprocessing.connection.Connection],
) -> None:
    """A worker's loop: receive an item, send back ``(True, result)`` or ``(False, error, traceback)``;
    return at end-of-file (the main process closed its end, or died) or on ``None``."""
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
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as e:  # an error that does not pickle goes back as text
            conn.send((False, RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc()))


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
        self._conns: list[multiprocessing.connection.Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        try:
            with stop_signals_blocked():  # the workers start with the stop signals blocked
                for _ in range(workers):
                    parent_end, child_end = ctx.Pipe(duplex=True)
                    self._conns.append(parent_end)
                    inherited = list(self._conns) if forked else []
                    process = ctx.Process(
                        target=_worker_main,
                        args=(child_end, function, initializer, initargs, inherited),
                        daemon=True,  # killed by multiprocessing at exit should anything miss it
                    )
                    process.start()
                    self._processes.append(process)
                    child_end.close()
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
        holds the later ones back), so memory stays bounded whatever the input's size; each idle
        worker gets the next item.

        Raises:
            WorkerError: a worker died before it sent its result.
            Exception: what ``function`` raised in a worker (a ``DataToolsError`` as it is; others
                with the worker's traceback as the cause).
        """
        items = iter(items)
        idle = deque(range(len(self._processes)))
        busy: dict[int, int] = {}  # worker -> sequence number of its item
        done: dict[int, Any] = {}  # sequence number -> result
        sent = given = 0
        exhausted = False
        while True:
            while idle and not exhausted and sent - given < max_pending:
                item = next(items, _END)
                if item is _END:
                    exhausted = True
                    break
                worker = idle.popleft()
                self._send(worker, item)
                busy[worker] = sent
                sent += 1
            if given in done:
                yield done.pop(given)
                given += 1
                continue
            if exhausted and given == sent:
                return
            for worker in self._wait(busy):
                done[busy.pop(worker)] = self._receive(worker)
                idle.append(worker)

    def _send(self, worker: int, item: Any) -> None:
        try:
            self._conns[worker].send(item)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None

    def _wait(self, busy: dict[int, int]) -> list[int]:
        """The busy workers that have a result to read (or died)."""
        conns = {self._conns[w]: w for w in busy}
        sentinels = {self._processes[w].sentinel: w for w in busy}
        ready = multiprocessing.connection.wait([*conns, *sentinels])
        return sorted({conns[r] if r in conns else sentinels[r] for r in ready})

    def _receive(self, worker: int) -> Any:
        conn = self._conns[worker]
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
            for conn in self._conns:
                conn.close()
            self._processes, self._conns = [], []


_END = object()
