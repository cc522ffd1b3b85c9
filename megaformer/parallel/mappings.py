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

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2, the "g" and "ḡ"
operators) keeps the activations of the LayerNorm / dropout / residual regions split along the
sequence dimension instead of replicated; the all-reduce of a row-parallel output becomes a
reduce-scatter and the copy before a column-parallel input becomes an all-gather:

======================================  ==========================  ==========================
function                                forward                     backward
======================================  ==========================  ==========================
``scatter_to_sequence_region``          keep own sequence slice     all-gather along sequence
``gather_from_sequence_region``         all-gather along sequence   reduce-scatter (sum)
``reduce_scatter_to_sequence_region``   reduce-scatter (sum)        all-gather along sequence
======================================  ==========================  ==========================

The sequence dimension is ``dim=1`` by default (this project's ``[B, T, d]`` activations); rank
``r`` of a group of ``n`` holds tokens ``[r·T/n, (r+1)·T/n)``.

Every function takes the process group explicitly and is the identity when the group is ``None``
or has one rank, so single-process code pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megaformer.parallel.utils import divide, tp_world_size

# torch >= 2.10 names the single-tensor collectives ``all_gather_single`` / ``reduce_scatter_single``
# (the ``*_into_tensor`` / ``*_tensor`` names are deprecated aliases). Both NCCL and gloo implement
# them (gloo checked on torch 2.13: ``tests/distributed/test_tp_layers.py`` runs every mapping on it),
# so there is no list-based fallback: one flat buffer, one collective, no ``torch.cat``.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place when it is contiguous (else on a contiguous copy); returns
    the reduced tensor. Callers pass only buffers that nothing else reads."""
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # Reduce a private copy: the caller's tensor may be read by autograd or by another branch.
    return _all_reduce_(x.clone(memory_format=torch.contiguous_format), group)


def _reduce_in_place_forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward all-reduce without a copy: the input (a fresh matmul output in every caller) is
    reduced in place and marked dirty, so autograd raises, instead of computing a wrong gradient,
    if anything had saved it. A leaf that requires grad, a view, or a non-contiguous input is
    reduced on a copy instead; so is every input under ``torch.compile``, whose graph is functional
    anyway (dynamo traces ``mark_dirty`` only where autograd records the call, not under no_grad)."""
    if torch.compiler.is_compiling():
        return _all_reduce(x, group)
    if x.is_contiguous() and x._base is None and not (x.is_leaf and x.requires_grad):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        ctx.mark_dirty(x)
        return x
    return _all_reduce(x, group)


def all_gather_stacked(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new leading dimension in rank order: ``[n, *x.shape]``.

    One ``all_gather_single`` into one contiguous buffer. No autograd (use the mappings below).
    """
    x = x.contiguous()
    n = dist.get_world_size(group)
    out = x.new_empty(n * x.numel())  # flat: gloo takes only the concatenated form, not a stack
    _all_gather_single(out, x.view(-1), group=group)
    return out.view(n, *x.shape)


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    size = divide(x.shape[-1], world_size)
    return x.narrow(-1, dist.get_rank(group) * size, size).contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _gather_dim(x, -1, group)


def _split_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = divide(x.shape[dim], dist.get_world_size(group))
    return x.narrow(dim, dist.get_rank(group) * size, size).contiguous()


def _gather_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``: gathered rank-major along a new dim 0 (one
    contiguous buffer), then the rank dimension moved next to ``dim`` and merged with it. The
    rearrangement is a view when every dimension before ``dim`` has size 1 (e.g. batch 1 along the
    sequence), one copy otherwise."""
    dim = dim % x.ndim
    stacked = all_gather_stacked(x, group)  # (n, *x.shape)
    return stacked.movedim(0, dim).flatten(dim, dim + 1)  # (..., n · x.shape[dim], ...)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's ``1/n`` slice of ``dim``: the slices are laid
    out rank-major along a new dim 0 (a view when the dimensions before ``dim`` have size 1, one
    copy otherwise), then one ``reduce_scatter_single``."""
    dim = dim % x.ndim
    world_size = dist.get_world_size(group)
    size = divide(x.shape[dim], world_size)
    chunks = x.unflatten(dim, (world_size, size)).movedim(dim, 0).contiguous()  # (n, ..., size, ...)
    out = chunks.new_empty(chunks.shape[1:])
    _reduce_scatter_single(out.view(-1), chunks.view(-1), op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, grad_is_private: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_private = group, grad_is_private
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reduce = _all_reduce_ if ctx.grad_is_private else _all_reduce
        return reduce(grad, ctx.group), None, None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _reduce_in_place_forward(ctx, x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumAcrossTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_in_place_forward(ctx, x, group)

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


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gathered tensor feeds a TP region (a column-parallel matmul): each rank's gradient
        # is a partial sum over its shard of the weight, so sum them and keep this rank's tokens.
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp_region(
    x: torch.Tensor, group: ProcessGroup | None, *, grad_is_private: bool = False
) -> torch.Tensor:
    """Enter a TP region with a replicated input: forward identity, backward all-reduce.

    Use before a column-parallel matmul: each rank's backward yields only its shard's part of
    ``dL/dx``; the all-reduce sums them. Shape and dtype unchanged.

    ``grad_is_private``: the gradient arriving in backward is a buffer nothing else reads (true when
    the only consumer of the output is a matmul, whose input gradient is a fresh product), so it is
    all-reduced in place. Otherwise (e.g. the output also feeds an addition, whose backward hands
    the same gradient tensor to both branches) it is reduced on a copy.
    """
    if tp_world_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group, grad_is_private)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by summing partial results: forward all-reduce, backward identity.

    Use after a row-parallel matmul: the summed output is replicated, so its gradient already is
    the same on every rank. Shape and dtype unchanged. The input is CONSUMED: a contiguous non-view
    tensor is reduced in place and returned (Megatron's ``_reduce``); pass a buffer nothing else
    reads, such as a matmul output. (Autograd raises if something had saved it for backward.)
    """
    if tp_world_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def sum_across_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum per-rank partial values that every rank then consumes with its own shard.

    Forward all-reduce AND backward all-reduce: each rank's consumer contributes only part of the
    gradient of the sum, so the true gradient is the sum over ranks (used for the per-token
    statistics of :class:`~megaformer.model.normformer.QKVLayerNorm`). Shape and dtype unchanged. The
    input is consumed as in :func:`reduce_from_tp_region`.
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


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Keep this rank's slice of the sequence dimension of a replicated tensor.

    ``[B, T, ...]`` -> ``[B, T / tp_size, ...]`` (for ``dim=1``); backward all-gathers the gradient.
    Raises ``ValueError`` when ``T`` does not divide by the group size.
    """
    if tp_world_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group, dim)


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """All-gather sequence slices before a TP region; backward reduce-scatters (sums) the gradient.

    ``[B, T / tp_size, ...]`` -> ``[B, T, ...]`` in rank order. Replaces :func:`copy_to_tp_region`
    in front of a column-parallel layer under sequence parallelism.
    """
    if tp_world_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence slice; backward all-gathers the gradient.

    ``[B, T, ...]`` (a partial sum on each rank) -> ``[B, T / tp_size, ...]``. Replaces
    :func:`reduce_from_tp_region` after a row-parallel layer under sequence parallelism. Raises
    ``ValueError`` when ``T`` does not divide by the group size.
    """
    if tp_world_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)


__all__ = [
    "all_gather_stacked",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "sum_across_tp_region",
]
