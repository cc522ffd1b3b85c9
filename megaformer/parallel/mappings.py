"""Communication for tensor parallelism as a few named autograd functions.

Each function pairs a forward collective with the backward collective that makes autograd correct
(Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053, Sec. 3, the "f" and "g" operators):

==========================  =======================  ==========================
function                    forward                  backward
==========================  =======================  ==========================
``copy_to_tp_region``       identity                 all-reduce (sum)
``reduce_from_tp_region``   all-reduce (sum)         identity
``sum_across_tp_region``    all-reduce (sum)         all-reduce (sum)
``scatter_to_tp_region``    keep own last-dim slice  all-gather along last dim
``gather_from_tp_region``   all-gather last dim      keep own last-dim slice
==========================  =======================  ==========================

Every function takes the process group explicitly and is the identity when the group is ``None``
or has one rank, so single-process code pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megaformer.parallel.utils import divide, tp_world_size


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # Reduce a private copy: the caller's tensor may be saved by autograd elsewhere.
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    size = divide(x.shape[-1], world_size)
    return x.narrow(-1, dist.get_rank(group) * size, size).contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumAcrossTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: forward identity, backward all-reduce.

    Use before a column-parallel matmul: each rank's backward yields only its shard's part of
    ``dL/dx``; the all-reduce sums them. Shape and dtype unchanged.
    """
    if tp_world_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by summing partial results: forward all-reduce, backward identity.

    Use after a row-parallel matmul: the summed output is replicated, so its gradient already is
    the same on every rank. Shape and dtype unchanged.
    """
    if tp_world_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def sum_across_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum per-rank partial values that every rank then consumes with its own shard.

    Forward all-reduce AND backward all-reduce: each rank's consumer contributes only part of the
    gradient of the sum, so the true gradient is the sum over ranks (used for the per-token
    statistics of :class:`~megaformer.parallel.layers.ShardedLayerNorm`). Shape and dtype unchanged.
    """
    if tp_world_size(group) == 1:
        return x
    return _SumAcrossTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient.

    ``x``: ``[..., n]`` (replicated) -> ``[..., n / tp_size]``. Raises ``ValueError`` when ``n``
    does not divide by the group size.
    """
    if tp_world_size(group) == 1:
        return x
    return _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension; backward keeps this rank's slice.

    ``x``: ``[..., n / tp_size]`` -> ``[..., n]`` in rank order.
    """
    if tp_world_size(group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, group)


__all__ = [
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "sum_across_tp_region",
]
