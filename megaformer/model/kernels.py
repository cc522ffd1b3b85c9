"""Triton kernels for NormFormer's extra operations (``model.fused_kernels``), forward and backward.

What they compute, exactly the function of the eager block (:class:`~megaformer.model.NormFormerBlock`)::

    FFN_LN(act(u)):        y = (a − μ) · rstd · γ + β,   a = act(u),  μ, rstd over the FULL ffn width
    POSTATTN_LN + residual: h = x + dropout(LN(a))       (a: W_O's output; the dropout mask is an input)

LayerNorm is Ba, Kiros & Hinton 2016 (arXiv:1607.06450, Eq. 4: ``μ = mean(a)``, ``σ² = mean((a − μ)²)``,
biased, ``rstd = 1 / sqrt(σ² + eps)``); FFN_LN is the NormFormer paper's LayerNorm on the FFN
intermediate, after the activation (Shleifer, Weston & Ott 2021, arXiv:2110.09456, Sec. 2 and Fig. 1:
``FFN(x) = W2 · LN(σ(W1 x + b1)) + b2``); POSTATTN_LN is its LayerNorm on the attention output
(same section: ``h = x + LN(MHA(LN(x)))``). ``act`` is the model's: GELU in its erf form
(Hendrycks & Gimpel 2016, ``u · Φ(u)``, what ``F.gelu`` computes by default, no tanh approximation)
or squared ReLU (So et al. 2021).

Why: on the H200 (BENCHMARKS.md, second loan) inductor's fused FFN LayerNorm + GeLU took ~0.9 ms per
call where one read and one write of the ``[65,536, 3,072]`` bf16 activation take ~0.2 ms. Here each
pass reads its inputs once and writes its outputs once:

* forward, one rank: one kernel per row reads ``u`` (W1's output, bias added), applies the
  activation, computes the row's statistics in registers (two passes over registers, not memory),
  normalises, scales, shifts and writes ``y``. Saved for backward: ``u`` (in its dtype) and the fp32
  ``μ``, ``rstd``; the activation is recomputed in backward (eager saves both ``u`` and ``act(u)``).
* backward, one rank: one kernel reads ``u`` and ``dy``, writes ``du``; the gain and shift
  gradients are accumulated per program over its rows and summed in torch (``[programs, n]``).
* under tensor parallelism (the ffn width sharded across the TP group): the statistics of the full
  row need a collective between the read and the write, so the forward is two kernels around the
  all-gather that :func:`~megaformer.parallel.layers.merge_shard_statistics` does in torch (the same
  Chan et al. merge as the eager :func:`~megaformer.parallel.layers.sharded_layer_norm`), and the
  backward two kernels around the all-reduce of the two per-token sums (as eager). ``u`` is then
  read twice per pass.
* POSTATTN_LN with its residual add: one kernel reads ``a``, the residual ``x`` and the dropout keep
  mask (one byte per element, drawn by :meth:`~megaformer.parallel.rng.DropoutRNG.keep_mask` from the
  same generator state as eager's ``F.dropout``, so the masks are eager's), writes ``h``. Backward:
  the residual's gradient is ``dh`` itself (no kernel), one kernel reads ``dh``, the mask and ``a``
  and writes ``da``.

Rounding follows eager: the activation is rounded to the input's dtype before the statistics (eager's
``F.gelu`` returns that dtype), and in the residual kernel the LayerNorm output and the dropped
values are rounded to the model's dtype before the add, as eager's separate operations round them.
Arithmetic is fp32 throughout; the backward is fp32 until the gradient is stored (eager rounds the
LayerNorm's input gradient to the dtype before the activation's backward: a little less exact).

Each kernel launch is a ``torch.library.custom_op`` (``megaformer::norm_act_*``) so that a compiled
block (``train.compile``) keeps it as one opaque call with its own fake (shape) function; eager calls
the same Python function directly (no dispatcher overhead). Kernels are Triton 3.6 (the lent H200
image's version, pinned in requirements-dev.txt); on a CPU they run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton itself is imported: the mode is chosen then, for the
whole process; tests/support/triton_interpreter.py), which is how the unit tests run them.
Speed on a GPU is unmeasured (``scripts/gpu_check.sh`` on a loan).

Raises ``ImportError`` on import when Triton is missing (the model then keeps its eager path; see
``model.fused_kernels``).
"""

# ruff: noqa: N803  (Triton's convention: pointer and constexpr arguments of kernels in capitals)
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.distributed import ProcessGroup

from megaformer.parallel.layers import merge_shard_statistics
from megaformer.parallel.utils import tp_world_size

# The activation applied before the LayerNorm (a constexpr of the kernels).
ACT_NONE, ACT_GELU, ACT_RELU2 = 0, 1, 2
ACTIVATION_CODES = {"none": ACT_NONE, "gelu": ACT_GELU, "relu2": ACT_RELU2}


def interpreted() -> bool:
    """Whether this module's kernels were built for Triton's interpreter (CPU tensors, slow)."""
    return type(_norm_act_fwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Kernels. One program per row (forward, statistics, backward sums) or per group of rows (backward,
# which accumulates the gain and shift gradients over its rows). A row is held whole in registers:
# BLOCK_N is the next power of two of its width, masked.


# Triton 3.6's interpreter casts fp32 to bf16 by truncation (its cast drops the rounding mode); the
# GPU rounds to nearest even. Under the interpreter the kernels round to nearest even themselves
# (below), so that the CPU tests check the arithmetic a GPU does. A constant of the kernels: the
# branch is not compiled for a GPU.
_EMULATE_RTNE = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest even into ``dtype`` (what a GPU's ``x.to(dtype)`` does)."""
    if _EMULATE_RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # ties to even (finite values)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _activation(u, ACT: tl.constexpr):
    """act(u) in fp32: GELU (erf form) or squared ReLU; the identity for ACT_NONE."""
    if ACT == 1:  # u · Φ(u), Φ(u) = (1 + erf(u / sqrt 2)) / 2
        a = 0.5 * u * (1.0 + tl.erf(u * 0.7071067811865476))
    elif ACT == 2:
        r = tl.maximum(u, 0.0)
        a = r * r
    else:
        a = u
    return a


@triton.jit
def _activation_grad(u, ACT: tl.constexpr):
    """d act / du in fp32: GELU's Φ(u) + u·φ(u), squared ReLU's 2·max(u, 0) (ACT_NONE: unused)."""
    if ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))
        pdf = tl.exp(-0.5 * u * u) * 0.3989422804014327  # φ(u) = exp(−u² / 2) / sqrt(2π)
        d = cdf + u * pdf
    else:
        d = 2.0 * tl.maximum(u, 0.0)
    return d


@triton.jit
def _norm_act_fwd_kernel(
    X,  # [M, N] input rows (u, or the attention output), stride_x between rows, unit stride within
    W,  # [N] gain
    B,  # [N] shift
    RES,  # [M, N] residual (HAS_RES)
    KEEP,  # [M, N] uint8 dropout keep mask, rows of stride_y (HAS_KEEP)
    Y,  # [M, N] output
    MEAN,  # [M] fp32: read (HAS_STATS) or written
    RSTD,  # [M] fp32: read (HAS_STATS) or written
    stride_x,
    stride_res,
    stride_y,
    N,
    eps,
    scale,
    ACT: tl.constexpr,
    HAS_STATS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # The activation in the input's dtype, as eager's F.gelu returns it, then fp32 again.
    a = _to(_activation(x, ACT), X.dtype.element_ty).to(tl.float32)
    if HAS_STATS:  # the full row's statistics, merged across the TP group in torch
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = (a - mean) * rstd
    else:  # the whole row is here: two passes over registers (no E[a²] − E[a]²)
        a = tl.where(mask, a, 0.0)
        mean = tl.sum(a, axis=0) / N
        diff = tl.where(mask, a - mean, 0.0)
        var = tl.sum(diff * diff, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        xhat = diff * rstd
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    y = xhat * w + b
    if HAS_RES:
        y = _to(y, Y.dtype.element_ty).to(tl.float32)  # eager: the LayerNorm's output in the dtype
        if HAS_KEEP:
            keep = tl.load(KEEP + row * stride_y + cols, mask=mask, other=0)
            y = _to(tl.where(keep != 0, y * scale, 0.0), Y.dtype.element_ty).to(tl.float32)
        y = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32) + y
    tl.store(Y + row * stride_y + cols, _to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _act_moments_kernel(
    X,  # [M, N] this rank's shard of the rows
    MEAN,  # [M] fp32, written: the shard's mean of act(x)
    M2,  # [M] fp32, written: the shard's sum of squared deviations from that mean
    stride_x,
    N,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.where(mask, _to(_activation(x, ACT), X.dtype.element_ty).to(tl.float32), 0.0)
    mean = tl.sum(a, axis=0) / N
    diff = tl.where(mask, a - mean, 0.0)
    tl.store(MEAN + row, mean)
    tl.store(M2 + row, tl.sum(diff * diff, axis=0))


@triton.jit
def _norm_act_bwd_sums_kernel(
    DY,  # [M, N] output gradient
    X,  # [M, N] the forward's input rows
    W,  # [N] gain
    MEAN,  # [M] fp32
    RSTD,  # [M] fp32
    SUMS,  # [M, 2] fp32, written: this shard's Σ g and Σ g·x̂, g = dy·γ
    stride_dy,
    stride_x,
    N,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    a = _to(_activation(x, ACT), X.dtype.element_ty).to(tl.float32)
    xhat = (a - tl.load(MEAN + row)) * tl.load(RSTD + row)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(SUMS + 2 * row, tl.sum(g, axis=0))
    tl.store(SUMS + 2 * row + 1, tl.sum(tl.where(mask, g * xhat, 0.0), axis=0))


@triton.jit
def _norm_act_bwd_kernel(
    DY,  # [M, N] gradient of the output (dh for the residual kernel)
    X,  # [M, N] the forward's input rows
    W,  # [N] gain
    MEAN,  # [M] fp32
    RSTD,  # [M] fp32
    KEEP,  # [M, N] uint8 keep mask, rows of stride_dy (HAS_KEEP)
    SUMS,  # [M, 2] fp32 Σ g and Σ g·x̂ over the FULL row, all-reduced (HAS_SUMS)
    DX,  # [M, N] written: gradient of X
    DW_PART,  # [programs, N] fp32, written: this program's Σ over its rows of dy·x̂
    DB_PART,  # [programs, N] fp32, written: this program's Σ over its rows of dy
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    n_full,
    scale,
    ACT: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_SUMS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    # This program's rows: a contiguous run of ROWS_PER_PROGRAM (the last program's run masked at M).
    # A constexpr trip count: one compilation per count, which a training run's fixed shapes keep to
    # a few (and Triton 3.6's interpreter cannot loop over a runtime bound under NumPy 2).
    for i in range(0, ROWS_PER_PROGRAM):
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
        live = row < M
        mask = (cols < N) & live
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        a = _to(_activation(x, ACT), X.dtype.element_ty).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=live, other=0.0)
        xhat = tl.where(mask, (a - tl.load(MEAN + row, mask=live, other=0.0)) * rstd, 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_KEEP:  # through the dropout: the kept values times the scale
            keep = tl.load(KEEP + row * stride_dy + cols, mask=mask, other=0)
            dy = tl.where(keep != 0, dy * scale, 0.0)
        g = dy * w  # dL/dx̂
        if HAS_SUMS:
            sum_g = tl.load(SUMS + 2 * row, mask=live, other=0.0)
            sum_gx = tl.load(SUMS + 2 * row + 1, mask=live, other=0.0)
        else:
            sum_g = tl.sum(g, axis=0)
            sum_gx = tl.sum(g * xhat, axis=0)
        # dL/da = rstd · (g − mean(g) − x̂ · mean(g · x̂)), the means over the full row (Ba et al.'s
        # LayerNorm differentiated; the same expression as the eager sharded_layer_norm backward).
        da = rstd * (g - sum_g / n_full - xhat * (sum_gx / n_full))
        if ACT != 0:
            da = da * _activation_grad(x, ACT)
        tl.store(DX + row * stride_dx + cols, _to(da, DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PART + pid * N + cols, dw, mask=cols < N)
    tl.store(DB_PART + pid * N + cols, db, mask=cols < N)


# ----------------------------------------------------------------------------------------------
# Launchers: 2-D row-major operands ([M, N], unit stride along N) in, new tensors out. Each is the
# implementation of a custom operator below (what a compiled graph calls) and is called directly
# in eager mode.


def _launch_config(n: int, backward: bool = False) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for rows of ``n`` values held whole in one program's registers.

    Chosen from ptxas's register report for sm_90 (Triton 3.6's own ptxas, no GPU needed; bf16):
    the forward at 8 warps up to 8,192 uses at most 140 registers, no spills; the backward keeps
    about 7 row-sized values live (u, dy, x̂, the gain, the two gradient sums, the result), so it
    gets twice the warps: at 8 warps it used 203 registers at 4,096 and spilled at 8,192, at 16
    warps 98 and 128, no spills. Rows wider than 8,192 (2.7B's 10,240, padded to 16,384) spill in
    the backward even at 32 warps (432 bytes); a kernel that loops over chunks of the row is left.
    Not yet tuned by measurement.
    """
    block = triton.next_power_of_2(n)
    if backward:
        return block, 4 if block <= 1024 else 8 if block <= 2048 else 16 if block <= 8192 else 32
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _bwd_programs(x: torch.Tensor) -> int:
    """Programs of the backward kernel (each accumulates the gain / shift gradients of its rows):
    a few per SM on a GPU; 4 on the interpreter, which runs programs one after the other."""
    rows = x.shape[0]
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(rows, 4 * sms))
    return max(1, min(rows, 4))


def _check_rows(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        assert t is None or (t.dim() == 2 and t.stride(-1) == 1), (t.shape, t.stride())


def _norm_act_fwd_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor | None,
    keep: torch.Tensor | None,
    eps: float,
    act: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_rows(x, residual, keep)
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y, mean, rstd
    block, warps = _launch_config(n)
    _norm_act_fwd_kernel[(m,)](
        x,
        weight,
        bias,
        residual if residual is not None else x,
        keep.view(torch.uint8) if keep is not None else x,
        y,
        mean,
        rstd,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        n,
        eps,
        scale,
        ACT=act,
        HAS_STATS=False,
        HAS_RES=residual is not None,
        HAS_KEEP=keep is not None,
        BLOCK_N=block,
        num_warps=warps,
    )
    return y, mean, rstd


def _norm_act_apply_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    act: int,
) -> torch.Tensor:
    _check_rows(x)
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block, warps = _launch_config(n)
    _norm_act_fwd_kernel[(m,)](
        x,
        weight,
        bias,
        x,
        x,
        y,
        mean,
        rstd,
        x.stride(0),
        0,
        y.stride(0),
        n,
        0.0,
        1.0,
        ACT=act,
        HAS_STATS=True,
        HAS_RES=False,
        HAS_KEEP=False,
        BLOCK_N=block,
        num_warps=warps,
    )
    return y


def _act_moments_impl(x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rows(x)
    m, n = x.shape
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    m2 = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block, warps = _launch_config(n)
        _act_moments_kernel[(m,)](x, mean, m2, x.stride(0), n, ACT=act, BLOCK_N=block, num_warps=warps)
    return mean, m2


def _norm_act_bwd_sums_impl(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, act: int
) -> torch.Tensor:
    _check_rows(dy, x)
    m, n = x.shape
    sums = torch.empty((m, 2), dtype=torch.float32, device=x.device)
    if m:
        block, warps = _launch_config(n)
        _norm_act_bwd_sums_kernel[(m,)](
            dy,
            x,
            weight,
            mean,
            rstd,
            sums,
            dy.stride(0),
            x.stride(0),
            n,
            ACT=act,
            BLOCK_N=block,
            num_warps=warps,
        )
    return sums


def _norm_act_bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    keep: torch.Tensor | None,
    sums: torch.Tensor | None,
    n_full: int,
    act: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_rows(dy, x, keep)
    assert keep is None or keep.stride(0) == dy.stride(0), "the keep mask is read with dy's row stride"
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
        return dx, zeros, zeros.clone()
    programs = _bwd_programs(x)
    rows_per_program = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows_per_program)  # none without rows
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    block, warps = _launch_config(n, backward=True)
    _norm_act_bwd_kernel[(programs,)](
        dy,
        x,
        weight,
        mean,
        rstd,
        keep.view(torch.uint8) if keep is not None else dy,
        sums if sums is not None else mean,
        dx,
        dw_part,
        db_part,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        m,
        n,
        float(n_full),
        scale,
        ACT=act,
        HAS_KEEP=keep is not None,
        HAS_SUMS=sums is not None,
        ROWS_PER_PROGRAM=rows_per_program,
        BLOCK_N=block,
        num_warps=warps,
    )
    return dx, dw_part.sum(dim=0), db_part.sum(dim=0)


# ----------------------------------------------------------------------------------------------
# The same launchers as custom operators, for compiled graphs (opaque calls with fake functions).


@torch.library.custom_op("megaformer::norm_act_fwd", mutates_args=())
def _norm_act_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor | None,
    keep: torch.Tensor | None,
    eps: float,
    act: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_act_fwd_impl(x, weight, bias, residual, keep, eps, act, scale)


@_norm_act_fwd_op.register_fake
def _(x, weight, bias, residual, keep, eps, act, scale):
    m = x.shape[0]
    stats = x.new_empty(m, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.new_empty(m)


@torch.library.custom_op("megaformer::norm_act_apply", mutates_args=())
def _norm_act_apply_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    act: int,
) -> torch.Tensor:
    return _norm_act_apply_impl(x, weight, bias, mean, rstd, act)


@_norm_act_apply_op.register_fake
def _(x, weight, bias, mean, rstd, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megaformer::act_moments", mutates_args=())
def _act_moments_op(x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _act_moments_impl(x, act)


@_act_moments_op.register_fake
def _(x, act):
    m = x.shape[0]
    return x.new_empty(m, dtype=torch.float32), x.new_empty(m, dtype=torch.float32)


@torch.library.custom_op("megaformer::norm_act_bwd_sums", mutates_args=())
def _norm_act_bwd_sums_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, act: int
) -> torch.Tensor:
    return _norm_act_bwd_sums_impl(dy, x, weight, mean, rstd, act)


@_norm_act_bwd_sums_op.register_fake
def _(dy, x, weight, mean, rstd, act):
    return x.new_empty((x.shape[0], 2), dtype=torch.float32)


@torch.library.custom_op("megaformer::norm_act_bwd", mutates_args=())
def _norm_act_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    keep: torch.Tensor | None,
    sums: torch.Tensor | None,
    n_full: int,
    act: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_act_bwd_impl(dy, x, weight, mean, rstd, keep, sums, n_full, act, scale)


@_norm_act_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, keep, sums, n_full, act, scale):
    n = x.shape[1]
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(n, dtype=torch.float32),
        x.new_empty(n, dtype=torch.float32),
    )


def _call(op, impl, *args):
    """``op`` (the custom operator) inside a compiled graph, ``impl`` (the same code) in eager mode."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> ``[M, n]`` with unit stride along ``n`` (a view where the layout allows)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ----------------------------------------------------------------------------------------------
# Autograd functions and the two entry points the block calls.


class _NormActFunction(torch.autograd.Function):
    """``LN(act(u))`` over a last dimension that may be sharded across ``group`` (NormFormer's
    FFN_LN after the activation). Saves ``u``, the gain and the fp32 ``μ``, ``rstd``."""

    @staticmethod
    def forward(ctx, u, weight, bias, normalized_size, eps, act, group):
        shape = u.shape
        u2 = _rows(u)
        if tp_world_size(group) == 1:
            y, mean, rstd = _call(
                _norm_act_fwd_op, _norm_act_fwd_impl, u2, weight, bias, None, None, eps, act, 1.0
            )
        else:
            local_mean, local_m2 = _call(_act_moments_op, _act_moments_impl, u2, act)  # one read of u
            mean, rstd = merge_shard_statistics(
                local_mean, local_m2, u2.shape[1], normalized_size, eps, group
            )
            y = _call(_norm_act_apply_op, _norm_act_apply_impl, u2, weight, bias, mean, rstd, act)
        ctx.save_for_backward(u2, weight, mean, rstd)
        ctx.shape, ctx.normalized_size, ctx.act, ctx.group = shape, normalized_size, act, group
        ctx.bias_dtype = bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad_y):
        u2, weight, mean, rstd = ctx.saved_tensors
        dy = _rows(grad_y)
        sums = None
        if tp_world_size(ctx.group) > 1:
            # Σ g and Σ g·x̂ of this shard, summed over the group: the means of the full row.
            sums = _call(_norm_act_bwd_sums_op, _norm_act_bwd_sums_impl, dy, u2, weight, mean, rstd, ctx.act)
            dist.all_reduce(sums, group=ctx.group)
        du, dw, db = _call(
            _norm_act_bwd_op,
            _norm_act_bwd_impl,
            dy,
            u2,
            weight,
            mean,
            rstd,
            None,
            sums,
            ctx.normalized_size,
            ctx.act,
            1.0,
        )
        return du.view(ctx.shape), dw.to(weight.dtype), db.to(ctx.bias_dtype), None, None, None, None


class _NormDropoutResidualFunction(torch.autograd.Function):
    """``x + dropout(LN(a))`` over an unsharded last dimension (POSTATTN_LN and its residual add),
    the dropout mask given. Saves ``a``, the gain, the mask and the fp32 ``μ``, ``rstd``."""

    @staticmethod
    def forward(ctx, a, residual, weight, bias, keep, scale, eps):
        shape = a.shape
        a2, r2 = _rows(a), _rows(residual)
        k2 = None if keep is None else keep.reshape(-1, shape[-1]).contiguous()
        h, mean, rstd = _call(
            _norm_act_fwd_op, _norm_act_fwd_impl, a2, weight, bias, r2, k2, eps, ACT_NONE, scale
        )
        ctx.save_for_backward(a2, weight, mean, rstd, k2)
        ctx.shape, ctx.scale, ctx.bias_dtype = shape, scale, bias.dtype
        return h.view(shape)

    @staticmethod
    def backward(ctx, grad_h):
        a2, weight, mean, rstd, k2 = ctx.saved_tensors
        dh = _rows(grad_h)
        if k2 is not None and k2.stride(0) != dh.stride(0):
            dh = dh.contiguous()
        da, dw, db = _call(
            _norm_act_bwd_op,
            _norm_act_bwd_impl,
            dh,
            a2,
            weight,
            mean,
            rstd,
            k2,
            None,
            a2.shape[1],
            ACT_NONE,
            ctx.scale,
        )
        # The residual's gradient is the output's (h = x + ...).
        return da.view(ctx.shape), grad_h, dw.to(weight.dtype), db.to(ctx.bias_dtype), None, None, None


def layer_norm_activation(
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    activation: str,
    normalized_size: int,
    eps: float,
    tp_group: ProcessGroup | None,
) -> torch.Tensor:
    """``LN(act(u))``, NormFormer's FFN LayerNorm after the activation (Shleifer et al. 2021, Sec. 2;
    LayerNorm of Ba et al. 2016), statistics over the FULL last dimension, which may be sharded
    across ``tp_group`` (then reduced across it exactly as
    :func:`~megaformer.parallel.layers.sharded_layer_norm` does: per-shard mean and M2 in fp32,
    merged with Chan et al.'s formula after one all-gather; backward one all-reduce of two per-token
    sums). Equal to ``ShardedLayerNorm(F.gelu(u))`` (``relu(u)²`` for ``relu2``) up to rounding.

    Args:
        u: ``[..., normalized_size / tp]``, W1's output (bias added), fp32 / bf16 / fp16, on a CUDA
            device (or the CPU under ``TRITON_INTERPRET=1``).
        weight, bias: ``[normalized_size / tp]``, this rank's slices of the gain and shift.
        activation: ``'gelu'`` (erf form) or ``'relu2'``.
        normalized_size: the FULL width of the normalised dimension.
        eps: added to the variance.
        tp_group: the tensor-parallel group, or None.

    Returns:
        ``[..., normalized_size / tp]`` in ``u``'s dtype.

    Raises:
        KeyError: an activation other than ``gelu`` / ``relu2``.
    """
    act = ACTIVATION_CODES[activation]
    if act == ACT_NONE:
        raise KeyError(f"activation {activation!r}: use 'gelu' or 'relu2'")
    return _NormActFunction.apply(u, weight, bias, normalized_size, eps, act, tp_group)


def layer_norm_dropout_residual(
    a: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    keep: torch.Tensor | None,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """``residual + dropout(LN(a))``: NormFormer's POSTATTN_LN (Shleifer et al. 2021, Sec. 2; LayerNorm
    of Ba et al. 2016) with the residual add, the dropout's keep mask given.

    Args:
        a: ``[..., d]``, the attention output after W_O (replicated, or a sequence slice), fp32 /
            bf16 / fp16.
        residual: ``[..., d]``, the block's input, same shape and dtype as ``a``.
        weight, bias: ``[d]`` gain and shift.
        keep: ``bool[..., d]`` the dropout's keep mask (what ``F.dropout`` would draw:
            :meth:`~megaformer.parallel.rng.DropoutRNG.keep_mask`), or None for no dropout.
        scale: the kept values' factor (``1 / (1 − p)`` as eager rounds it; ignored without ``keep``).
        eps: added to the variance.

    Returns:
        ``[..., d]`` in ``a``'s dtype.

    Raises:
        ValueError: shapes or dtypes of ``a``, ``residual`` (and ``keep``) that differ.
    """
    if residual.shape != a.shape or residual.dtype != a.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match a {tuple(a.shape)} {a.dtype}"
        )
    if keep is not None and keep.shape != a.shape:
        raise ValueError(f"keep mask {tuple(keep.shape)} must have a's shape {tuple(a.shape)}")
    return _NormDropoutResidualFunction.apply(a, residual, weight, bias, keep, float(scale), eps)


_SELF_CHECKS: dict[tuple[str, int | None, torch.dtype], str | None] = {}


@torch._dynamo.assume_constant_result
def self_check(device_type: str, device_index: int | None, dtype: torch.dtype) -> str | None:
    """Run both entry points once on a small input on the device against the eager operations
    (forward and backward, width 320, dropout on, 32 rows); None when they agree, else why not
    (an exception's message, or the largest error). Cached per device and dtype: the first call
    on a device compiles the kernels there (seconds), later calls cost nothing. A constant to
    dynamo (it runs at trace time, on real tensors of its own), so ``model.fused_kernels='auto'``
    can fall back to the eager path before a compiled block is built around the kernels.

    Why: the kernels are tested on the CPU in Triton's interpreter; the GPU compiler is another
    program, and a run on a lent GPU should measure the eager path rather than stop if it fails.
    """
    key = (device_type, device_index, dtype)
    if key in _SELF_CHECKS:
        return _SELF_CHECKS[key]
    device = (
        torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    )
    gen = torch.Generator().manual_seed(0)
    n, p = 320, 0.25
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    try:
        u, a, x, dy = (torch.randn(32, n, generator=gen).to(device, dtype) for _ in range(4))
        w = (1 + 0.5 * torch.randn(n, generator=gen)).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype)
        keep = (torch.rand(32, n, generator=gen) >= p).to(device)
        scale = 1.0 / (1.0 - p)
        ins = [t.clone().requires_grad_() for t in (u, w, b)]
        fused = layer_norm_activation(*ins, activation="gelu", normalized_size=n, eps=1e-5, tp_group=None)
        fused_grads = torch.autograd.grad(fused, ins, dy)
        ref_ins = [t.clone().requires_grad_() for t in (u, w, b)]
        ref = torch.nn.functional.layer_norm(torch.nn.functional.gelu(ref_ins[0]), (n,), *ref_ins[1:], 1e-5)
        ref_grads = torch.autograd.grad(ref, ref_ins, dy)
        pairs = [("ffn y", fused, ref)] + [
            (f"ffn d{k}", f, r) for k, f, r in zip("uwb", fused_grads, ref_grads)
        ]
        ins = [t.clone().requires_grad_() for t in (a, x, w, b)]
        h = layer_norm_dropout_residual(*ins, keep=keep, scale=scale, eps=1e-5)
        h_grads = torch.autograd.grad(h, ins, dy)
        ref_ins = [t.clone().requires_grad_() for t in (a, x, w, b)]
        ln = torch.nn.functional.layer_norm(ref_ins[0], (n,), *ref_ins[2:], 1e-5)
        ref = ref_ins[1] + ln * keep * scale
        ref_grads = torch.autograd.grad(ref, ref_ins, dy)
        pairs += [("post-attn h", h, ref)] + [
            (f"post-attn d{k}", f, r) for k, f, r in zip("axwb", h_grads, ref_grads)
        ]
        why = None
        for what, f, r in pairs:
            f, r = f.detach().float(), r.detach().float()
            err = float((f - r).abs().max() / r.abs().max().clamp(min=1.0))
            if not err <= tol:  # also catches NaN
                why = f"{what} differs from eager by {err:.3g} (relative to its largest value; allowed {tol})"
                break
    except Exception as e:  # a compiler or launch error on this device
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    _SELF_CHECKS[key] = why
    if why is not None:
        warnings.warn(
            f"model.fused_kernels='auto': the Triton kernels failed their check on {device} ({dtype}); "
            f"the blocks run eager there: {why}",
            stacklevel=2,
        )
    return why
