"""What one operation costs on a :class:`~megaformer.perf.devices.DeviceSpec`: a GEMM, a collective
over a link, a pipeline's bubble, and one transformer block by formula (eager kernels).

The parts of the step-time model (:mod:`megaformer.perf.steptime`) that the operation trace
(:mod:`megaformer.perf.optrace`) prices too: both import this module, neither the other's privates.
"""

from __future__ import annotations

import itertools
import math

from megaformer.config.schema import RunConfig
from megaformer.perf.devices import DeviceSpec


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: ``2(n−1)/n · B``."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter or all-gather of ``nbytes`` total: ``(n−1)/n·B``."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """1F1B's pipeline bubble over the ideal time: ``(p − 1)/m`` (Narayanan et al. 2021, eq. (1))."""
    return (pp - 1) / micro_batches


def link(dev: DeviceSpec, group_span: int, gpus_per_node: int) -> tuple[float, float]:
    """(bytes/s, seconds per ring step) of a group spanning ``group_span`` consecutive ranks."""
    if group_span <= gpus_per_node:
        return dev.nvlink_gbs * 1e9, dev.nvlink_latency_us * 1e-6
    return dev.internode_gbs * 1e9, dev.internode_latency_us * 1e-6


def collective_time(kind: str, nbytes: float, n: int, bw: float, lat: float, bucket: float = 0.0) -> float:
    """Seconds of a ring ``allreduce`` / ``gather`` (reduce-scatter, all-gather) of ``nbytes`` over
    ``n`` ranks, in buckets of ``bucket`` bytes (0: one message)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    messages = max(1, math.ceil(nbytes / bucket)) if bucket else 1
    if kind == "allreduce":
        return ring_allreduce_bytes(nbytes, n) / bw + messages * 2 * (n - 1) * lat
    return ring_gather_bytes(nbytes, n) / bw + messages * (n - 1) * lat


# --- the prediction --------------------------------------------------------------------------------


def thin_fraction(dev: DeviceSpec, smallest: float) -> float:
    """The fraction of the large-GEMM rate at smallest dimension ``smallest`` (``thin_gemm``)."""
    points = dev.thin_gemm
    if not points or smallest >= points[-1][0]:
        return 1.0
    if smallest <= points[0][0]:
        return points[0][1]
    for (d0, f0), (d1, f1) in itertools.pairwise(points):
        if smallest <= d1:
            w = math.log(smallest / d0) / math.log(d1 / d0)
            return f0 + w * (f1 - f0)
    return 1.0


def gemm_seconds(dev: DeviceSpec, m: float, k: float, n: float, q: int) -> float:
    """One GEMM's forward; its backward's two GEMMs have the same FLOPs and dimensions."""
    rate = dev.matmul_flops * thin_fraction(dev, min(m, k, n))
    return max(2 * m * k * n / rate, q * (m * k + k * n + m * n) / dev.memory_bytes_per_s)


def formula_block_costs(cfg: RunConfig, dev: DeviceSpec, q: int, gpus_per_node: int) -> tuple[float, ...]:
    """One block, one micro-batch, on one rank: (GEMMs, attention, memory-bound, TP communication)
    seconds, and the bytes of one activation ``b·s·d`` (the TP and p2p message)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    tp = par.tp_size
    b, s, d, f = t.micro_batch_size, m.seq_len, m.hidden_size, m.ffn_size
    n = b * s  # tokens per micro-batch
    sp = par.sequence_parallel and tp > 1
    recompute = t.recompute_mode
    fwd_passes = 2 if recompute == "full" else 1
    gemm_fwd = (
        gemm_seconds(dev, n, d, 3 * d / tp, q)
        + gemm_seconds(dev, n, d / tp, d, q)
        + gemm_seconds(dev, n, d, f / tp, q)
        + gemm_seconds(dev, n, f / tp, d, q)
    )
    block_compute = gemm_fwd * (2 + fwd_passes)
    attn_flops_fwd = 4.0 * b * s * s * d / tp  # QKᵀ and PV, causal not halved
    if dev.cpu and m.attention_dropout > 0:
        heads = m.num_attention_heads // tp
        attn_fwd = attn_flops_fwd / dev.matmul_flops + 80.0 / 3 * b * heads * s * s / dev.memory_bytes_per_s
        attn_bwd = 2 * attn_fwd
    else:  # forward and backward (2× the forward's FLOPs) each at its own rate
        dropout = m.attention_dropout > 0
        attn_fwd = 0.5 * attn_flops_fwd / dev.attention_flops_per_s(backward=False, dropout=dropout)
        attn_bwd = attn_flops_fwd / dev.attention_flops_per_s(backward=True, dropout=dropout)
    block_attention = attn_fwd * (fwd_passes + (1 if recompute == "selective" else 0)) + attn_bwd
    rep = 2 * d + 2 * d + 2 * 3 * d + 2 * 2 * d  # LN1, LN2, residual adds, dropouts (no mask)
    rep += (2 * d if m.post_attn_ln else 0) + (2 * d if m.resid_scale else 0)
    sharded = 8 * d + 2 * f + (2 * d if m.head_scale else 0) + (2 * f if m.ffn_ln else 0)
    sharded += 6 * d if m.qkv_ln else 0
    elements = rep / (tp if sp else 1) + sharded / tp
    masks = (2 * d if m.hidden_dropout > 0 else 0) / (tp if sp else 1)  # 1 byte, written + read
    block_bytes = n * (q * elements * (2 + fwd_passes) + 2 * masks)
    # GeLU (forward; backward ≈ 2 GeLU evaluations) at its element rate where that is the slower
    gelu_elems = n * f / tp * (2 + fwd_passes)
    block_memory = block_bytes / dev.bytes_per_s("stream" if dev.cpu else "fused")
    block_memory += max(
        0.0, gelu_elems / dev.gelu_per_s - n * q * 2 * f / tp * (2 + fwd_passes) / dev.memory_bytes_per_s
    )
    # LayerNorms, forward + backward (a recompute's forward ≈ 1/3 more), at their element rate where slower
    ln_elems = (2 * d + (d if m.post_attn_ln else 0)) / (tp if sp else 1)
    ln_elems += ((f if m.ffn_ln else 0) + (3 * d if m.qkv_ln else 0)) / tp
    block_memory += max(
        0.0,
        n * ln_elems * (2 + fwd_passes) / 3 / dev.layernorm_per_s
        - n * q * 2 * ln_elems * (2 + fwd_passes) / dev.memory_bytes_per_s,
    )
    # TP collectives per block per micro-batch.
    tp_bw, tp_lat = link(dev, tp, gpus_per_node)
    act = n * d * q
    block_tp = (2 + 2 * fwd_passes) * collective_time("allreduce", act, tp, tp_bw, tp_lat)
    if m.ffn_ln and tp > 1:
        block_tp += (1 + fwd_passes) * collective_time(
            "allreduce", n * 8.0 / (tp if sp else 1), tp, tp_bw, tp_lat
        )
    return block_compute, block_attention, block_memory, block_tp, act
