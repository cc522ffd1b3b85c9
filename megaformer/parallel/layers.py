"""Tensor-parallel building blocks: linear layers, vocabulary embedding and loss, sharded LayerNorm.

The layouts follow Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3): a column-parallel
linear splits its output features across the TP group, a row-parallel linear splits its input
features and sums the partial products, the embedding splits the vocabulary rows.

Initialisation: every rank draws the FULL weight from a ``torch.Generator`` seeded with the layer's
``seed`` and keeps its own slice, so one seed gives the same full model at every TP degree (which
is what lets tests compare TP=1 with TP=2 exactly). Parameters are tagged for DeepSpeed:
``tensor_model_parallel=True`` plus ``partition_dim`` on shards, ``False`` on replicated ones; biases
and norm parameters also carry ``no_weight_decay=True``.

All layers take ``tp_group`` (``None`` = no tensor parallelism) and keep no global state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megaformer.parallel import mappings
from megaformer.parallel.grads import DEFERRED_ATTR
from megaformer.parallel.utils import (
    InitSpec,
    derive_seed,
    divide,
    mark_no_weight_decay,
    mark_parallel,
    mark_replicated,
    normal_full,
    shard,
    tp_rank,
    tp_world_size,
)


class ColumnParallelLinear(nn.Module):
    """``y = x Aᵀ + b`` with ``A``'s output rows (and ``b``) split across the TP group.

    Args:
        in_features: input width (replicated on every rank).
        out_features: FULL output width; each rank holds ``out_features / tp_size`` of it.
        tp_group: tensor-parallel group, or None for a single process.
        bias: add a (sharded) bias.
        gather_output: all-gather the output to the full width; otherwise the output stays sharded,
            ready for a :class:`RowParallelLinear` or a sharded consumer.
        init_std: standard deviation of the normal weight initialisation.
        seed: seed of the full weight's generator.
        init: the weight's init instead of ``N(0, init_std²)`` (e.g. fairseq's uniform inits).
        bias_init: the bias's init, drawn full from ``derive_seed(seed, "bias")`` and sharded with
            the rows; None: zeros.
        num_valid_out_features: draw only this many output rows and zero-init the rest (padded
            vocabulary rows of an output layer); None draws them all.
        sequence_parallel: the input is this rank's slice of the sequence, ``[B, T / tp, in]``;
            it is all-gathered to ``[B, T, in]`` before the matmul (Korthikanti et al. 2022).

    Shapes: input ``[..., in_features]`` -> output ``[..., out_features / tp_size]`` (or
    ``[..., out_features]`` with ``gather_output``), in the input's dtype.

    Raises:
        ValueError: when ``out_features`` does not divide by the TP size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup | None = None,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        seed: int = 0,
        init: InitSpec | None = None,
        bias_init: InitSpec | None = None,
        num_valid_out_features: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
        self.out_features_per_partition = divide(out_features, tp_size)
        init = init or InitSpec("normal", init_std)
        full = init.full((out_features, in_features), seed, valid_rows=num_valid_out_features)
        self.weight = mark_parallel(nn.Parameter(shard(full, 0, rank, tp_size)), partition_dim=0)
        if bias:
            if bias_init is None:
                b = nn.Parameter(torch.zeros(self.out_features_per_partition))
            else:
                full_b = bias_init.full((out_features,), derive_seed(seed, "bias"))
                b = nn.Parameter(shard(full_b, 0, rank, tp_size))
            self.bias = mark_no_weight_decay(mark_parallel(b, partition_dim=0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_region(x, self.tp_group)  # (B, T, in_features)
        else:
            x = mappings.copy_to_tp_region(x, self.tp_group, grad_is_private=True)  # F.linear consumes it
        y = F.linear(x, self.weight, self.bias)  # (..., out_features / tp)
        if self.gather_output:
            y = mappings.gather_from_tp_region(y, self.tp_group)  # (..., out_features)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"per_partition={self.out_features_per_partition}, bias={self.bias is not None}"
        )


class RowParallelLinear(nn.Module):
    """``y = x Aᵀ + b`` with ``A``'s input columns split across the TP group; outputs are summed.

    Args:
        in_features: FULL input width; each rank holds ``in_features / tp_size`` columns.
        out_features: output width (replicated after the all-reduce).
        tp_group: tensor-parallel group, or None for a single process.
        bias: add a bias, replicated on every rank and added once, after the reduce.
        input_is_parallel: the input is already this rank's slice ``[..., in_features / tp]`` (the
            output of a :class:`ColumnParallelLinear`); if False a full input is scattered first.
        init_std: standard deviation of the normal weight initialisation.
        seed: seed of the full weight's generator.
        init: the weight's init instead of ``N(0, init_std²)`` (e.g. fairseq's uniform inits).
        bias_init: the (replicated) bias's init, drawn from ``derive_seed(seed, "bias")``; None: zeros.
        sequence_parallel: reduce-scatter the output along the sequence (``dim=1``) instead of
            all-reducing it: ``[B, T, ...]`` in, ``[B, T / tp, out_features]`` out.

    Shapes: ``[..., in_features / tp_size]`` (or ``[..., in_features]``) -> ``[..., out_features]``.

    Raises:
        ValueError: when ``in_features`` does not divide by the TP size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
        seed: int = 0,
        init: InitSpec | None = None,
        bias_init: InitSpec | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
        self.in_features_per_partition = divide(in_features, tp_size)
        full = (init or InitSpec("normal", init_std)).full((out_features, in_features), seed)
        self.weight = mark_parallel(nn.Parameter(shard(full, 1, rank, tp_size)), partition_dim=1)
        if bias:
            if bias_init is None:
                b = nn.Parameter(torch.zeros(out_features))
            else:
                b = nn.Parameter(bias_init.full((out_features,), derive_seed(seed, "bias")))
            self.bias = mark_no_weight_decay(mark_replicated(b))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` as in the class docstring; ``input_scale``, ``[in_features / tp]`` or None, multiplies
        the input features: ``(x ∘ s) Aᵀ`` computed as ``x (A diag(s))ᵀ``, a product over the weight
        (``out × in / tp``) instead of a pass over the activation (used to fold NormFormer's
        HeadScale into W_O)."""
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp_region(x, self.tp_group)  # (..., in_features / tp)
        weight = self.weight if input_scale is None else self.weight * input_scale.to(self.weight.dtype)
        y = F.linear(x, weight)  # (..., out_features), a partial sum at TP > 1
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_region(y, self.tp_group)  # (B, T/tp, out)
        else:
            y = mappings.reduce_from_tp_region(y, self.tp_group)
        if self.bias is not None:
            y = y + sequence_region_param(self.bias, self.tp_group, self.sequence_parallel)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"per_partition={self.in_features_per_partition}, bias={self.bias is not None}"
        )


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across the TP group.

    Rank ``r`` holds rows ``[r·V/tp, (r+1)·V/tp)``; each rank looks up the tokens it owns, writes
    zeros for the others, and an all-reduce assembles the full embedding.

    Args:
        num_embeddings: FULL (padded) number of rows ``V``; must divide by the TP size.
        embedding_dim: width ``d``.
        tp_group: tensor-parallel group, or None for a single process.
        init_std: standard deviation of the normal initialisation.
        seed: seed of the full table's generator.
        num_valid_embeddings: rows at and above this index (vocabulary padding) are zero-initialised
            and the real rows do not depend on the amount of padding; None draws all rows.
        sequence_parallel: reduce-scatter the embeddings along the sequence instead of all-reducing
            them: tokens ``[B, T]`` -> ``[B, T / tp, d]``, this rank's slice of the sequence.

    Shapes: tokens ``LongTensor[...]`` with values in ``[0, V)`` -> ``float32[..., d]`` (the
    weight's dtype), replicated on every rank.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: ProcessGroup | None = None,
        init_std: float = 0.02,
        seed: int = 0,
        num_valid_embeddings: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
        self.num_embeddings_per_partition = divide(num_embeddings, tp_size)
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        full = normal_full((num_embeddings, embedding_dim), init_std, seed, valid_rows=num_valid_embeddings)
        self.weight = mark_parallel(nn.Parameter(shard(full, 0, rank, tp_size)), partition_dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tp_world_size(self.tp_group) == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local = (tokens - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # (..., d), garbage rows where outside
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_region(out, self.tp_group)  # (B, T/tp, d)
        return mappings.reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"rows [{self.vocab_start_index}, {self.vocab_end_index})"
        )


def sequence_region_param(
    param: torch.Tensor, tp_group: ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """A replicated parameter as used on this rank's slice of the sequence.

    Under sequence parallelism each TP rank applies a replicated parameter (LayerNorm gain and
    shift, a bias, ResScale) to different tokens, so its local gradient is a partial sum over the
    rank's tokens. :func:`~megaformer.parallel.mappings.copy_to_tp_region` (forward identity,
    backward all-reduce) makes autograd sum those parts, so the replicas receive the same, full
    gradient and stay identical. Without sequence parallelism the parameter is returned as is.

    A parameter marked by :func:`megaformer.parallel.grads.defer_sequence_parallel_grads` (or a
    view of one, e.g. a slice of the position table) is returned as is: its partial gradient is
    summed over the TP group once per step, coalesced with the others, by
    :func:`megaformer.parallel.grads.reduce_sequence_parallel_grads`.
    """
    if not sequence_parallel:
        return param
    owner = param if param._base is None else param._base
    if getattr(owner, DEFERRED_ATTR, False):
        return param
    return mappings.copy_to_tp_region(param, tp_group)


def _num_valid_local_columns(per_partition: int, tp_group: ProcessGroup | None, vocab_size: int) -> int:
    """How many of this rank's ``per_partition`` vocabulary columns are real (not padding)."""
    start = tp_rank(tp_group) * per_partition
    return min(max(vocab_size - start, 0), per_partition)


def mask_padded_vocab(
    logits_local: torch.Tensor, tp_group: ProcessGroup | None, vocab_size: int
) -> torch.Tensor:
    """Set the columns of vocabulary padding (global index >= ``vocab_size``) to ``-inf``.

    ``logits_local``: ``[..., V_pad / tp]``, this rank's contiguous vocabulary slice. Returns a new
    tensor, or the input itself when this rank holds no padding.
    """
    valid = _num_valid_local_columns(logits_local.shape[-1], tp_group, vocab_size)
    if valid == logits_local.shape[-1]:
        return logits_local
    out = logits_local.clone()
    out[..., valid:] = -torch.inf
    return out


def _shifted_exp(
    logits_local: torch.Tensor, row_max: torch.Tensor, valid: int, inplace: bool
) -> torch.Tensor:
    """``exp(logits − row_max)`` in fp32 with the padding columns (``>= valid``) at 0:
    ``[..., V/tp]``. In place in ``logits_local`` when ``inplace`` (fp32 logits only)."""
    if inplace:
        x = logits_local.sub_(row_max.unsqueeze(-1))  # (..., V/tp), reusing the caller's buffer
    else:
        # (..., V/tp), the one large allocation: an fp32 copy shifted in place. `.float() - max`
        # would hold two fp32 [N, V/tp] tensors at once from bf16/fp16 logits (the fake-CUDA dry
        # run found that pair at the peak of every recipe's backward: 1.6 GiB at micro-batch 4).
        x = logits_local.to(torch.float32, copy=True).sub_(row_max.unsqueeze(-1))
    x[..., valid:] = -torch.inf  # padding: exp(-inf) = 0, no probability mass, no gradient
    return x


def _sum_exp_and_target(
    logits_local: torch.Tensor,
    row_max: torch.Tensor,
    local_labels: torch.Tensor,
    owned: torch.Tensor,
    valid: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (fp32, ``logits_local.shape[:-1]``): ``Σ_real exp(logit − row_max)`` and the
    label's ``logit − row_max`` (0 where another rank owns the label). Written for inductor, which
    fuses it into one pass over the logits in their own dtype (no fp32 ``[N, V/tp]`` tensor)."""
    shifted = logits_local[..., :valid].float() - row_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    target = logits_local.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).float() - row_max
    return sum_exp, target.masked_fill(~owned, 0.0)


def _cross_entropy_grad(
    logits_local: torch.Tensor,
    row_max: torch.Tensor,
    sum_exp: torch.Tensor,
    local_labels: torch.Tensor,
    owned: torch.Tensor,
    grad_loss: torch.Tensor,
    valid: int,
) -> torch.Tensor:
    """``grad_loss · (softmax − one_hot(label))`` on this rank's slice, padding columns 0, in the
    logits' dtype: the arithmetic of the unfused backward, written for inductor, which makes it one
    pass that reads the logits and writes the gradient."""
    col = torch.arange(logits_local.shape[-1], device=logits_local.device)
    softmax = (logits_local.float() - row_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    g = grad_loss.unsqueeze(-1)
    grad = torch.where(col < valid, softmax, 0.0) * g
    hit = (col == local_labels.unsqueeze(-1)) & owned.unsqueeze(-1)
    return (grad - torch.where(hit, g, 0.0)).to(logits_local.dtype)


class _FusedKernels:
    """:func:`_sum_exp_and_target` and :func:`_cross_entropy_grad` compiled on first use
    (``torch.compile``, static shapes), or run eager after a compile failure (warned once)."""

    def __init__(self) -> None:
        self.compiled: dict = {}
        self.failed: str | None = None

    def __call__(self, fn, *args):
        if self.failed is None:
            if fn not in self.compiled:
                self.compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
            try:
                return self.compiled[fn](*args)
            except torch._dynamo.exc.TorchDynamoException as e:  # nothing ran: the inputs are intact
                import warnings

                self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
                warnings.warn(
                    f"fused cross-entropy runs eager: compiling failed: {self.failed}", stacklevel=2
                )
        return fn(*args)


_FUSED = _FusedKernels()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-sharded logits, without materialising the full vocabulary.

    Forward: global max (all-reduce MAX), the target logit (from the one rank that owns it) and the
    sum of exponentials, the last two in one all-reduce SUM: two reductions of ``[N]``-sized values.
    Backward: ``softmax - one_hot(target)`` on this rank's slice.

    What is kept for backward depends on the logits' dtype. fp32: the local softmax, computed in
    the one ``[N, V/tp]`` fp32 buffer (none with ``inplace``, which matters on CPU, where the logits
    are the largest tensor of the step), and backward writes the gradient into it. bf16 / fp16:
    the logits themselves (half the bytes of an fp32 softmax) and the per-token fp32 ``row_max`` and
    ``sum_exp``; backward recomputes the softmax with the very same fp32 operations, so the gradient
    is bitwise that of the saved-softmax path, and no fp32 ``[N, V/tp]`` tensor lives between
    forward and backward.

    ``fused`` (any dtype): the sum of exponentials with the target logit, and the gradient, each
    one compiled kernel (:class:`_FusedKernels`) over the logits in their own dtype, the logits
    kept for backward as in the bf16 path: two reads in forward (the max, then the sum), one read
    and one write in backward, where the unfused bf16 path makes about ten passes over an fp32
    copy (on an H200 the loss took ~0.34 s of the 125M recipe's 1.18 s step:
    bench/results/gpu/2026-11-26-h200). Equal to the unfused path up to the order of the fp32 sum.
    """

    @staticmethod
    def forward(ctx, logits_local, labels, group, vocab_size, inplace, fused=False):
        tp_size = tp_world_size(group)
        per_partition = logits_local.shape[-1]
        start = tp_rank(group) * per_partition
        valid = _num_valid_local_columns(per_partition, group, vocab_size)

        if valid > 0:
            row_max = logits_local[..., :valid].max(dim=-1).values.float()  # (...)
        else:  # this rank holds only padding
            row_max = logits_local.new_full(logits_local.shape[:-1], -torch.inf, dtype=torch.float32)
        if tp_size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        low_precision = logits_local.dtype != torch.float32 or fused
        owned = (labels >= start) & (labels < start + per_partition)
        local_labels = (labels - start).masked_fill(~owned, 0)
        if fused:
            sum_exp, target = _FUSED(_sum_exp_and_target, logits_local, row_max, local_labels, owned, valid)
        else:
            x = _shifted_exp(logits_local, row_max, valid, inplace and not low_precision)
            target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
            exp_x = x.exp_()
            sum_exp = exp_x.sum(dim=-1)
        if tp_size > 1:
            # One collective for both per-token values.
            packed = torch.stack([target, sum_exp], dim=-1)
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            target, sum_exp = packed.unbind(-1)
        loss = torch.log(sum_exp) - target  # (...) fp32 nats

        ctx.input_dtype, ctx.valid, ctx.low_precision, ctx.fused = (
            logits_local.dtype,
            valid,
            low_precision,
            fused,
        )
        ctx.backward_done = False
        if low_precision:
            ctx.save_for_backward(logits_local, row_max, sum_exp, local_labels, owned)
        else:
            ctx.save_for_backward(exp_x.div_(sum_exp.unsqueeze(-1)), local_labels, owned)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.fused:
            logits_local, row_max, sum_exp, local_labels, owned = ctx.saved_tensors
            grad = _FUSED(
                _cross_entropy_grad, logits_local, row_max, sum_exp, local_labels, owned, grad_loss, ctx.valid
            )
            return grad, None, None, None, None, None
        if ctx.low_precision:
            logits_local, row_max, sum_exp, local_labels, owned = ctx.saved_tensors
            softmax = _shifted_exp(logits_local, row_max, ctx.valid, False).exp_().div_(sum_exp.unsqueeze(-1))
        else:
            if ctx.backward_done:
                raise RuntimeError(
                    "vocab_parallel_cross_entropy: backward reuses its buffer; run it only once"
                )
            ctx.backward_done = True
            softmax, local_labels, owned = ctx.saved_tensors
        grad = softmax.mul_(grad_loss.unsqueeze(-1))  # (..., V/tp), in place in the softmax buffer
        one_hot_part = (grad_loss * owned.to(grad.dtype)).unsqueeze(-1)  # (..., 1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -one_hot_part)
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    tp_group: ProcessGroup | None,
    vocab_size: int,
    *,
    inplace: bool = False,
    fused: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-sharded logits; never gathers the full vocabulary.

    Args:
        logits_local: ``[..., V_pad / tp_size]`` (any float dtype; computed in fp32), this rank's
            contiguous slice of the padded vocabulary.
        labels: ``LongTensor[...]`` with values in ``[0, vocab_size)``, the same on every rank.
        tp_group: tensor-parallel group, or None for a single process.
        vocab_size: real vocabulary size; columns at and above it (padding) are masked to ``-inf``
            and receive neither probability mass nor gradient.
        inplace: with fp32 logits, overwrite ``logits_local`` as the softmax buffer instead of
            allocating one of the same size (the logits are the largest tensor of a step; on CPU a
            fresh buffer costs as much as the arithmetic). Only for logits that nothing else reads
            afterwards, e.g. the output of the final matmul. Ignored with ``fused``.
        fused: compute the loss and its gradient with two compiled kernels over the logits in
            their own dtype (see :class:`_VocabParallelCrossEntropy`); the trainer turns it on
            where it compiles the blocks (``train.compile``).

    Returns:
        ``float32[...]``: ``-log softmax(logits)[label]`` in nats, replicated on every rank (reduce
        with ``.mean()`` for the usual loss). Backward may be run once per forward (it reuses
        the forward's buffer; a second backward raises ``RuntimeError``).
    """
    return _VocabParallelCrossEntropy.apply(logits_local, labels, tp_group, vocab_size, inplace, fused)


def _merged_statistics(
    xf: torch.Tensor, normalized_size: int, eps: float, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(mean, rstd)`` (fp32, ``xf.shape[:-1]``) over the full, sharded last dimension.

    Each rank computes its shard's count ``k``, mean and M2 (sum of squared deviations) in ONE pass
    over its slice: ``torch.var_mean``, a Welford reduction (Welford 1962: a running mean and M2,
    no cancellation at any ``|mean| / std``; a test checks it at 3,000). Then one all-gather of
    the ``[2, ...]`` per-shard values and the merge of Chan, Golub & LeVeque (1979) with equal
    counts: ``mean = mean_r(mean_r)``, ``M2 = Σ_r M2_r + k·Σ_r (mean_r − mean)²``. Every rank merges
    the same gathered values in the same order, so every rank gets bit-identical statistics. Never
    ``E[x²] − E[x]²``, which cancels catastrophically in fp32 when ``|mean| ≫ std``.
    """
    local_var, local_mean = torch.var_mean(xf, dim=-1, correction=0)  # (...) each, one pass
    local_m2 = local_var * xf.shape[-1]
    return merge_shard_statistics(local_mean, local_m2, xf.shape[-1], normalized_size, eps, group)


def merge_shard_statistics(
    local_mean: torch.Tensor,
    local_m2: torch.Tensor,
    shard_size: int,
    normalized_size: int,
    eps: float,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(mean, rstd)`` over the full, sharded last dimension from this rank's shard
    statistics: ``local_mean`` and ``local_m2`` (the sum of squared deviations from the shard's
    mean), fp32, of ``shard_size`` values each (every rank the same count).

    One all-gather of the ``[2, ...]`` per-shard values, then the merge of Chan, Golub & LeVeque
    (1979) with equal counts (see :func:`_merged_statistics`); with one rank, the shard is the row.
    ``rstd = 1 / sqrt(M2 / normalized_size + eps)`` (the biased variance, as LayerNorm, Ba et al.
    2016). Used by :func:`sharded_layer_norm` and by the Triton kernels of
    :mod:`megaformer.model.kernels`, which compute the shard statistics themselves.
    """
    if tp_world_size(group) == 1:
        mean, m2 = local_mean, local_m2
    else:
        stats = mappings.all_gather_stacked(torch.stack([local_mean, local_m2]), group)  # (tp, 2, ...)
        means, m2s = stats.unbind(1)  # (tp, ...) each
        mean = means.mean(dim=0)
        m2 = m2s.sum(dim=0) + shard_size * (means - mean).square().sum(dim=0)
    rstd = torch.rsqrt(m2 / normalized_size + eps)
    return mean, rstd


class _ShardedLayerNormFunction(torch.autograd.Function):
    """LayerNorm over a last dimension sharded across ``group``: forward and an explicit backward.

    Saves only the input (in its own dtype), the optional weight and the per-token fp32 ``mean`` and
    ``rstd``; the normalised ``x̂`` is recomputed in backward. Communication per call: forward one
    all-gather of ``[2, tokens]`` per-shard statistics, backward one all-reduce of ``[tokens, 2]``
    (the two row sums of the input gradient). The arithmetic is plain tensor code without
    data-dependent control flow, so ``torch.compile`` traces it (the collectives are c10d ops):
    compiled (``train.compile``, the block's graph), the forward reads the input once for the
    statistics (a Welford reduction; below 1,024 features inductor's C++ backend prefers a
    two-step mean, then variance) and once in one fused loop that normalises, scales, shifts and
    casts, and writes the output once (a test reads inductor's code); eager, the statistics are one
    pass and the normalisation one kernel per operation, in place on one fp32 buffer.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_size, eps, group):
        xf = x.float()
        mean, rstd = _merged_statistics(xf, normalized_size, eps, group)  # one pass over x
        # The normalisation, one elementwise expression: one pass when compiled (inductor fuses
        # it); eager, one kernel per operation, on one fp32 buffer.
        y = torch.sub(xf, mean.unsqueeze(-1)).mul_(rstd.unsqueeze(-1))  # x̂, (..., n / tp)
        if weight is not None:
            y = y.mul_(weight.float())
        if bias is not None:
            y = y.add_(bias.float())
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.normalized_size, ctx.group, ctx.has_bias = normalized_size, group, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)  # (..., n / tp)
        dy = grad_y.float()
        g = dy * weight.float() if weight is not None else dy  # dL/dx̂
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dL/dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)), both means over the FULL dimension:
            # one all-reduce of the two per-token row sums.
            sums = torch.stack([g.sum(dim=-1), (g * xhat).sum(dim=-1)], dim=-1)  # (..., 2)
            if tp_world_size(ctx.group) > 1:
                dist.all_reduce(sums, group=ctx.group)
            sums = sums / ctx.normalized_size
            grad_x = rstd.unsqueeze(-1) * (g - sums[..., 0:1] - xhat * sums[..., 1:2])
            grad_x = grad_x.to(x.dtype)
        lead = tuple(range(dy.ndim - 1))
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (dy * xhat).sum(dim=lead).to(weight.dtype)  # this rank's shard of the gain
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(dim=lead).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def sharded_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    normalized_size: int,
    eps: float,
    tp_group: ProcessGroup | None,
) -> torch.Tensor:
    """LayerNorm (Ba et al. 2016) over a last dimension sharded across ``tp_group``, any TP degree.

    Statistics: per token, each rank's shard mean and M2 (two passes over its slice, fp32) merged
    across the group with Chan et al.'s pairwise formula (one all-gather), which is as accurate as
    a two-pass LayerNorm over the whole row, whatever ``|mean| / std``. Backward all-reduces the
    two per-token sums of the input gradient (one collective), so the gradient is that of the
    unsharded LayerNorm. Saves the input, ``mean`` and ``rstd`` only. Always takes this path (also
    with ``tp_group=None``), which is what tests compare against ``torch.nn.functional.layer_norm``.

    Args:
        x: ``[..., normalized_size / tp]``, this rank's slice of the normalised dimension (any
            float dtype; statistics and arithmetic in fp32).
        weight, bias: ``[normalized_size / tp]`` slices of the gain and shift, or None.
        normalized_size: FULL size of the normalised dimension.
        eps: added to the variance.

    Returns:
        ``[..., normalized_size / tp]`` in ``x``'s dtype.
    """
    return _ShardedLayerNormFunction.apply(x, weight, bias, normalized_size, eps, tp_group)


class ShardedLayerNorm(nn.Module):
    """LayerNorm whose normalised (last) dimension and parameters are sharded across the TP group.

    NormFormer's FFN LayerNorm (arXiv:2110.09456, Sec. 2) normalises the FFN intermediate, which a
    column-parallel W1 leaves sharded; reducing the statistics across the group keeps the function
    identical at every TP degree (normalising each shard on its own would not). With one rank it
    calls the fused ``F.layer_norm``.

    Args:
        normalized_size: FULL size of the last dimension; must divide by the TP size.
        tp_group: tensor-parallel group, or None for a single process.
        eps: added to the variance.

    Shapes: ``[..., normalized_size / tp]`` -> same shape and dtype. Weight (init 1) and bias
    (init 0) are ``[normalized_size / tp]``, tagged sharded along dim 0 and no-weight-decay.
    """

    def __init__(self, normalized_size: int, *, tp_group: ProcessGroup | None = None, eps: float = 1e-5):
        super().__init__()
        self.tp_group = tp_group
        self.normalized_size = normalized_size
        self.eps = eps
        per_partition = divide(normalized_size, tp_world_size(tp_group))
        self.weight = nn.Parameter(torch.ones(per_partition))
        self.bias = nn.Parameter(torch.zeros(per_partition))
        for p in (self.weight, self.bias):
            mark_no_weight_decay(mark_parallel(p, partition_dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_world_size(self.tp_group) == 1:
            return F.layer_norm(x, (self.normalized_size,), self.weight, self.bias, self.eps)
        return sharded_layer_norm(
            x,
            self.weight,
            self.bias,
            normalized_size=self.normalized_size,
            eps=self.eps,
            tp_group=self.tp_group,
        )

    def extra_repr(self) -> str:
        return f"{self.normalized_size}, per_partition={self.weight.numel()}, eps={self.eps}"
