"""Dropout from a region's generator state inside a ``torch.compile`` graph, without a graph break.

Eager dropout (:meth:`~megaformer.parallel.rng.DropoutRNG.fork`) swaps a region's generator state
into the device's default generator around ``F.dropout``; dynamo cannot trace
``torch.get_rng_state`` / ``set_rng_state`` (they are marked "skipped"), so each fork split a compiled
block into pieces (5 graphs for a NormFormer block with dropout on). Nor can it trace a
``torch.Generator`` passed to a random op ("missing as_proxy()" in torch 2.13).

Here the state swap moves into two custom operators, which dynamo and AOTAutograd treat as opaque,
functional calls: the region's state is an input tensor and the advanced state an output, so the
graph carries it from one call to the next and :class:`~megaformer.parallel.rng.DropoutRNG` stores
the last one after the graph has run. Inside each operator the very eager code runs on the very
eager state, so the masks are bitwise those of eager mode (same draws, same generator, same
consumption of its stream), and checkpoints, replay under recomputation and the TP rules of the
regions are unchanged:

* ``megaformer::dropout_keep(size, stride, dtype, device, p, state) -> (keep, state')``: the keep
  mask ``F.dropout`` draws for a tensor of that layout (CPU: ``empty_like(x).bernoulli_(1 - p)``, as
  ATen's ``_dropout_impl``; CUDA: the mask of ``native_dropout``, the fused kernel ``F.dropout``
  calls there), as ``bool``. The compiled graph computes ``x * keep * scale`` itself, so inductor fuses
  it with its neighbours (residual add, LayerNorm); :func:`dropout_scale` is eager's scale.
* attention with dropout on CPUs, where eager runs ATen's math kernel: :func:`math_attention`, that
  kernel's arithmetic written out in the graph with the mask of ``dropout_keep`` (the one it draws
  for its probabilities), so inductor fuses the softmax, the mask and the scale;
* ``megaformer::attention_dropout(q, k, v, p, is_causal, state) -> (out, state')`` on GPUs: causal
  ``F.scaled_dot_product_attention`` with ``dropout_p=p``, whatever kernel eager picks there (flash,
  memory-efficient), which draws its mask inside. Its backward, ``megaformer::attention_dropout_backward``,
  reruns the same call from the same state (the same masks) and differentiates it: the core is
  recomputed, as under ``train.recompute=selective``, and only q, k, v and the state are kept.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F


def generator_state(device: torch.device) -> torch.Tensor:
    """The default generator state of ``device``'s type (CUDA: of ``device``, else the current one)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    """Make ``state`` the default generator state of ``device``'s type."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@contextlib.contextmanager
def generator_state_as(device: torch.device, state: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """Run the block with ``state`` as ``device``'s default generator state; the yielded list
    receives the advanced state on a normal exit. The caller's state is restored in any case."""
    outer = generator_state(device)
    set_generator_state(device, state)
    advanced: list[torch.Tensor] = []
    try:
        yield advanced
        advanced.append(generator_state(device))
    finally:
        set_generator_state(device, outer)


@contextlib.contextmanager
def _autograd_inside_operator() -> Iterator[None]:
    """Record autograd inside a custom operator's kernel. The dispatcher runs kernels below the
    autograd keys (``AutoDispatchBelowADInplaceOrView``), where no operation records a graph; this
    takes them out of the excluded set for the block (autocast stays excluded)."""
    C = torch._C  # noqa: N806
    excluded = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.ADInplaceOrView):
        excluded = excluded.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", value))[0]


@torch._dynamo.assume_constant_result
def dropout_scale(p: float, dtype: torch.dtype, device_type: str) -> float:
    """The factor eager ``F.dropout`` gives the kept elements, as its kernels compute it.

    CPU (ATen ``_dropout_impl``): ``noise.div_(1 - p)`` in ``dtype``, then ``x * noise``: the scale is
    ``1 / (1 - p)`` rounded to ``dtype``. CUDA (``fused_dropout_kernel_vec``): ``scale = 1.0 / pa`` with
    ``pa = float(1 - p)``, applied in float32 (``x * mask * scale``, rounded once to ``dtype``).
    A constant to dynamo (folded into the graph), so ``x * keep * scale`` is the eager product.
    """
    if device_type == "cuda":
        return _f32(1.0 / _f32(1.0 - p))
    return float(torch.ones((), dtype=dtype).div_(1.0 - p))


@torch.library.custom_op("megaformer::dropout_keep", mutates_args=())
def dropout_keep(
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    p: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep mask (``bool[size]``, laid out with ``stride``) that eager ``F.dropout(x, p)`` draws
    for a tensor ``x`` of that layout and ``dtype`` from the generator state ``state``, and the state
    after the draw (a new tensor; ``state`` itself is not modified)."""
    with generator_state_as(device, state) as advanced:
        like = torch.empty_strided(size, stride, dtype=dtype, device=device)
        if device.type == "cuda":
            keep = torch.native_dropout(like.fill_(1), p, True)[1]
        else:
            keep = like.bernoulli_(1.0 - p) != 0
    return keep, advanced[0]


@dropout_keep.register_fake
def _(size, stride, dtype, device, p, state):
    return torch.empty_strided(size, stride, dtype=torch.bool, device=device), torch.empty_like(state)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float, *, is_causal: bool
) -> torch.Tensor:
    """ATen's ``_scaled_dot_product_attention_math`` (torch 2.13), the kernel CPU eager mode runs
    for attention with dropout, written out so that a compiled graph holds it and inductor fuses its
    softmax and dropout: half-precision inputs computed in fp32, q and k each scaled by
    ``head_dim ** -0.25``, the causal mask added as ``-inf``, softmax, ``probs * keep * scale`` (the
    mask ``at::dropout`` draws for the fp32 probabilities, ``keep``: :func:`dropout_keep` of
    :func:`attention_probs_layout`), then times v. Shapes: 3 × ``[B, nh, T, hs]``, ``keep``
    ``bool[B, nh, T, T]`` -> ``[B, nh, T, hs]`` in q's dtype."""
    dtype = q.dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    factor = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    scores = (q.to(acc) * factor) @ (k.to(acc).transpose(-2, -1) * factor)  # (B, nh, T, S)
    if is_causal:
        T, S = scores.shape[-2:]  # noqa: N806  (query and key lengths)
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        scores = scores + torch.zeros(T, S, dtype=acc, device=q.device).masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, dim=-1) * keep * scale
    return (probs @ v.to(acc)).to(dtype)


def attention_probs_layout(q: torch.Tensor, k: torch.Tensor) -> tuple[list[int], list[int], torch.dtype]:
    """Size, stride and dtype of the probabilities :func:`math_attention` drops out (contiguous)."""
    size = [*q.shape[:-1], k.shape[-2]]
    stride = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        stride[i] = stride[i + 1] * size[i + 1]
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return size, stride, dtype


def _attention(q, k, v, p: float, is_causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().requires_grad_() for t in tensors]


@torch.library.custom_op("megaformer::attention_dropout", mutates_args=())
def attention_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, is_causal: bool, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)`` drawing its mask
    from ``state``; returns ``(out, advanced state)``. Shapes: ``[B, nh, T, hs]`` each -> same,
    contiguous (the layout the fake kernel promises the compiler, whatever the kernel's own).

    Run with autograd recording, as a training forward runs it, so that the kernel chosen (and its
    consumption of the generator) is the one the backward's rerun chooses."""
    with generator_state_as(q.device, state) as advanced, _autograd_inside_operator():
        out = _attention(*_leaves(q, k, v), p, is_causal).detach().contiguous()
    return out, advanced[0]


@attention_dropout.register_fake
def _(q, k, v, p, is_causal, state):
    return q.new_empty(q.shape), torch.empty_like(state)


@torch.library.custom_op("megaformer::attention_dropout_backward", mutates_args=())
def attention_dropout_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: float,
    is_causal: bool,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`attention_dropout` with respect to q, k, v: its forward rerun from the
    same ``state`` (the same masks), then differentiated."""
    with generator_state_as(q.device, state), _autograd_inside_operator():
        leaves = _leaves(q, k, v)
        grads = torch.autograd.grad(_attention(*leaves, p, is_causal), leaves, grad)
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous()


@attention_dropout_backward.register_fake
def _(grad, q, k, v, p, is_causal, state):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, p, is_causal, state = inputs
    ctx.save_for_backward(q, k, v, state)
    ctx.p, ctx.is_causal = p, is_causal


def _attention_backward(ctx, grad_out, _grad_state):
    q, k, v, state = ctx.saved_tensors
    gq, gk, gv = attention_dropout_backward(grad_out, q, k, v, ctx.p, ctx.is_causal, state)
    return gq, gk, gv, None, None, None


attention_dropout.register_autograd(_attention_backward, setup_context=_attention_setup)
