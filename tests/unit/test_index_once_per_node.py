"""Sample indices are built once per node: local rank 0 builds (or loads) them while the node's
other ranks wait at a barrier, then those load them from the cache; an error on local rank 0 still
reaches the barrier (nobody hangs), and every rank then raises it."""

from __future__ import annotations

import pytest

from megaformer.training import builders


class _Layout:
    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank


@pytest.fixture
def events(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(builders, "_build_data", lambda cfg, stats, datasets: log.append("build") or "data")
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: log.append("barrier"))
    return log


def test_local_rank_0_builds_before_the_barrier_the_others_after(events):
    assert builders.build_data(None, _Layout(0), [], []) == "data"
    assert events == ["build", "barrier"]
    events.clear()
    assert builders.build_data(None, _Layout(3), [], []) == "data"
    assert events == ["barrier", "build"]  # after local rank 0: from the cache


def test_an_error_on_local_rank_0_still_reaches_the_barrier(events, monkeypatch):
    def broken(cfg, stats, datasets):
        events.append("build")
        raise ValueError("corrupt index")

    monkeypatch.setattr(builders, "_build_data", broken)
    with pytest.raises(ValueError, match="corrupt index"):
        builders.build_data(None, _Layout(0), [], [])
    assert events == ["build", "barrier"]
