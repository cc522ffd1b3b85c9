"""data_tools.ordered_pool.OrderedPool: results in input order with a bounded number in flight, a
worker's error raised in the caller, a worker that dies reported (not waited for), and no worker
left once the pool's block is left, however it is left."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

import pytest

from data_tools.errors import PreprocessError, WorkerError
from data_tools.ordered_pool import OrderedPool

_STATE: dict = {}


def _init(offset: int) -> None:
    _STATE["offset"] = offset


def _work(item: int) -> tuple[int, int]:
    if item == -1:
        raise ValueError("item -1 is bad")
    if item == -2:
        raise PreprocessError("in.jsonl:3: bad record")
    if item == -9:
        os.kill(os.getpid(), signal.SIGKILL)
    # uneven work, so that results come back out of order from the workers
    total = sum(range((item % 7) * 20_000))
    return item + _STATE["offset"], total


def _no_workers_left() -> None:
    assert multiprocessing.active_children() == []


def test_results_in_input_order_with_a_bounded_number_in_flight():
    taken = []

    def items():
        for i in range(60):
            taken.append(i)
            yield i

    with OrderedPool(3, _work, _init, (1000,)) as pool:
        results = []
        for result in pool.imap(items(), max_pending=5):
            # the consumer has had len(results) results; at most 5 more items may have been taken
            assert len(taken) <= len(results) + 5
            results.append(result[0])
    assert results == [i + 1000 for i in range(60)]
    _no_workers_left()


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (-2, PreprocessError)])
def test_an_error_in_a_worker_is_raised_in_the_caller(bad, error):
    with pytest.raises(error) as raised, OrderedPool(2, _work, _init, (0,)) as pool:
        list(pool.imap([1, 2, bad, 3], max_pending=4))
    if error is ValueError:  # a bug keeps the worker's traceback
        assert "in worker process" in str(raised.value.__cause__) and "_work" in str(raised.value.__cause__)
    else:  # a user's error is raised as it is
        assert str(raised.value) == "in.jsonl:3: bad record"
    _no_workers_left()


def test_a_worker_that_dies_is_reported_not_waited_for():
    pool = OrderedPool(2, _work, _init, (0,))
    with pytest.raises(WorkerError, match="killed by SIGKILL") as raised, pool:
        list(pool.imap([1, 2, -9, 3, 4], max_pending=4))
    assert "rerun" in str(raised.value)
    _no_workers_left()


def test_leaving_the_iteration_early_ends_the_workers():
    with pytest.raises(KeyboardInterrupt), OrderedPool(2, _work, _init, (0,)) as pool:
        for _ in pool.imap(range(100), max_pending=4):
            raise KeyboardInterrupt  # as SIGTERM / Ctrl-C raise it in preprocess's main process
    _no_workers_left()


class _SignalInDel:
    """An object whose collection delivers a SIGTERM to this process while its ``__del__`` runs,
    so the handler's ``KeyboardInterrupt`` is raised inside ``__del__``, where Python drops it."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        total = 0
        for i in range(10_000):  # bytecode for the handler to run in, still inside __del__
            total += i


def test_an_interrupt_dropped_in_a_del_is_raised_by_the_next_iteration(monkeypatch):
    """The CI failure of test_interrupted_run_leaves_no_output: a SIGTERM whose interrupt Python
    dropped ("Exception ignored in ... __del__") left preprocess working on; the pool's loop
    raises it again, and the workers are killed as for any interrupt."""
    from data_tools import atomic

    dropped = []  # what Python reports as "Exception ignored in": the dropped interrupt
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    atomic.sigterm_as_interrupt()
    try:

        def items():
            for i in range(50):
                if i == 3:
                    _SignalInDel()  # collected at once: the interrupt is raised and dropped
                yield i

        seen = []
        with pytest.raises(KeyboardInterrupt), OrderedPool(2, _work, _init, (0,)) as pool:
            for result in pool.imap(items(), max_pending=4):
                seen.append(result[0])
        assert dropped == [KeyboardInterrupt]  # it was dropped where it was raised
        assert len(seen) < 10  # and raised again at once, not after the rest of the work
        _no_workers_left()
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        atomic._stop_signal = None
