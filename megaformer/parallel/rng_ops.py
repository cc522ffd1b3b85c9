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
* ``megaformer::fused_attention_dropout(q, k, v, p, is_causal, backend, state) -> (out, lse, seed,
  offset, state')`` on GPUs (``model.attention_backend`` a fused kernel: ``flash``, ``efficient``,
  ``cudnn``; ``auto`` picks one by :func:`fused_attention_backend`): the kernel's own ATen forward,
  which draws its mask inside from the Philox seed and offset it takes from the generator, and
  returns them with its output and per-row log-sum-exp; its backward,
  ``megaformer::fused_attention_dropout_backward``, hands those to the kernel's ATen backward, which
  regenerates the same mask. One forward per call, as eager autograd runs it: eager mode calls the
  same kernel (``sdpa_kernel`` around ``F.scaled_dot_product_attention``), so eager and compiled
  draw the same masks from the same states;
* ``megaformer::attention_dropout(q, k, v, p, is_causal, state) -> (out, state')`` on GPUs under
  ``model.attention_backend=sdpa``: causal ``F.scaled_dot_product_attention`` with ``dropout_p=p``,
  whatever kernel eager picks there, which draws its mask inside. Its backward,
  ``megaformer::attention_dropout_backward``, reruns the same call from the same state (the same
  masks) and differentiates it: the core is recomputed, as under ``train.recompute=selective``, and
  only q, k, v and the state are kept. Measured on an H200 (BENCHMARKS.md, second loan): the rerun
  and cuDNN's dropout kernels cost 20-22 % of the 125M step; kept as the reference and fallback.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend


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


# --- attention with dropout on a fused kernel: one forward, the kernel's own backward -------------------

SDP_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
"""The ``torch.nn.attention.sdpa_kernel`` backend that makes eager SDPA run each fused kernel."""

FUSED_BACKENDS = tuple(SDP_BACKENDS)
"""``model.attention_backend`` values that name a fused SDPA kernel (besides ``auto`` and ``sdpa``)."""


@torch._dynamo.assume_constant_result
def fused_attention_backend(
    setting: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int]
) -> str | None:
    """The fused kernel attention with dropout runs on a CUDA device of compute ``capability``, or
    None for ``model.attention_backend=sdpa`` (SDPA's own choice; compiled, its forward reruns in
    backward: :func:`attention_dropout`).

    ``auto``: FlashAttention-2 (``flash``) for fp16 / bf16 on compute capability 8.0 and newer with a
    head dimension of at most 256 and a multiple of 8 (the limits of torch's ``sdp_utils`` flash
    check; the recipes' 64 and 80 pass), else the memory-efficient kernel (``efficient``: V100, fp32).
    cuDNN's kernel only when named: on the second H200 loan its dropout forward / backward ran at
    143 / 220 TFLOP/s where the same shapes without dropout ran at 368 / 310 (BENCHMARKS.md), and
    which of flash and cuDNN is faster with dropout is for the next GPU measurement to say
    (``bench/attention_backends.py``). A constant to dynamo (Python values
    in, a string out), so a compiled graph fixes the kernel at trace time.
    """
    if setting == "sdpa":
        return None
    if setting != "auto":
        return setting
    flash = (
        capability >= (8, 0)
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 256
        and head_dim % 8 == 0
    )
    return "flash" if flash else "efficient"


@torch._dynamo.assume_constant_result
def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, a constant to dynamo."""
    return tuple(torch.cuda.get_device_capability(device))


def _fused_forward(q, k, v, p: float, is_causal: bool, backend: str):
    """``(out, logsumexp, philox seed, philox offset)`` of ``backend``'s ATen forward (the outputs the
    kernel's autograd formula keeps for its backward; for flash in torch 2.13 the last two are named
    ``rng_state`` and ``unused``, and are passed on by position as torch's own formula does)."""
    aten = torch.ops.aten
    if backend == "flash":
        r = aten._scaled_dot_product_flash_attention(q, k, v, p, is_causal, False)
        return r[0], r[1], r[6], r[7]
    if backend == "efficient":
        r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, p, is_causal)
        return r[0], r[1], r[2], r[3]
    if backend == "cudnn":
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, p, is_causal, False)
        return r[0], r[1], r[6], r[7]
    raise ValueError(f"attention backend {backend!r}: use one of {', '.join(FUSED_BACKENDS)}")


def _fused_backward(grad, q, k, v, out, lse, seed, offset, p: float, is_causal: bool, backend: str):
    """``(dq, dk, dv)`` of ``backend``'s ATen backward from what :func:`_fused_forward` returned."""
    aten = torch.ops.aten
    if grad.stride(-1) != 1:  # the kernels read the gradient's rows as contiguous head vectors
        grad = grad.contiguous()
    t, s = q.shape[-2], k.shape[-2]
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, t, s, p, is_causal, seed, offset
        )
    if backend == "efficient":
        return aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, lse, seed, offset, p, [True, True, True, False], is_causal
        )[:3]
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, None, None, t, s, p, is_causal
        )
    raise ValueError(f"attention backend {backend!r}: use one of {', '.join(FUSED_BACKENDS)}")


@torch.library.custom_op("megaformer::fused_attention_dropout", mutates_args=())
def fused_attention_dropout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: float,
    is_causal: bool,
    backend: str,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention with dropout on the fused kernel ``backend`` (:data:`FUSED_BACKENDS`), its mask drawn
    from the generator state ``state``: ``(out, logsumexp, seed, offset, advanced state)``. Shapes:
    3 × ``[B, nh, T, hs]`` (fp16 / bf16 for flash) -> ``out`` ``[B, nh, T, hs]`` laid out as the
    kernel writes it, ``logsumexp`` fp32 per query row; ``seed`` / ``offset`` the Philox inputs the
    kernel drew with (its backward regenerates the mask from them, so nothing is rerun)."""
    with generator_state_as(q.device, state) as advanced:
        out, lse, seed, offset = _fused_forward(q, k, v, p, is_causal, backend)
    return out, lse, seed, offset, advanced[0]


@fused_attention_dropout.register_fake
def _(q, k, v, p, is_causal, backend, state):
    # the ATen ops' own fake kernels: the layouts, dtypes and devices the real kernels return
    out, lse, seed, offset = _fused_forward(q, k, v, p, is_causal, backend)
    return out, lse, seed, offset, torch.empty_like(state)


@torch.library.custom_op("megaformer::fused_attention_dropout_backward", mutates_args=())
def fused_attention_dropout_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    p: float,
    is_causal: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`fused_attention_dropout` with respect to q, k, v: the kernel's ATen
    backward on its saved output, log-sum-exp and Philox seed and offset (the same masks)."""
    dq, dk, dv = _fused_backward(grad, q, k, v, out, lse, seed, offset, p, is_causal, backend)
    return dq, dk, dv


@fused_attention_dropout_backward.register_fake
def _(grad, q, k, v, out, lse, seed, offset, p, is_causal, backend):
    dq, dk, dv = _fused_backward(grad, q, k, v, out, lse, seed, offset, p, is_causal, backend)
    return dq, dk, dv


def _fused_setup(ctx, inputs, output) -> None:
    q, k, v, p, is_causal, backend, _state = inputs
    out, lse, seed, offset, _advanced = output
    ctx.save_for_backward(q, k, v, out, lse, seed, offset)
    ctx.p, ctx.is_causal, ctx.backend = p, is_causal, backend


def _fused_backward_formula(ctx, grad_out, *_unused):
    q, k, v, out, lse, seed, offset = ctx.saved_tensors
    dq, dk, dv = fused_attention_dropout_backward(
        grad_out, q, k, v, out, lse, seed, offset, ctx.p, ctx.is_causal, ctx.backend
    )
    return dq, dk, dv, None, None, None, None


fused_attention_dropout.register_autograd(_fused_backward_formula, setup_context=_fused_setup)
