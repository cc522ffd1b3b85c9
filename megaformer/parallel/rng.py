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

:meth:`DropoutRNG.dropout` and :meth:`DropoutRNG.attention` are the calls the model makes: eager, a
fork around ``F.dropout`` / ``F.scaled_dot_product_attention``; inside ``torch.compile``, the same
draws from the same states through the opaque operators of :mod:`megaformer.parallel.rng_ops`,
which dynamo traces without a graph break (it cannot trace a fork's get / set of the generator state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.attention
import torch.nn.functional as F

from megaformer.parallel import rng_ops
from megaformer.parallel.rng_ops import generator_state, set_generator_state
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
        self._switch_to(device)

    @torch.compiler.disable  # reseeding builds torch.Generator objects, which dynamo cannot trace
    def _switch_to(self, device: torch.device) -> None:
        if self._drawn:
            raise RuntimeError(
                f"dropout masks were drawn on {self.device} and now on {device}: move the model to its "
                "device before the first forward pass (DropoutRNG states are per generator)"
            )
        self.device = device
        self._states = {region: self._initial_state(s) for region, s in self._seeds.items()}

    def _get(self) -> torch.Tensor:
        return generator_state(self.device)

    def _set(self, state: torch.Tensor) -> None:
        set_generator_state(self.device, state)

    def _state_for(self, region: str, device: torch.device | None) -> torch.Tensor:
        """``region``'s current state, to draw masks for tensors on ``device`` (default: :attr:`device`)."""
        if region not in self._states:
            raise KeyError(f"dropout RNG region {region!r}; use one of {REGIONS}")
        if device is not None:
            self._follow(torch.device(device))
        self._drawn = True
        return self._states[region]

    @contextlib.contextmanager
    def fork(self, region: str, device: torch.device | None = None) -> Iterator[None]:
        """Run the block with ``region``'s generator state as the default generator of ``device``
        (the device of the tensors the block draws masks for; default: :attr:`device`)."""
        state = self._state_for(region, device)
        outer = self._get()
        self._set(state)
        try:
            yield
        finally:
            self._states[region] = self._get()
            self._set(outer)

    def dropout(self, x: torch.Tensor, p: float, region: str) -> torch.Tensor:
        """``F.dropout(x, p, training=True)`` with the mask drawn from ``region``'s state.

        Eager: :meth:`fork` around ``F.dropout``. Under ``torch.compile``: the same mask from
        :func:`~megaformer.parallel.rng_ops.dropout_keep` (an opaque operator, no graph break) and
        ``x * keep * scale`` in the graph (fused by inductor with what surrounds it); the same
        values, bitwise where inductor computes the product as eager does (fp32). ``p`` must be a
        constant of the graph (``scale`` is folded from it): compile with ``dynamic=False``, as
        :func:`megaformer.model.compile_blocks` does, where dynamo might make it symbolic."""
        if not torch.compiler.is_compiling():
            with self.fork(region, x.device):
                return F.dropout(x, p=p, training=True)
        if p >= 1.0:  # eager drops everything without drawing
            return x * 0.0
        keep, self._states[region] = rng_ops.dropout_keep(
            x.shape, x.stride(), x.dtype, x.device, p, self._state_for(region, x.device)
        )
        return x * keep * rng_ops.dropout_scale(p, x.dtype, x.device.type)

    def keep_mask(self, x: torch.Tensor, p: float, region: str) -> tuple[torch.Tensor, float]:
        """The keep mask ``F.dropout(x, p, training=True)`` would draw from ``region``'s state, and
        the factor it gives the kept values: ``(bool[x.shape] laid out as x, scale)``. Advances the
        state as that dropout would, so a caller that applies ``x * keep * scale`` itself (a fused
        kernel: :func:`megaformer.model.kernels.layer_norm_dropout_residual`) draws eager's masks.
        ``p`` in ``(0, 1)``."""
        keep, self._states[region] = rng_ops.dropout_keep(
            x.shape, x.stride(), x.dtype, x.device, p, self._state_for(region, x.device)
        )
        return keep, rng_ops.dropout_scale(p, x.dtype, x.device.type)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: float,
        region: str,
        *,
        is_causal: bool,
        recompute: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)`` with the
        attention-dropout mask drawn from ``region``'s state: 3 × ``[B, nh, T, hs]`` -> ``[B, nh, T, hs]``.

        On a GPU, ``backend`` (``model.attention_backend``) names the fused kernel
        (:func:`~megaformer.parallel.rng_ops.fused_attention_backend`; ``auto`` picks flash or
        memory-efficient). Eager: :meth:`fork` around the call, the kernel pinned with
        ``sdpa_kernel``; compiled: :func:`~megaformer.parallel.rng_ops.fused_attention_dropout`, the
        same kernel's ATen forward in an opaque operator whose backward is the kernel's own, on the
        saved output, log-sum-exp and Philox seed and offset: one forward, the same masks as eager.
        ``backend='sdpa'``: SDPA's own choice eager, and compiled
        :func:`~megaformer.parallel.rng_ops.attention_dropout`, the eager call in an operator whose
        backward reruns it (the reference, and the code before this switch).

        On a CPU: eager, :meth:`fork` around the call (ATen's math kernel); compiled, that kernel's
        arithmetic in the graph with the mask of :func:`~megaformer.parallel.rng_ops.dropout_keep`.

        ``recompute`` (compiled only; eager callers checkpoint around this call and replay the
        states themselves): keep only q, k, v and the state for backward, which reruns the core
        and draws the same mask from the same state (``train.recompute=selective``). The GPU's
        ``sdpa`` operator always does; a fused kernel keeps its output and log-sum-exp instead
        (``O(T)`` per head, the tensors selective recomputation exists to avoid are never formed)."""
        fused = None
        if q.device.type == "cuda":
            fused = rng_ops.fused_attention_backend(
                backend, q.dtype, q.shape[-1], rng_ops.device_capability(q.device)
            )
        if not torch.compiler.is_compiling():
            with self.fork(region, q.device), _pinned_kernel(fused):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)
        state = self._state_for(region, q.device)
        if fused is not None:
            out, _lse, _seed, _offset, self._states[region] = rng_ops.fused_attention_dropout(
                q, k, v, p, is_causal, fused, state
            )
            return out
        if q.device.type == "cuda":
            out, self._states[region] = rng_ops.attention_dropout(q, k, v, p, is_causal, state)
            return out
        size, stride, dtype = rng_ops.attention_probs_layout(q, k)
        scale = rng_ops.dropout_scale(p, dtype, q.device.type)

        def core(q, k, v, state):  # a pure function of its inputs: recomputable
            keep, advanced = rng_ops.dropout_keep(size, stride, dtype, q.device, p, state)
            return rng_ops.math_attention(q, k, v, keep, scale, is_causal=is_causal), advanced

        if recompute:
            out, self._states[region] = torch.utils.checkpoint.checkpoint(
                core, q, k, v, state, use_reentrant=False, preserve_rng_state=False
            )
        else:
            out, self._states[region] = core(q, k, v, state)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current region states (for exact resume with dropout)."""
        return {region: state.clone() for region, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor], device_type: str | None = None) -> None:
        """Restore states saved by :meth:`state_dict` (on a generator of the same device type).

        Args:
            states: ``{region: generator state}``.
            device_type: the type of the generator the states come from (``"cpu"``, ``"cuda"``);
                None: told by their size (:func:`state_device_type`).

        Raises:
            GeneratorDeviceError: states of another device type than :attr:`device`'s (a CUDA
                Philox state cannot drive a CPU generator, nor the reverse); nothing is changed.
        """
        for region in REGIONS:
            saved = device_type or state_device_type(states[region])
            if saved != self.device.type:
                raise GeneratorDeviceError(
                    f"dropout generator state of region {region!r} is a {saved} generator's "
                    f"({states[region].numel()} bytes); this DropoutRNG serves {self.device.type}"
                )
        for region in REGIONS:
            self._states[region] = states[region].clone()

    def reseed(self, salt: str) -> None:
        """Re-seed every region for :attr:`device`'s generator from the run seed, this rank's
        coordinates and ``salt`` (e.g. ``"resumed at step 40 on cpu"``): the same states on every
        run that passes the same salt, independent of the states of the initial seed."""
        self._seeds = {region: derive_seed(s, salt) for region, s in self._seeds.items()}
        self._states = {region: self._initial_state(s) for region, s in self._seeds.items()}

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


def _pinned_kernel(fused: str | None) -> contextlib.AbstractContextManager:
    """Eager SDPA restricted to the fused kernel ``fused`` (the one the compiled operator calls), or
    left to its own choice (None)."""
    if fused is None:
        return contextlib.nullcontext()
    return torch.nn.attention.sdpa_kernel([rng_ops.SDP_BACKENDS[fused]])


class GeneratorDeviceError(RuntimeError):
    """Generator states of one device type offered to a generator of another."""


CUDA_STATE_BYTES = 16
"""Size of CUDA's Philox generator state (seed and offset, :func:`cuda_philox_state`); a CPU
generator's (Mersenne Twister) is 5056 bytes."""


def state_device_type(state: torch.Tensor) -> str:
    """The device type a generator state belongs to, told by its size: ``"cuda"`` for a 16-byte
    Philox state, else ``"cpu"``. For states saved before checkpoints recorded the type."""
    return "cuda" if state.numel() == CUDA_STATE_BYTES else "cpu"


def cuda_philox_state(seed: int) -> torch.Tensor:
    """``torch.Generator("cuda").manual_seed(seed).get_state()`` without a CUDA device: CUDA's
    Philox generator state is 16 bytes, the seed (uint64) then the offset (int64, 0 after seeding),
    little-endian (``at::CUDAGeneratorImpl::get_state``; ``tests/gpu`` compares it with the real one).
    """
    raw = (seed % 2**64).to_bytes(8, "little") + (0).to_bytes(8, "little")
    return torch.tensor(list(raw), dtype=torch.uint8)
