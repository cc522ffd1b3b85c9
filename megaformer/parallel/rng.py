"""Dropout randomness under tensor parallelism: one forked generator state per kind of region.

Where activations are *replicated* across the TP group (the residual stream without sequence
parallelism), every TP rank must drop the same elements, or the replicas drift apart. Where they
are *sharded* (attention heads, the FFN intermediate, the sequence slices under sequence
parallelism), each rank holds different elements and must draw an independent mask, or the
"random" masks of the shards repeat each other. Megatron-LM keeps a "model-parallel RNG" for the
second case (``tensor_parallel/random.py``); this is the same idea without a global tracker.

:class:`DropoutRNG` keeps two generator states, seeded from the run seed:

* ``"replicated"``: seeded by ``(seed, dp_rank, pp_rank)``: equal on the ranks of one TP group;
* ``"sharded"``: seeded by ``(seed, dp_rank, pp_rank, tp_rank)``: different on every TP rank.

``with rng.fork("sharded", x.device): y = F.dropout(x, p)`` swaps the region's state into the
default generator of the device the dropout runs on (CPU or the current CUDA device;
``F.dropout`` and the dropout inside ``F.scaled_dot_product_attention`` draw from it), runs the
block, saves the advanced state and restores the caller's, so the rest of the program's random
stream is untouched. The states follow the device of the tensors they serve: built for the CPU (the
default) and first used on CUDA (a model moved after it was built), they are re-seeded for CUDA's
generator, so the masks a run draws and the states it saves and replays are the same generator's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megaformer.parallel.utils import derive_seed

REGIONS = ("replicated", "sharded")


class DropoutRNG:
    """Per-region generator states for dropout, reproducible from the seed.

    Args:
        seed: the run seed.
        tp_rank: this process's rank in its TP group (enters only the ``"sharded"`` seed).
        dp_rank, pp_rank: data- and pipeline-parallel ranks (different replicas and stages draw
            different masks).
        device: where the dropout is expected to run; :meth:`fork` given another device type
            switches to it (see the module docstring).

    Raises:
        KeyError: :meth:`fork` with a region other than ``"replicated"`` / ``"sharded"``.
        RuntimeError: :meth:`fork` on a device of another type after masks were drawn on the first
            (their stream cannot continue on another generator).
    """

    def __init__(
        self,
        seed: int,
        *,
        tp_rank: int = 0,
        dp_rank: int = 0,
        pp_rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        base = f"dp{dp_rank}.pp{pp_rank}"
        self._seeds = {
            "replicated": derive_seed(seed, f"dropout.replicated.{base}"),
            "sharded": derive_seed(seed, f"dropout.sharded.{base}.tp{tp_rank}"),
        }
        self._states = {region: self._initial_state(s) for region, s in self._seeds.items()}
        self._drawn = False  # has any fork run yet (then the device is fixed)

    def _initial_state(self, seed: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return cuda_philox_state(seed)
        return torch.Generator().manual_seed(seed).get_state()

    def _follow(self, device: torch.device) -> None:
        """Serve ``device`` from now on: re-seed the states for its generator if nothing was drawn."""
        if device.type == self.device.type:
            if device.type == "cuda" and device.index is not None:
                self.device = device  # same kind of state; the current CUDA device's generator
            return
        if self._drawn:
            raise RuntimeError(
                f"dropout masks were drawn on {self.device} and now on {device}: move the model to its "
                "device before the first forward pass (DropoutRNG states are per generator)"
            )
        self.device = device
        self._states = {region: self._initial_state(s) for region, s in self._seeds.items()}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, region: str, device: torch.device | None = None) -> Iterator[None]:
        """Run the block with ``region``'s generator state as the default generator of ``device``
        (the device of the tensors the block draws masks for; default: :attr:`device`)."""
        if region not in self._states:
            raise KeyError(f"dropout RNG region {region!r}; use one of {REGIONS}")
        if device is not None:
            self._follow(torch.device(device))
        self._drawn = True
        outer = self._get()
        self._set(self._states[region])
        try:
            yield
        finally:
            self._states[region] = self._get()
            self._set(outer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current region states (for exact resume with dropout)."""
        return {region: state.clone() for region, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states saved by :meth:`state_dict` (on a generator of the same device type)."""
        for region in REGIONS:
            self._states[region] = states[region].clone()

    @contextlib.contextmanager
    def replaying(self, snapshot: dict[str, torch.Tensor]) -> Iterator[None]:
        """Draw again the masks drawn from ``snapshot`` (a :meth:`state_dict` taken before the
        original forward): for a recomputation under activation checkpointing. On exit the states
        are those the original forward left, so later blocks draw as if nothing was recomputed."""
        after = self.state_dict()
        self.load_state_dict(snapshot)
        try:
            yield
        finally:
            self.load_state_dict(after)


def cuda_philox_state(seed: int) -> torch.Tensor:
    """``torch.Generator("cuda").manual_seed(seed).get_state()`` without a CUDA device: CUDA's
    Philox generator state is 16 bytes, the seed (uint64) then the offset (int64, 0 after seeding),
    little-endian (``at::CUDAGeneratorImpl::get_state``; ``tests/gpu`` compares it with the real one).
    """
    raw = (seed % 2**64).to_bytes(8, "little") + (0).to_bytes(8, "little")
    return torch.tensor(list(raw), dtype=torch.uint8)
