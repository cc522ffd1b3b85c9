"""Sequence-parallel parameter gradients summed over the TP group once per optimizer step.

Under sequence parallelism each TP rank applies the replicated parameters of the LayerNorm /
dropout / residual regions (LayerNorm gains and shifts, row-parallel biases, ResScale, learned
positions) to its own slice of the tokens, so each rank's gradient is a partial sum over its tokens.
By default :func:`~megaformer.parallel.layers.sequence_region_param` wraps each such parameter in
``copy_to_tp_region``, so autograd all-reduces every parameter's gradient, every micro-batch: many
small collectives. Megatron-LM instead leaves the partial sums in ``.grad`` and, once per step
after the last micro-batch, flattens them into one buffer and all-reduces it over the TP group
(``_allreduce_layernorm_grads``). The sums are linear, so this gives the same gradients (tests).

:func:`defer_sequence_parallel_grads` marks a module's replicated parameters for that;
:func:`reduce_sequence_parallel_grads` is the per-step reduction. The DeepSpeed adapter
(:mod:`megaformer.training.ds_adapter`) installs it where the engine still holds whole gradients
at the accumulation boundary and keeps the per-micro-batch autograd path elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup

DEFERRED_ATTR = "sequence_parallel_grad_deferred"
"""Parameter attribute: its sequence-parallel gradient is summed over TP once per step, not in autograd."""


def defer_sequence_parallel_grads(module: nn.Module) -> list[nn.Parameter]:
    """Mark ``module``'s replicated parameters (``tensor_model_parallel=False``) so that
    :func:`~megaformer.parallel.layers.sequence_region_param` no longer all-reduces their gradients
    in backward. Call before the first forward, and then call :func:`reduce_sequence_parallel_grads`
    after every step's backward passes (before clipping and the optimizer).

    Returns:
        The marked parameters, in ``module.parameters()`` order.
    """
    params = [p for p in module.parameters() if getattr(p, "tensor_model_parallel", None) is False]
    for p in params:
        setattr(p, DEFERRED_ATTR, True)
    return params


def reduce_sequence_parallel_grads(
    params: Iterable[nn.Parameter],
    tp_group: ProcessGroup,
    grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad,
) -> int:
    """Sum the gradients of ``params`` over ``tp_group`` in place: one flat all-reduce per
    (dtype, device) bucket, usually exactly one per step.

    Args:
        params: the parameters :func:`defer_sequence_parallel_grads` marked.
        tp_group: the tensor-parallel group.
        grad_of: where a parameter's accumulated gradient lives (``p.grad``, or DeepSpeed's
            ``p.grad_accum`` when it accumulates in another dtype); None means no gradient.

    Returns:
        The number of all-reduces issued.
    """
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        g = grad_of(p)
        if g is not None:
            buckets.setdefault((g.dtype, g.device), []).append(g)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=tp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
    return len(buckets)


__all__ = ["DEFERRED_ATTR", "defer_sequence_parallel_grads", "reduce_sequence_parallel_grads"]
