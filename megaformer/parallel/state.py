"""The process groups of a ``tp × pp × dp`` job, built once and handed down (no module globals).

Rank grid: axes ``(pipe, data, model)`` with the tensor-parallel ("model") axis varying fastest, the
layout of DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``::

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

so the ranks of one TP group are consecutive (on GPUs: inside one node, where the frequent TP
all-reduces need the fast links), a data-parallel group is every ``tp``-th rank of one pipeline
stage, and a pipeline group strides over ``dp · tp``.

:class:`ParallelState` also *is* the ``mpu`` DeepSpeed takes in ``deepspeed.initialize(mpu=...)``: it
answers the calls DeepSpeed 0.19 makes on an mpu (``grep -r "mpu.get_" deepspeed``), so ZeRO
partitions and the gradient all-reduce run over the data-parallel group only, and the gradient
norm is summed over the model-parallel group. It deliberately has no ``get_sequence_parallel_*``
methods: DeepSpeed reads those as *Ulysses* sequence parallelism (a different scheme that splits
the data-parallel world), not Megatron's sequence parallelism inside the TP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, *, tp: int, dp: int) -> int:
    """Global rank at grid coordinates ``(pipe, data, model)``; the model axis varies fastest."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def coords_of(rank: int, *, tp: int, dp: int) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of a global rank (inverse of :func:`rank_of`)."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


@dataclass(frozen=True)
class RankGrid:
    """The group memberships of a ``tp × pp × dp`` grid, as lists of global ranks (no processes).

    Each ``*_groups`` list partitions ``range(tp · pp · dp)``; groups are listed in the order every
    process must create them, and every member list is sorted.
    """

    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: every parallel degree must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def _rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return rank_of(pp_rank, dp_rank, tp_rank, tp=self.tp, dp=self.dp)

    @property
    def tp_groups(self) -> list[list[int]]:
        """Ranks that shard one layer's tensors (consecutive ranks)."""
        return [[self._rank(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    @property
    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard of the same stage: the gradient all-reduce / ZeRO group."""
        return [[self._rank(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    @property
    def pp_groups(self) -> list[list[int]]:
        """Ranks holding the stages of one pipeline."""
        return [[self._rank(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    @property
    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (TP × PP: one full model replica), DeepSpeed's "model parallel"."""
        return [
            sorted(self._rank(p, d, t) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
        ]


class ParallelState:
    """This process's tensor-, pipeline-, data- and model-parallel groups and ranks.

    Build it with :meth:`build` after the default process group exists; pass ``tp_group`` to the
    model and the object itself as ``mpu=`` to ``deepspeed.initialize``.

    Attributes:
        grid: the :class:`RankGrid`.
        rank: global rank.
        tp_rank, pp_rank, dp_rank: coordinates on the grid.
        tp_group, pp_group, dp_group, mp_group: this process's groups (``ProcessGroup``).
        tp_size, pp_size, dp_size: the degrees.
    """

    def __init__(self, grid: RankGrid, rank: int, groups: dict[str, tuple[ProcessGroup, list[int]]]):
        self.grid = grid
        self.rank = rank
        self.tp_size, self.pp_size, self.dp_size = grid.tp, grid.pp, grid.dp
        self.pp_rank, self.dp_rank, self.tp_rank = coords_of(rank, tp=grid.tp, dp=grid.dp)
        self.tp_group, self.tp_ranks = groups["tp"]
        self.dp_group, self.dp_ranks = groups["dp"]
        self.pp_group, self.pp_ranks = groups["pp"]
        self.mp_group, self.mp_ranks = groups["mp"]

    @property
    def split_tp_group(self) -> ProcessGroup | None:
        """The tensor-parallel group where the model is split (tp > 1), else None: what the layers
        take (None: no TP communication) and what picks a collective's device."""
        return self.tp_group if self.tp_size > 1 else None

    @classmethod
    def build(cls, tp: int, pp: int, dp: int, *, timeout: Any = None) -> ParallelState:
        """Create every group of the ``tp × pp × dp`` grid (collectively, on every rank).

        Args:
            tp, pp, dp: tensor-, pipeline- and data-parallel degrees.
            timeout: optional ``datetime.timedelta`` for the new groups' collectives.

        Raises:
            RuntimeError: the default process group is not initialised.
            ValueError: ``tp · pp · dp`` differs from the world size (names the three and the fix).
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelState.build needs the default process group; initialise it first")
        grid = RankGrid(tp, pp, dp)
        world_size = dist.get_world_size()
        if grid.world_size != world_size:
            raise ValueError(
                f"tp={tp} × pp={pp} × dp={dp} = {grid.world_size} processes, but the world has "
                f"{world_size}; launch tp × pp × dp processes or change parallel.tp_size / pp_size"
            )
        rank = dist.get_rank()
        mine: dict[str, tuple[ProcessGroup, list[int]]] = {}
        kwargs = {} if timeout is None else {"timeout": timeout}
        for kind, lists in (
            ("tp", grid.tp_groups),
            ("dp", grid.dp_groups),
            ("pp", grid.pp_groups),
            ("mp", grid.mp_groups),
        ):
            for ranks in lists:
                # new_group is collective: every rank creates every group, in the same order.
                group = dist.new_group(ranks, **kwargs)
                if rank in ranks:
                    mine[kind] = (group, ranks)
        return cls(grid, rank, mine)

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, tp {self.tp_rank}/{self.tp_size} {self.tp_ranks}, "
            f"dp {self.dp_rank}/{self.dp_size} {self.dp_ranks}, pp {self.pp_rank}/{self.pp_size})"
        )

    # --- the mpu interface DeepSpeed 0.19 calls --------------------------------------------------
    # "model parallel" = one model replica (TP × PP), as in DeepSpeed's PipelineParallelGrid: the
    # gradient-norm sum and the checkpoint's mp_rank_XX file index use it.

    def get_model_parallel_rank(self) -> int:
        return self.mp_ranks.index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.mp_ranks)

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.mp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this process's TP group (broadcast source)."""
        return self.tp_ranks[0]

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        return self.pp_group

    def get_slice_parallel_rank(self) -> int:
        return self.tp_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.tp_size

    def get_slice_parallel_group(self) -> ProcessGroup:
        return self.tp_group

    def mpu(self) -> ParallelState:
        """The object to pass as ``deepspeed.initialize(mpu=...)`` (this state itself)."""
        return self
