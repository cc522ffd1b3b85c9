"""Compute accounting: model FLOPs per token, the device's peak, achieved TFLOP/s and MFU.

Model FLOPs count the work the model needs, not what the hardware does: activation recomputation
is not counted (Chowdhery et al. 2022, PaLM, arXiv:2204.02311, App. B, "model FLOPs utilisation"),
so a run that recomputes shows a lower MFU for the same step time, as it should.

Per token of training (forward + backward = 3 × forward, the backward computing gradients of both
inputs and weights), for ``L`` layers of width ``d``, FFN width ``f``, context ``T`` and padded
vocabulary ``V`` (Narayanan et al. 2021, Megatron-LM, arXiv:2104.04473, App. "Floating-point
operations", eq. (3): ``72·B·s·l·h²·(1 + s/(6h) + V/(12·h·l))`` per batch at f = 4d; and PaLM's
``6N + 12·L·H·Q·T``)::

    matmuls    3 · 2 · [ L·(4d² + 2·d·f) + d·V ]      qkv, out_proj, fc1, fc2; output projection
    attention  3 · 2 · L · 2·T·d                       QKᵀ and attention × V (causal mask not halved,
                                                       as Megatron and PaLM count it)
    norms      3 · 8 · (elements normalised per token)  every LayerNorm: mean, centre, square, mean,
                                                       scale, gain, shift ≈ 8 flops per element
    scales     3 · (d [HeadScale] + d [ResScale])      NormFormer's elementwise products
               3 · 2d [DeepNorm's α·x]                 per layer, where switched on

Under ``model.objective`` mlm, RoBERTa's LM head adds its dense ``d -> d`` layer (``2·d²``) and its
LayerNorm; the decoder is counted where megaformer computes it: at every position under
``model.mlm_head_positions`` all, at ``max_masked_positions(T) / T`` of them (~16 %, fairseq's
choice of decoding the masked positions only) under masked.

The token embedding is a lookup (no FLOPs); softmax, activations, dropout and residual additions
are not counted (as in Megatron and PaLM). The norms and scales are NormFormer's extra operations:
they change the count by well under 1 % at the paper's sizes, but they are counted so that schemes
are compared on the same footing.

Peaks: dense fp16/bf16 tensor-core TFLOP/s from the vendors' datasheets (V100 SXM2 125, A100 312,
H100 / H200 SXM 989); on a CPU, a float32 matmul peak measured at start-up in this process.
"""

from __future__ import annotations

import time

import torch

from megaformer.config.schema import ModelConfig
from megaformer.data.mlm import max_masked_positions

PEAK_TFLOPS = {"V100": 125.0, "A100": 312.0, "H100": 989.0, "H200": 989.0}
"""Dense fp16/bf16 peak per GPU (NVIDIA datasheets: V100 SXM2, A100 SXM4, H100 / H200 SXM)."""

LAYER_NORM_FLOPS_PER_ELEMENT = 8
"""Forward FLOPs of a LayerNorm per element (mean, centre, square, mean, rsqrt·scale, gain, shift)."""


def normalised_elements_per_token(config: ModelConfig) -> int:
    """Elements per token that go through a LayerNorm, summed over the model (scheme-dependent)."""
    d, f = config.hidden_size, config.ffn_size
    per_layer = 2 * d  # the two sublayer norms of every scheme (Pre-LN's LN1 / LN2, Post-LN's two)
    if config.post_attn_ln:
        per_layer += d
    if config.ffn_ln:
        per_layer += f
    if getattr(config, "qkv_ln", False):
        per_layer += 3 * d  # "+3 More LN": q, k and v
    # Pre-LN ends with a final LayerNorm; Post-LN and DeepNorm, whose blocks end normalised, have none.
    final = d if getattr(config, "norm_scheme", "pre_ln") == "pre_ln" else 0
    head = d if getattr(config, "objective", "clm") == "mlm" else 0  # RoBERTa's LM head LayerNorm
    return config.num_layers * per_layer + final + head


def decoded_share(config: ModelConfig) -> float:
    """Share of a sequence's positions the output projection decodes: 1, or
    ``max_masked_positions(T) / T`` under ``model.mlm_head_positions`` masked (the masked LM's
    decoder at the masked positions only, :class:`megaformer.model.MaskedLMFeatures`). The FLOPs,
    the step-time model and the memory plan scale the decoder and its loss by it."""
    if getattr(config, "mlm_head_positions", "all") == "masked":
        return max_masked_positions(config.seq_len) / config.seq_len
    return 1.0


def model_flops_per_token(config: ModelConfig, padded_vocab_size: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of the model, as the module docstring counts.

    Args:
        config: the model.
        padded_vocab_size: rows of the output projection (default: ``config.padded_vocab_size(1)``;
            the padding is computed as it is, so it counts).

    Returns:
        FLOPs per token (a float; ~1.0e9 at 125M with T = 2048).
    """
    d, f, L, T = config.hidden_size, config.ffn_size, config.num_layers, config.seq_len  # noqa: N806
    V = padded_vocab_size or config.padded_vocab_size(1)  # noqa: N806
    forward = 2 * (L * (4 * d * d + 2 * d * f) + d * V * decoded_share(config))  # matmuls
    if getattr(config, "objective", "clm") == "mlm":
        forward += 2 * d * d  # RoBERTa's LM head dense d -> d, before the tied decoder
    forward += 2 * L * 2 * T * d  # attention scores and weighted values
    forward += LAYER_NORM_FLOPS_PER_ELEMENT * normalised_elements_per_token(config)
    forward += L * d * (int(config.head_scale) + int(config.resid_scale))
    if getattr(config, "norm_scheme", "pre_ln") == "deepnorm":
        forward += L * 2 * d  # α·x on both residual branches of every block
    return 3.0 * forward


def measure_cpu_peak_flops(seconds: float = 0.3, size: int = 512) -> float:
    """Float32 matmul FLOP/s of this process on the CPU (its torch threads), best of repeated runs.

    A ``size × size`` GEMM is large enough for the BLAS kernels to reach their throughput and small
    enough to repeat many times in ``seconds``.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / max(time.perf_counter() - t0, 1e-9))
    return best


def device_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, how it was obtained); (None, why) for an unknown GPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name}: {tflops:.0f} TFLOP/s dense fp16/bf16 (datasheet)"
        return None, f"{name}: no datasheet peak known (PEAK_TFLOPS); MFU not reported"
    peak = measure_cpu_peak_flops()
    return peak, f"CPU: {peak / 1e9:.1f} GFLOP/s float32 matmul, measured at start-up"


class ComputeMeter:
    """Tokens, device-hours, achieved TFLOP/s per device and MFU of a run.

    Device-hours are wall-clock hours of the training loop (steps, evaluations, checkpoints: all
    the time the job holds its devices after start-up) times the number of devices, summed over
    resumes.

    Args:
        flops_per_token: :func:`model_flops_per_token`.
        world_size: devices in the job (each process one device).
        peak_flops: one device's peak (None: MFU not reported).
        tokens: tokens consumed before this process started (a resumed run's).
        device_seconds: device-seconds consumed before (a resumed run's).
    """

    def __init__(
        self,
        flops_per_token: float,
        world_size: int,
        peak_flops: float | None,
        tokens: int = 0,
        device_seconds: float = 0.0,
    ) -> None:
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.tokens = tokens
        self._before = device_seconds
        self._start = time.perf_counter()

    def step(self, tokens: int, step_seconds: float) -> dict[str, float | None]:
        """Account one step of ``tokens`` tokens that took ``step_seconds``; return its metrics."""
        self.tokens += tokens
        tflops = self.tflops_per_device(tokens / step_seconds)
        return {
            "train/tflops_per_device": tflops,
            "train/mfu": self.mfu(tflops),
            "train/tokens": float(self.tokens),
            "train/device_hours": self.device_hours,
        }

    def tflops_per_device(self, tokens_per_s: float) -> float:
        """Achieved model TFLOP/s of one device at a job throughput of ``tokens_per_s``."""
        return self.flops_per_token * tokens_per_s / self.world_size / 1e12

    def mfu(self, tflops_per_device: float) -> float | None:
        """Model FLOPs utilisation: achieved / peak (None without a known peak)."""
        return None if self.peak_flops is None else tflops_per_device * 1e12 / self.peak_flops

    @property
    def device_seconds(self) -> float:
        """Device-seconds consumed so far, this process's share of the loop included."""
        return self._before + (time.perf_counter() - self._start) * self.world_size

    @property
    def device_hours(self) -> float:
        return self.device_seconds / 3600.0
