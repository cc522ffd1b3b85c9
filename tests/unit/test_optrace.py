"""The fake-CUDA op trace of one block (megaformer.fakecuda.optrace) against the block's known
operations and the step-time formula (megaformer.tools.steptime._block_costs).

Small blocks (d = 64, 4 heads, ffn 256, 2 × 32 tokens, bf16), traced in two child processes (tp 1,
tp 2 on the fake process group): a few seconds. Skipped only where the shim cannot be built (no
C++ compiler or torch headers), as the fake-CUDA tier."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from megaformer.config import load_config
from megaformer.fakecuda import optrace
from megaformer.fakecuda.build import ShimUnavailableError, build_shim, compiler

B, S, D, F, H = 2, 32, 64, 256, 4
N = B * S
PRE_LN = [
    "model.post_attn_ln=false",
    "model.head_scale=false",
    "model.ffn_ln=false",
    "model.resid_scale=false",
]
NORMFORMER = [
    "model.post_attn_ln=true",
    "model.head_scale=true",
    "model.ffn_ln=true",
    "model.resid_scale=true",
]
VARIANTS = {
    "pre_ln": PRE_LN,
    "normformer": NORMFORMER,
    "pre_ln_full": [*PRE_LN, "train.recompute=full"],
    "pre_ln_tp2": [*PRE_LN, "parallel.tp_size=2"],
    "normformer_tp2": [*NORMFORMER, "parallel.tp_size=2"],
    "normformer_tp2_full": [*NORMFORMER, "parallel.tp_size=2", "train.recompute=full"],
}


def small(extra: list[str]):
    return load_config(
        "configs/normformer-quickstart.yaml",
        [
            f"model.hidden_size={D}",
            f"model.ffn_hidden_size={F}",
            f"model.num_attention_heads={H}",
            f"model.seq_len={S}",
            f"train.micro_batch_size={B}",
            "train.precision=bf16",
            "model.hidden_dropout=0.1",
            "model.attention_dropout=0.1",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def traces() -> dict:
    try:
        build_shim()
    except ShimUnavailableError as e:
        if compiler() is not None and shutil.which("g++"):
            pytest.fail(f"the fake-CUDA shim did not build although g++ is here: {e}")
        pytest.skip(f"no fake CUDA here: {e}")
    cfgs = {name: small(extra) for name, extra in VARIANTS.items()}
    return {name: (cfgs[name], t) for name, t in zip(cfgs, optrace.trace_blocks(list(cfgs.values())))}


def test_pre_ln_block_has_exactly_its_twelve_gemms(traces):
    _, t = traces["pre_ln"]
    fwd = sorted(op.mkn for op in t.of_kind("gemm") if op.phase == "forward")
    bwd = sorted(op.mkn for op in t.of_kind("gemm") if op.phase == "backward")
    # qkv, W_O, fc1, fc2 as (M, K, N): input (N×K) times weight (K×N)
    assert fwd == sorted([(N, D, 3 * D), (N, D, D), (N, D, F), (N, F, D)])
    # backward: dX = dY · W (M = tokens) and dW = dYᵀ · X (M = output features), per layer
    want = [(N, 3 * D, D), (3 * D, N, D), (N, D, D), (D, N, D), (N, F, D), (F, N, D), (N, D, F), (D, N, F)]
    assert bwd == sorted(want)


def test_attention_forward_and_backward_are_the_fused_kernel(traces):
    _, t = traces["pre_ln"]
    ops = [(op.phase, op.name) for op in t.of_kind("attention")]
    assert ops == [
        ("forward", "aten._scaled_dot_product_flash_attention.default"),
        ("backward", "aten._scaled_dot_product_flash_attention_backward.default"),
    ]
    assert t.attention_causal
    assert t.attention_flops == 3 * 4.0 * B * S * S * D  # forward + 2× in backward, causal not halved


@pytest.mark.parametrize("name", ["pre_ln", "normformer", "pre_ln_full", "pre_ln_tp2", "normformer_tp2_full"])
def test_gemm_and_attention_flops_equal_the_formula(traces, name):
    cfg, t = traces[name]
    formula = optrace.formula_counts(cfg, 2)
    assert t.gemm_flops == formula["gemm_flops"]  # the same matmuls, exactly
    assert t.attention_flops == formula["attention_flops"]


def test_full_recompute_reruns_the_forward_in_backward(traces):
    _, plain = traces["pre_ln"]
    _, full = traces["pre_ln_full"]
    fwd = sorted(op.mkn for op in plain.of_kind("gemm") if op.phase == "forward")
    assert sorted(op.mkn for op in full.of_kind("gemm") if op.phase == "recompute") == fwd
    names = [op.name for op in full.ops if op.phase == "recompute" and op.kind != "view"]
    assert names == [op.name for op in plain.ops if op.phase == "forward" and op.kind != "view"]


def _memory_ops(t, phase):
    return Counter(op.name for op in t.of_kind("memory") if op.phase == phase)


def test_normformer_adds_exactly_its_layernorms_and_scales(traces):
    _, pre = traces["pre_ln"]
    _, nf = traces["normformer"]
    assert nf.gemms == pre.gemms and len(nf.of_kind("attention")) == 2
    # forward: POSTATTN_LN and FFN_LN, HeadScale's and ResScale's products
    assert _memory_ops(nf, "forward") - _memory_ops(pre, "forward") == Counter(
        {"aten.native_layer_norm.default": 2, "aten.mul.Tensor": 2}
    )
    assert not _memory_ops(pre, "forward") - _memory_ops(nf, "forward")
    # backward: the two LayerNorms' backward; per scale, the input gradient (g · dy) and the gain's
    # (dy · x summed over tokens)
    assert _memory_ops(nf, "backward") - _memory_ops(pre, "backward") == Counter(
        {"aten.native_layer_norm_backward.default": 2, "aten.mul.Tensor": 4, "aten.sum.dim_IntList": 2}
    )
    ln = [op for op in nf.of_kind("memory") if op.name == "aten.native_layer_norm.default"]
    assert sorted(op.inputs[0][0] for op in ln) == sorted([(B, S, D)] * 3 + [(B, S, F)])


def test_memory_op_bytes_are_inputs_plus_outputs(traces):
    _, t = traces["pre_ln"]
    drop = next(op for op in t.of_kind("memory") if op.name == "aten.native_dropout.default")
    assert drop.nbytes == N * D * (2 + 2 + 1)  # read bf16, write bf16 and the bool mask
    gelu = next(op for op in t.of_kind("memory") if op.name == "aten.gelu_backward.default")
    assert gelu.nbytes == N * F * 2 * 3  # read the gradient and the input, write the gradient
    assert all(op.nbytes == 0 for op in t.of_kind("view"))
    assert any(op.name == "aten.t.default" for op in t.of_kind("view"))


@pytest.mark.parametrize("name", ["pre_ln_tp2", "normformer_tp2"])
def test_tp2_collective_bytes_equal_the_formula(traces, name):
    cfg, t = traces[name]
    act = N * D * 2
    assert [b for kind, b in t.collectives if kind == "allreduce" and b == act] == [act] * 4
    assert t.tp_wire_bytes() == optrace.formula_counts(cfg, 2)["tp_wire_bytes"]


def test_block_costs_match_the_steptime_tuple(traces):
    from megaformer.tools.steptime import DEVICE_SPECS, _block_costs

    cfg, t = traces["pre_ln_tp2"]
    dev = DEVICE_SPECS["h100-80gb"]
    ours = optrace.block_costs(cfg, dev, 2, 8)
    theirs = _block_costs(cfg, dev, 2, 8)
    assert len(ours) == len(theirs) == 5
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12)  # the same GEMMs at the same roofline
    assert ours[1] == pytest.approx(theirs[1], rel=1e-12)  # causal: halved in both
    assert ours[3] == pytest.approx(theirs[3], rel=1e-12)
    assert ours[4] == theirs[4]
    assert optrace.trace_block(cfg) is t  # cached: no second child process
