"""This process's place in a job: its global, local and parallel ranks, its groups and its device.

Built once per run by :func:`megaformer.training.builders.build_layout`; read by training, the
checkpoint package and the tools that run inside a job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megaformer.parallel.state import ParallelState


@dataclass(frozen=True)
class Layout:
    """This process's place in the job: its ranks, its groups and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    state: ParallelState

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.state.dp_rank

    @property
    def dp_size(self) -> int:
        return self.state.dp_size

    @property
    def tp_group(self) -> Any:
        """The tensor-parallel group, or None at tp = 1 (the layers then skip communication)."""
        return self.state.split_tp_group

    def rng_layout(self) -> dict[str, int]:
        """The coordinates a generator-state file is valid for (:mod:`megaformer.checkpoint.rng_state`)."""
        s = self.state
        return {
            "tp": s.tp_size,
            "pp": s.pp_size,
            "dp": s.dp_size,
            "tp_rank": s.tp_rank,
            "pp_rank": s.pp_rank,
            "dp_rank": s.dp_rank,
        }


def log(layout: Layout, message: str) -> None:
    """Print ``[megaformer] message`` on global rank 0."""
    if layout.is_main:
        print(f"[megaformer] {message}", flush=True)
