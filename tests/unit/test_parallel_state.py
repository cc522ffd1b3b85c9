"""The rank grid of ParallelState agrees with DeepSpeed's PipeModelDataParallelTopology (no processes)."""

from __future__ import annotations

import itertools

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megaformer.parallel.state import RankGrid, coords_of, rank_of


def _as_sets(groups: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(g) for g in groups}


@pytest.mark.parametrize(("tp", "pp", "dp"), list(itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3))))
def test_groups_equal_deepspeed_topology(tp, pp, dp):
    grid = RankGrid(tp, pp, dp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert _as_sets(grid.tp_groups) == _as_sets(topo.get_axis_comm_lists("model"))
    assert _as_sets(grid.dp_groups) == _as_sets(topo.get_axis_comm_lists("data"))
    assert _as_sets(grid.pp_groups) == _as_sets(topo.get_axis_comm_lists("pipe"))
    # DeepSpeed's "model parallel" group: every rank of one data-parallel coordinate.
    assert _as_sets(grid.mp_groups) == {tuple(sorted(topo.get_axis_list("data", d))) for d in range(dp)}
    for rank in range(grid.world_size):
        coord = topo.get_coord(rank)
        assert coords_of(rank, tp=tp, dp=dp) == (coord.pipe, coord.data, coord.model)
        assert rank_of(coord.pipe, coord.data, coord.model, tp=tp, dp=dp) == rank
    if tp > 1:
        assert all(g == list(range(g[0], g[0] + tp)) for g in grid.tp_groups)  # consecutive ranks


def test_bad_degree_is_named():
    with pytest.raises(ValueError, match="tp=0"):
        RankGrid(0, 1, 1)
