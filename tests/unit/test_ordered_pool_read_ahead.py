"""OrderedPool's read-ahead (issue 24): a small item goes to a worker still busy with another, a
large one only to an idle worker; results of several MB (larger than any pipe) and items of
several MB mixed with small ones come back complete and in order, without a deadlock, and a
worker that dies with an item queued behind its current one is still reported."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from data_tools.errors import WorkerError
from data_tools.ordered_pool import OrderedPool


def _echo(item):
    kind, n = item[0], item[1]
    if kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    size = n if kind == "big-result" else 8
    return kind, n, os.getpid(), np.full(size, n % 251, dtype=np.uint8)


@pytest.fixture(autouse=True)
def _deadline():
    """A deadlock fails the test after 60 s instead of hanging the suite."""

    def fail(signum, frame):
        raise TimeoutError("the pool hung")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_large_and_small_items_and_results_in_order(workers):
    items = []
    for i in range(60):
        if i % 7 == 3:
            items.append(("big-item", i, b"x" * (3 << 20)))  # 3 MB in: only to an idle worker
        elif i % 5 == 1:
            items.append(("big-result", 5 << 20))  # 5 MB out: more than the results' pipe holds
        else:
            items.append(("small", i))
    with OrderedPool(workers, _echo) as pool:
        results = list(pool.imap(iter(items), max_pending=2 * workers + 2))
    assert [(r[0], r[1]) for r in results] == [(it[0], it[1]) for it in items]
    for r in results:
        assert r[3].size == (r[1] if r[0] == "big-result" else 8) and (r[3] == r[1] % 251).all()
    assert len({r[2] for r in results}) == workers  # every worker took part


def test_a_worker_dying_with_an_item_queued_is_reported():
    items = [("small", 0), ("die", 1), ("small", 2), ("small", 3), ("small", 4), ("small", 5)]
    with pytest.raises(WorkerError, match="killed by SIGKILL"), OrderedPool(2, _echo) as pool:
        list(pool.imap(iter(items), max_pending=6))
