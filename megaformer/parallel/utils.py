"""Small helpers shared by the tensor-parallel layers: group sizes, seeds, shard slicing, tags.

Nothing here holds state: every helper takes the process group it needs (``None`` means "no tensor
parallelism", i.e. a group of one).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megaformer.parallel.comm import comm_device


def divide(numerator: int, denominator: int) -> int:
    """Return ``numerator // denominator``, raising if it does not divide exactly.

    Raises:
        ValueError: when ``denominator`` is not positive or does not divide ``numerator``; the message
            names both values (e.g. heads that cannot be split evenly across the TP group).
    """
    if denominator <= 0:
        raise ValueError(f"cannot divide {numerator} into {denominator} parts: the divisor must be > 0")
    if numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by {denominator}; choose sizes that split evenly "
            f"across the tensor-parallel group"
        )
    return numerator // denominator


def tp_world_size(group: ProcessGroup | None) -> int:
    """Number of ranks in the tensor-parallel group (1 when ``group`` is None)."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside the tensor-parallel group (0 when ``group`` is None)."""
    return 0 if group is None else dist.get_rank(group)


def derive_seed(base_seed: int, name: str) -> int:
    """A seed for one parameter, from the model seed and the parameter's stable name.

    Uses CRC-32 (not Python's ``hash``, which is salted per process) so every rank and every run
    derives the same seed, independent of the order in which modules are constructed.
    """
    return (base_seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63 - 1)


def normal_full(
    shape: tuple[int, ...], std: float, seed: int, *, valid_rows: int | None = None
) -> torch.Tensor:
    """Draw the FULL (unsharded) fp32 tensor ``N(0, std²)`` from a generator seeded with ``seed``.

    Every rank draws the same full tensor and keeps its own slice, so a given seed yields the same
    model at any TP degree. ``valid_rows`` draws only ``shape[0] = valid_rows`` rows and zero-fills
    the rest: padded vocabulary rows then stay zero and the real rows do not depend on how much
    padding the TP degree demands.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = shape[0] if valid_rows is None else valid_rows
    if not 0 <= rows <= shape[0]:
        raise ValueError(f"valid_rows={valid_rows} must lie in [0, {shape[0]}] for a tensor of {shape}")
    full = torch.zeros(shape, dtype=torch.float32)
    if rows > 0 and std > 0:
        full[:rows] = torch.empty((rows, *shape[1:]), dtype=torch.float32).normal_(
            0.0, std, generator=generator
        )
    return full


def uniform_full(
    shape: tuple[int, ...], bound: float, seed: int, *, valid_rows: int | None = None
) -> torch.Tensor:
    """Draw the FULL (unsharded) fp32 tensor ``U(-bound, bound)`` from a generator seeded with
    ``seed``; as :func:`normal_full` (same slicing rule, same ``valid_rows`` zero padding).

    ``torch.nn.init.xavier_uniform_(w, gain)`` is ``bound = gain·sqrt(6 / (fan_in + fan_out))``;
    ``nn.Linear``'s default (``kaiming_uniform_(a=sqrt(5))``, and its bias) is ``bound = 1/sqrt(fan_in)``.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = shape[0] if valid_rows is None else valid_rows
    if not 0 <= rows <= shape[0]:
        raise ValueError(f"valid_rows={valid_rows} must lie in [0, {shape[0]}] for a tensor of {shape}")
    full = torch.zeros(shape, dtype=torch.float32)
    if rows > 0 and bound > 0:
        full[:rows] = torch.empty((rows, *shape[1:]), dtype=torch.float32).uniform_(
            -bound, bound, generator=generator
        )
    return full


@dataclass(frozen=True)
class InitSpec:
    """How a parameter's FULL tensor is drawn from its seed: ``kind`` ``"normal"`` (``N(0, scale²)``,
    :func:`normal_full`), ``"uniform"`` (``U(-scale, scale)``, :func:`uniform_full`) or ``"zeros"``.
    Every TP rank draws the same full tensor and keeps its slice, so the init is the same at any
    TP degree and pipeline split."""

    kind: str
    scale: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "uniform", "zeros"):
            raise ValueError(f"InitSpec kind {self.kind!r}; use 'normal', 'uniform' or 'zeros'")

    def full(self, shape: tuple[int, ...], seed: int, *, valid_rows: int | None = None) -> torch.Tensor:
        """The full fp32 tensor of ``shape`` (rows at and above ``valid_rows`` zero)."""
        if self.kind == "normal":
            return normal_full(shape, self.scale, seed, valid_rows=valid_rows)
        if self.kind == "uniform":
            return uniform_full(shape, self.scale, seed, valid_rows=valid_rows)
        return torch.zeros(shape, dtype=torch.float32)

    def scaled(self, factor: float) -> InitSpec:
        """The same kind with ``scale`` times ``factor`` (``N(0, (f·σ)²)`` is ``f·N(0, σ²)``, and
        ``U(-f·b, f·b)`` is ``f·U(-b, b)``, in distribution)."""
        return InitSpec(self.kind, self.scale * factor)


def shard(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim`` (a fresh contiguous tensor).

    Raises:
        ValueError: when ``full.shape[dim]`` is not divisible by ``world_size``.
    """
    size = divide(full.shape[dim], world_size)
    return full.narrow(dim, rank * size, size).clone().contiguous()


def mark_parallel(param: torch.nn.Parameter, partition_dim: int) -> torch.nn.Parameter:
    """Tag ``param`` as sharded across the TP group along ``partition_dim``.

    DeepSpeed 0.19 (``deepspeed.runtime.utils.is_model_parallel_parameter``) counts a parameter in
    the gradient norm on every TP rank when ``tensor_model_parallel`` (or ``model_parallel``) is
    true, and only on TP rank 0 otherwise; ``partition_dim`` / ``partition_stride`` follow Megatron's
    names so checkpoint tools can reshard.
    """
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


def mark_replicated(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag ``param`` as identical on every TP rank (counted once in DeepSpeed's gradient norm)."""
    param.tensor_model_parallel = False
    return param


def mark_no_weight_decay(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag ``param`` (bias, norm gain/shift, learned scale) for the optimizer's no-decay group."""
    param.no_weight_decay = True
    return param


def grad_norm_squared(
    parameters, tp_group: ProcessGroup | None, device: torch.device | None = None
) -> torch.Tensor:
    """Squared L2 norm of the gradients of the WHOLE model (every TP rank's share), on the device.

    A sharded parameter (``tensor_model_parallel=True``) contributes its local slice on every rank;
    a replicated one holds the same gradient on every rank and is counted on TP rank 0 only. The
    squared sums (fp32) are then all-reduced over ``tp_group``. This is the norm DeepSpeed's
    ``clip_grad_norm_`` clips with when given an mpu (``runtime/utils.py``), so the logged norm and
    the clipped one agree. Parameters without a gradient are skipped. Nothing is read to the host.

    Args:
        parameters: an iterable of parameters (each distinct tensor once: pass ``model.parameters()``).
        tp_group: tensor-parallel group, or None for a single process.
        device: where the result lives (default: the first gradient's device, else the TP group's
            communication device): it takes part in collectives, so under NCCL it must be CUDA.

    Returns:
        A float32 0-dim tensor on ``device``, the same on every TP rank.
    """

    with_grad = [p for p in parameters if p.grad is not None]
    if device is None:
        device = with_grad[0].grad.device if with_grad else comm_device(tp_group)
    total = torch.zeros((), dtype=torch.float32, device=device)
    first_rank = tp_rank(tp_group) == 0
    for p in with_grad:
        if first_rank or getattr(p, "tensor_model_parallel", False):
            total += p.grad.detach().float().pow(2).sum().to(device)
    if tp_world_size(tp_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tp_group)
    return total


def grad_norm(parameters, tp_group: ProcessGroup | None) -> float:
    """:func:`grad_norm_squared`'s square root as a Python float (a host sync: for tests and tools).

    Returns:
        The norm (0.0 without any gradient).
    """
    return float(grad_norm_squared(parameters, tp_group).sqrt())
