"""The fake-CUDA op trace of one block (megaformer.perf.optrace) against the block's known
operations and the step-time formula (megaformer.perf.costs.formula_block_costs).

Small blocks (d = 64, 4 heads, ffn 256, 2 × 32 tokens, bf16), traced in two child processes (tp 1,
tp 2 on the fake process group): a few seconds. Skipped only where the shim cannot be built (no
C++ compiler or torch headers), as the fake-CUDA tier."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from megaformer.config import load_config
from megaformer.perf import optrace
from megaformer.perf.fakecuda.build import ShimUnavailableError, build_shim, compiler

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
    # the compiled attention dropout of before (model.attention_backend=sdpa): its forward reruns
    "pre_ln_sdpa": [*PRE_LN, "model.attention_backend=sdpa"],
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
    from megaformer.perf.steptime import DEVICE_SPECS, formula_block_costs

    cfg, t = traces["pre_ln_tp2"]
    dev = DEVICE_SPECS["h100-80gb"]
    ours = optrace.block_costs(cfg, dev, 2, 8)
    theirs = formula_block_costs(cfg, dev, 2, 8)
    assert len(ours) == len(theirs) == 5
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12)  # the same GEMMs at the same roofline
    assert ours[1] == pytest.approx(theirs[1], rel=1e-12)  # causal: halved in both
    assert ours[3] == pytest.approx(theirs[3], rel=1e-12)
    assert ours[4] == theirs[4]
    assert optrace.trace_block(cfg) is t  # cached: no second child process


# --- the compiled block: optrace.fuse (inductor's fusion estimated from the eager trace) ---------------


def _op(name, kind, reads, writes, phase="forward"):
    """A hand-made OpRecord: ``reads`` / ``writes`` as ``(tensor id, bytes)``."""
    nbytes = sum(b for _, b in reads + writes) if kind == "memory" else 0
    entries = {"reads": tuple((t, 0, b) for t, b in reads), "writes": tuple((t, 0, b) for t, b in writes)}
    return optrace.OpRecord(name, phase, kind, (), (), nbytes=nbytes, **entries)


def _synthetic(ops, **model):
    key = optrace.TraceKey(tuple(sorted(model.items())), 1, 1, False, "none", "bf16", "h100-80gb")
    return optrace.BlockTrace(key, list(ops))


def test_a_pointwise_chain_between_two_gemms_costs_one_read_and_one_write():
    a, w, bias, scale = 1000, 50, 10, 4  # bytes: activation, weight, bias, a scalar
    ops = [
        _op("aten.mm.default", "gemm", [(1, a), (2, w)], [(3, a)]),
        _op("aten.add.Tensor", "memory", [(3, a), (4, bias)], [(5, a)]),
        _op("aten.gelu.default", "memory", [(5, a)], [(6, a)]),
        _op("aten.mul.Tensor", "memory", [(6, a), (7, scale)], [(8, a)]),
        _op("aten.mm.default", "gemm", [(8, a), (9, w)], [(10, a)]),
    ]
    trace = _synthetic(ops)
    fused = optrace.fuse(trace)
    assert [r.ops for r in fused.regions] == [("aten.add.Tensor", "aten.gelu.default", "aten.mul.Tensor")]
    assert fused.regions[0].read_bytes == a + bias + scale  # the GEMM's output and the two small operands
    assert fused.regions[0].write_bytes == a  # only what the second GEMM reads
    assert fused.memory_bytes == a + bias + scale + a < trace.memory_bytes


def test_fused_region_writes_what_backward_reads_and_splits_at_dependent_externs():
    a = 100
    ops = [
        _op("aten.add.Tensor", "memory", [(1, a), (2, a)], [(3, a)]),  # kept for backward
        _op("aten.gelu.default", "memory", [(3, a)], [(4, a)]),
        _op("c10d.allreduce_.default", "collective", [(4, a)], [(5, a)]),  # reads the region: splits it
        _op("aten.mul.Tensor", "memory", [(5, a), (3, a)], [(6, a)]),  # the block output
        _op("aten.sum.dim_IntList", "memory", [(7, a)], [(8, 1)], phase="backward"),
        _op("aten.mul.Tensor", "memory", [(7, a), (1, a)], [(9, a)], phase="backward"),
        _op("aten.mm.default", "gemm", [(9, a), (3, a)], [(10, a)], phase="backward"),
    ]
    regions = optrace.fuse(_synthetic(ops)).regions
    assert [(r.phase, len(r.ops)) for r in regions] == [("forward", 2), ("forward", 1), ("backward", 2)]
    assert (regions[0].read_bytes, regions[0].write_bytes) == (2 * a, 2 * a)  # 3 (read by backward's GEMM), 4
    assert (regions[1].read_bytes, regions[1].write_bytes) == (2 * a, a)
    assert (regions[2].read_bytes, regions[2].write_bytes) == (
        2 * a,
        a + 1,
    )  # grad, input; its output and the sum


def test_a_saved_pointwise_output_is_recomputed_in_backward_when_cheaper():
    a = 100
    ops = [
        _op("aten.mm.default", "gemm", [(1, a), (2, a)], [(3, 4 * a)]),
        _op("aten.gelu.default", "memory", [(3, 4 * a)], [(4, 4 * a)]),  # saved only for backward's use
        _op("aten.native_layer_norm.default", "memory", [(4, 4 * a)], [(5, 4 * a), (6, 1)]),
        _op("aten.mm.default", "gemm", [(5, 4 * a), (2, a)], [(7, a)]),
        _op(
            "aten.native_layer_norm_backward.default",
            "memory",
            [(8, 4 * a), (4, 4 * a), (6, 1)],
            [(9, 4 * a)],
            "backward",
        ),
        _op("aten.gelu_backward.default", "memory", [(9, 4 * a), (3, 4 * a)], [(10, 4 * a)], "backward"),
    ]
    fwd, bwd = optrace.fuse(_synthetic(ops)).regions
    assert (fwd.read_bytes, fwd.write_bytes) == (4 * a, 4 * a + 1)  # the LayerNorm's input is not written
    assert (bwd.read_bytes, bwd.write_bytes) == (8 * a + 1, 4 * a)  # recomputed from the GEMM's output


def test_trace_tensor_ids_resolve_views_and_version_in_place_writes(traces):
    _, t = traces["pre_ln"]
    qkv = next(op for op in t.of_kind("gemm") if op.mkn == (N, D, 3 * D)).writes[0][0]
    attn = next(op for op in t.of_kind("attention") if op.phase == "forward")
    assert [r[0] for r in attn.reads] == [qkv] * 3  # q, k, v: views of the one projection output
    assert [r[1] for r in attn.reads] == [0, D // H, 2 * D // H]  # their storage offsets
    ids = [w[0] for op in t.ops for w in op.writes if op.kind != "view"]
    assert len(ids) == len(set(ids))  # every write makes a new tensor id


def test_pre_ln_ffn_activation_is_one_region_between_the_gemms(traces):
    _, t = traces["pre_ln"]
    regions = optrace.fuse(t).regions
    gelu = next(r for r in regions if r.ops == ("aten.gelu.default",))
    assert (gelu.read_bytes, gelu.write_bytes) == (N * F * 2, N * F * 2)
    # the q, k, v gradients (the attention kernel's outputs) are stacked by a kernel of their own
    stack = next(r for r in regions if r.ops == ("aten.stack.default",))
    assert (stack.read_bytes, stack.write_bytes) == (3 * N * D * 2, 3 * N * D * 2)


def test_compiled_dropout_and_attention_dropout_operators_cost(traces):
    _, t = traces["pre_ln_sdpa"]
    fused = optrace.fuse(t)
    act = N * D * 2
    masks = 2 * (optrace.DROPOUT_KEEP_PASSES * act + N * D)  # two hidden dropouts: fill, dropout, mask
    copies = 2 * act + 2 * 3 * act  # attention output, then the q, k, v gradients: .contiguous()
    assert fused.extern_bytes == masks + copies
    assert fused.extra_attention_flops == 4.0 * B * S * S * D  # the forward rerun in backward
    assert any(r.ops == ("clone (attention output layout)",) for r in fused.regions)
    # the default fused kernel's operator (issue 36 item 1): no rerun, no copies of its own
    default = optrace.fuse(traces["pre_ln"][1])
    assert default.extern_bytes == masks and default.extra_attention_flops == 0.0
    assert not any(r.ops == ("clone (attention output layout)",) for r in default.regions)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_bytes_are_at_most_the_eager_bytes(traces, name):
    _, t = traces[name]
    fused = optrace.fuse(t)
    apart = optrace.fuse(t, column_reductions_fuse=False)
    assert 0 < fused.region_bytes <= fused.memory_bytes < t.memory_bytes
    # the sums apart: more kernels, more bytes, still fewer than eager's in the regions (with the
    # opaque operators' own, a tiny Pre-LN block with dropout then moves more bytes than eager)
    assert fused.region_bytes < apart.region_bytes < t.memory_bytes
    assert apart.count() > fused.count()  # the bias-gradient sums, each a kernel of its own
    assert fused.count("forward") >= 3 and fused.count("backward") >= 3
    assert bool(fused.count("recompute")) == (t.key.recompute == "full")


@pytest.mark.parametrize("tp", ["", "_tp2"])
def test_normformer_adds_almost_no_fused_traffic(traces, tp):
    _, pre = traces["pre_ln" + tp]
    _, nf = traces["normformer" + tp]
    eager = nf.memory_bytes - pre.memory_bytes
    fused = optrace.fuse(nf).memory_bytes - optrace.fuse(pre).memory_bytes
    act = N * D * 2  # one [B, S, d] bf16 tensor
    assert eager > 30 * act
    if tp:  # the FFN LayerNorm's statistics, summed across TP ranks: passes split by the all-reduces
        assert fused < 0.15 * eager
        return
    # ResScale's and HeadScale's gradients read their inputs, the post-attention LayerNorm recomputes
    # its input from W_O's output; the FFN LayerNorm's own input is recomputed from fc1's output
    assert fused < 8 * act and fused < 0.2 * eager


def test_block_costs_compiled_uses_the_fused_bytes(traces):
    from megaformer.perf.steptime import DEVICE_SPECS

    cfg, t = traces["pre_ln_sdpa"]
    dev = DEVICE_SPECS["h100-80gb"]
    eager = optrace.block_costs(cfg, dev, 2, 8)
    compiled = optrace.block_costs(cfg, dev, 2, 8, compiled=True)
    fused = optrace.fuse(t)
    assert compiled[0] == eager[0] and compiled[3:] == eager[3:]
    norm, copy, masks = fused.norm_region_bytes, fused.copy_bytes, fused.extern_bytes - fused.copy_bytes
    seconds = (fused.region_bytes - norm) / dev.bytes_per_s("fused") + norm / dev.bytes_per_s("fused_norm")
    seconds += copy / dev.bytes_per_s("copy") + masks / dev.bytes_per_s("stream")
    assert compiled[2] == pytest.approx(seconds, rel=1e-12)  # each kernel class at its own rate
    assert norm > 0 and copy > 0 and masks > 0
    extra = 0.5 * fused.extra_attention_flops / dev.attention_flops_per_s(backward=False, dropout=True)
    assert compiled[1] == pytest.approx(eager[1] + extra, rel=1e-12)  # the rerun at the forward rate
    assert optrace.compiles(cfg)
