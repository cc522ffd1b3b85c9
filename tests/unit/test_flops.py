"""Compute accounting: the model-FLOPs formula against Megatron's and an explicit count, MFU, meter."""

from __future__ import annotations

import dataclasses

import pytest

from megaformer.config.schema import ModelConfig
from megaformer.training.flops import (
    LAYER_NORM_FLOPS_PER_ELEMENT,
    ComputeMeter,
    measure_cpu_peak_flops,
    model_flops_per_token,
)

# GPT-3 125M's shape (Brown et al. 2020, Table 2.1), the paper's 125M: 12 layers, d 768, T 2048.
BASE = ModelConfig(
    vocab_size=50257,
    make_vocab_size_divisible_by=1024,
    hidden_size=768,
    num_layers=12,
    num_attention_heads=12,
    seq_len=2048,
    post_attn_ln=False,
    head_scale=False,
    ffn_ln=False,
    resid_scale=False,
)


def test_baseline_matches_megatron_formula_plus_its_layer_norms():
    """Narayanan et al. 2021, eq. (3), per token: 72·l·h²·(1 + s/(6h) + V/(12·h·l))."""
    L, h, s, V = 12, 768, 2048, BASE.padded_vocab_size(1)
    assert V == 51200
    megatron = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    norms = 3 * LAYER_NORM_FLOPS_PER_ELEMENT * (2 * L * h + h)  # LN1, LN2 per layer, final LN
    assert model_flops_per_token(BASE, V) == pytest.approx(megatron + norms, rel=1e-12)
    assert norms / megatron < 1e-3  # the norms are a rounding error at this size


def test_normformer_counts_its_extra_operations():
    nf = dataclasses.replace(BASE, post_attn_ln=True, head_scale=True, ffn_ln=True, resid_scale=True)
    extra = 3 * 12 * (LAYER_NORM_FLOPS_PER_ELEMENT * (768 + 4 * 768) + 768 + 768)
    assert model_flops_per_token(nf) - model_flops_per_token(BASE) == pytest.approx(extra)
    # The paper's per-step overhead is 2-6 %; in model FLOPs NormFormer adds well under 1 %.
    assert 0 < extra / model_flops_per_token(BASE) < 0.01


def test_masked_lm_counts_its_head():
    """RoBERTa's LM head before the tied decoder: dense d x d and a LayerNorm over d, per token."""
    mlm = dataclasses.replace(BASE, objective="mlm", vocab_size=50265, position_embedding="learned")
    clm = dataclasses.replace(mlm, objective="clm")
    head = 3 * (2 * 768 * 768 + LAYER_NORM_FLOPS_PER_ELEMENT * 768)
    assert model_flops_per_token(mlm) - model_flops_per_token(clm) == pytest.approx(head)


def test_meter_accumulates_tokens_device_hours_and_mfu():
    meter = ComputeMeter(
        flops_per_token=1e9, world_size=4, peak_flops=1e12, tokens=100, device_seconds=3600.0
    )
    values = meter.step(tokens=2000, step_seconds=1.0)
    assert values["train/tokens"] == 2100
    # 2000 tokens/s × 1e9 FLOP / 4 devices = 0.5 TFLOP/s per device, half the peak
    assert values["train/tflops_per_device"] == pytest.approx(0.5)
    assert values["train/mfu"] == pytest.approx(0.5)
    assert 1.0 <= values["train/device_hours"] < 1.01  # the hour before, plus this process's moments
    assert ComputeMeter(1e9, 1, None).mfu(1.0) is None


def test_cpu_peak_is_measured():
    peak = measure_cpu_peak_flops(seconds=0.05, size=128)
    assert 1e8 < peak < 1e13


def test_schemes_without_a_final_norm_and_deepnorm_alpha():
    post = dataclasses.replace(BASE, norm_scheme="post_ln")
    deep = dataclasses.replace(BASE, norm_scheme="deepnorm")
    final_ln = 3 * LAYER_NORM_FLOPS_PER_ELEMENT * 768
    assert model_flops_per_token(BASE) - model_flops_per_token(post) == pytest.approx(final_ln)
    assert model_flops_per_token(deep) - model_flops_per_token(post) == pytest.approx(3 * 12 * 2 * 768)
    qkv = dataclasses.replace(BASE, qkv_ln=True)
    assert model_flops_per_token(qkv) - model_flops_per_token(BASE) == pytest.approx(
        3 * LAYER_NORM_FLOPS_PER_ELEMENT * 12 * 3 * 768
    )
