"""The step-time model (megaformer.perf.steptime): formulas, MFU definition, CPU validation."""

from __future__ import annotations

import json
import math
import os

import pytest

from megaformer.config import load_config
from megaformer.perf.steptime import (
    DEVICE_SPECS,
    DeviceSpec,
    _cpu_adamw,
    bubble_fraction,
    collective_time,
    cpu_device,
    predict,
    ring_allreduce_bytes,
    ring_gather_bytes,
)
from megaformer.tools import plan as plan_tool
from megaformer.training.flops import ComputeMeter, model_flops_per_token

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VALIDATION = os.path.join(REPO, "bench", "results", "steptime_cpu_validation.json")


def _cfg(path: str, *overrides: str):
    return load_config(os.path.join(REPO, path), list(overrides))


def test_bubble_fraction_is_p_minus_1_over_m():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 16) == pytest.approx(3 / 16)
    assert bubble_fraction(8, 8) == pytest.approx(7 / 8)


def test_ring_bytes():
    assert ring_allreduce_bytes(1e9, 1) == 0
    assert ring_allreduce_bytes(1e9, 2) == pytest.approx(1e9)
    assert ring_allreduce_bytes(1e9, 8) == pytest.approx(2 * 7 / 8 * 1e9)
    assert ring_gather_bytes(1e9, 8) == pytest.approx(7 / 8 * 1e9)
    # bandwidth term plus 2(n-1) latencies per message
    t = collective_time("allreduce", 1e9, 8, bw=100e9, lat=1e-5)
    assert t == pytest.approx(1.75e9 / 100e9 + 14 * 1e-5)
    t = collective_time("gather", 1e9, 8, bw=100e9, lat=1e-5, bucket=2.5e8)
    assert t == pytest.approx(0.875e9 / 100e9 + 4 * 7 * 1e-5)


def test_mfu_is_compute_meters_definition():
    cfg = _cfg("configs/paper/1.3b-normformer.yaml")
    st = predict(cfg, DEVICE_SPECS["h100-80gb"], 8)
    v = cfg.model.padded_vocab_size(cfg.parallel.tp_size)
    meter = ComputeMeter(model_flops_per_token(cfg.model, v), 8, DEVICE_SPECS["h100-80gb"].peak_tflops * 1e12)
    tokens_per_s = st.tokens_per_step / st.total
    assert st.mfu == pytest.approx(meter.mfu(meter.tflops_per_device(tokens_per_s)))
    assert st.tokens_per_s_per_device == pytest.approx(tokens_per_s / 8)
    assert st.device_hours == pytest.approx(cfg.train.steps * st.total * 8 / 3600)
    assert 0.2 < st.mfu < 0.7


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_terms_follow_the_layout():
    cfg = _cfg("configs/normformer-2.7b-3d-a100.yaml")
    st = predict(cfg, DEVICE_SPECS["a100-80gb"], 64)
    pp = cfg.parallel.pp_size
    assert st.pp_bubble == pytest.approx(
        bubble_fraction(pp, st.micro_batches) * st.micro_batches * st.micro_batch
    )
    assert st.tp_comm > 0 and st.pp_p2p > 0 and st.dp_comm > 0
    dp_only = predict(_cfg("configs/paper/1.3b-normformer.yaml"), DEVICE_SPECS["a100-80gb"], 8)
    assert dp_only.tp_comm == 0 and dp_only.pp_bubble == 0
    # one GPU: no communication at all
    one = predict(
        _cfg("configs/paper/125m-normformer.yaml", "train.global_batch_size=4", "train.micro_batch_size=4"),
        DEVICE_SPECS["h100-80gb"],
        1,
    )
    assert one.dp_comm == one.tp_comm == one.pp_bubble == 0
    # faster device, shorter step; NormFormer costs more than Pre-LN, but little
    base = predict(_cfg("configs/paper/1.3b-baseline.yaml"), DEVICE_SPECS["h100-80gb"], 8)
    assert base.total < dp_only.total
    nf = predict(_cfg("configs/paper/1.3b-normformer.yaml"), DEVICE_SPECS["h100-80gb"], 8)
    assert 1.0 < nf.total / base.total < 1.15


def test_plan_predict_flag(capsys):
    assert plan_tool.main(["configs/paper/1.3b-normformer.yaml", "--gpu", "h100", "--predict"]) == 0
    out = capsys.readouterr().out
    for term in ("compute (GEMMs)", "memory-bound", "attention", "TP communication", "PP bubble", "MFU"):
        assert term in out


@pytest.mark.parametrize(
    ("case", "tolerance"),
    # The bound, 25 %, for every case. The 125M figures are the median steps that
    # bench/steptime_cpu_validation.py --measure-125m timed while other processes used < 5 % of the CPU
    # (the committed bench/results/norm_overhead.json medians, 11.6 / 13.1 s, were taken on a busier
    # machine and older code: today's quiet steps are 9.4-9.9 s; the JSON keeps them beside, with their
    # errors). The model is 3-4 % under the 125M steps and 9 % under the quickstart's (per-op dispatch,
    # DeepSpeed's bookkeeping and the data loader are not modelled).
    [("quickstart", 0.25), ("125m_pre_ln", 0.25), ("125m_normformer", 0.25)],
)
def test_cpu_prediction_against_committed_measurements(case, tolerance):
    """Predicted from bench/results/cpu_device.json; measured figures as committed (not re-measured)."""
    with open(VALIDATION) as f:
        measured = json.load(f)["cases"][case]["measured_step_s"]
    if case == "quickstart":
        cfg, dev, world = _cfg("configs/normformer-quickstart.yaml"), cpu_device(1, 2), 2
    else:
        cfg = _cfg_125m(case.endswith("normformer"))
        dev, world = cpu_device(2, 1), 1
    predicted = predict(cfg, dev, world, world).total
    assert abs(predicted / measured - 1) <= tolerance, (predicted, measured)


def test_cpu_normformer_overhead_against_committed_measurement():
    """NormFormer's predicted step over Pre-LN's at the 125M shape on this CPU (+0.7 %) within 3 points
    of the measured ratio (1.016 in the committed quiet run, 1.010 in another that day; single rounds
    0.99-1.05): no longer the +13 % of the busy machine's medians."""
    with open(VALIDATION) as f:
        cases = json.load(f)["cases"]
    measured = cases["125m_normformer"]["measured_step_s"] / cases["125m_pre_ln"]["measured_step_s"]
    dev = cpu_device(2, 1)
    predicted = predict(_cfg_125m(True), dev, 1, 1).total / predict(_cfg_125m(False), dev, 1, 1).total
    assert predicted > 1.0 and abs(predicted - measured) < 0.03, (predicted, measured)


def _cpu_spec(**kw) -> DeviceSpec:
    base = dict(
        name="cpu",
        peak_tflops=0.2,
        matmul_fraction=1.0,
        attention_fraction=0.5,
        hbm_gbs=50.0,
        hbm_fraction=1.0,
        nvlink_gbs=2.0,
        nvlink_latency_us=50.0,
        internode_gbs=2.0,
        internode_latency_us=50.0,
        cpu=True,
    )
    return DeviceSpec(**{**base, **kw})


def _cfg_125m(nf: bool):
    return _cfg(
        "configs/paper/125m-baseline.yaml",
        "model.seq_len=2048",
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        "model.embedding_dropout=0.0",
        "model.resid_scale=false",
        f"model.post_attn_ln={str(nf).lower()}",
        f"model.head_scale={str(nf).lower()}",
        f"model.ffn_ln={str(nf).lower()}",
        "train.precision=fp32",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        "train.zero_stage=0",
    )


def test_cpu_layernorm_term():
    """Each LayerNorm element costs 1 / layernorm_per_s (forward + backward) less its memory traffic."""
    ln_rate, bw = 1e9, 50e9
    for nf in (False, True):
        cfg = _cfg_125m(nf)
        m, n = cfg.model, cfg.model.seq_len
        without = predict(cfg, _cpu_spec(), 1, 1)
        with_ln = predict(cfg, _cpu_spec(layernorm_per_s=ln_rate), 1, 1)
        per_token = 2 * m.hidden_size + (m.hidden_size + m.ffn_size if nf else 0)
        per_block = n * per_token * (1 / ln_rate - 4 * 2 * 3 / bw)
        assert with_ln.memory - without.memory == pytest.approx(m.num_layers * per_block)
        assert with_ln.compute == without.compute and with_ln.optimizer == without.optimizer


def test_cpu_loss_term():
    """The loss at its measured logits rate, else two exp per logit; never under 16 bytes per logit."""
    cfg = _cfg_125m(False)
    n, v = cfg.model.seq_len, cfg.model.padded_vocab_size(1)
    by_exp = predict(cfg, _cpu_spec(exp_per_s=1e9), 1, 1)
    by_rate = predict(cfg, _cpu_spec(exp_per_s=1e9, loss_per_s=1e9), 1, 1)
    assert by_exp.memory - by_rate.memory == pytest.approx(2 * n * v / 1e9 - n * v / 1e9)
    fast = predict(cfg, _cpu_spec(loss_per_s=1e15), 1, 1)
    slow = predict(cfg, _cpu_spec(loss_per_s=1e9), 1, 1)
    assert slow.memory - fast.memory == pytest.approx(n * v / 1e9 - n * v * 16 / 50e9)


def test_cpu_adamw_two_rates():
    """Tensors of adamw_large_elems or more at adamw_per_s, the rest at adamw_small_per_s: without ZeRO
    the word embedding, with ZeRO >= 1 the flat partition; GPUs unchanged."""
    big, small, threshold = 0.3e9, 0.9e9, 8 * 2**20
    dev = _cpu_spec(adamw_per_s=big, adamw_small_per_s=small, adamw_large_elems=threshold)
    cfg = _cfg_125m(False)
    emb = cfg.model.padded_vocab_size(1) * cfg.model.hidden_size
    part = 124e6
    rate = _cpu_adamw(cfg, dev, part).adamw_per_s
    assert part / rate == pytest.approx(emb / big + (part - emb) / small)
    assert _cpu_adamw(cfg, dev, emb).adamw_per_s == pytest.approx(big)  # the embedding alone
    zero1 = _cfg("configs/normformer-quickstart.yaml")
    assert _cpu_adamw(zero1, dev, 3e6).adamw_per_s == pytest.approx(small)  # one flat partition, small
    assert _cpu_adamw(zero1, dev, 2e7).adamw_per_s == pytest.approx(big)  # one flat partition, large
    assert predict(cfg, dev, 1, 1).optimizer < predict(cfg, _cpu_spec(adamw_per_s=big), 1, 1).optimizer
    gpu = DEVICE_SPECS["h100-80gb"]
    assert _cpu_adamw(cfg, gpu, part) is gpu


def test_cpu_device_reads_the_new_keys(tmp_path):
    """cpu_device maps bench/cpu_device.py's block-shape rates onto the DeviceSpec; without them the
    old figures stand (and GPUs have none)."""
    row = {
        "matmul_gflops": {"a": 200.0},
        "peak_matmul_gflops": 200.0,
        "copy_gbs": 50.0,
        "attention_gflops": 200.0,
        "exp_gelems": 1.0,
        "gelu_gelems": 1.5,
        "adamw_gparams": 0.2,
    }
    new = {
        "block_gemm_gflops": 180.0,
        "gelu_fwd_bwd_gelems": 1.2,
        "layernorm_gelems": 1.4,
        "cross_entropy_glogits": 0.9,
        "adamw_block_gparams": 0.8,
    }
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps({"threads": {"2": row}}))
    new_path.write_text(json.dumps({"threads": {"2": {**row, **new}}}))
    old, dev = cpu_device(2, 1, str(old_path)), cpu_device(2, 1, str(new_path))
    assert old.matmul_fraction == 1.0 and old.gelu_per_s == 1.5e9
    assert old.layernorm_per_s == old.loss_per_s == old.adamw_small_per_s == math.inf
    assert dev.matmul_fraction == pytest.approx(0.9)
    assert dev.gelu_per_s == pytest.approx(3.6e9)
    assert (dev.layernorm_per_s, dev.loss_per_s) == (pytest.approx(1.4e9), pytest.approx(0.9e9))
    assert (dev.adamw_per_s, dev.adamw_small_per_s) == (pytest.approx(0.2e9), pytest.approx(0.8e9))
    assert dev.adamw_large_elems == 8 * 2**20
    for gpu in DEVICE_SPECS.values():
        assert gpu.layernorm_per_s == gpu.loss_per_s == gpu.adamw_small_per_s == math.inf


def test_gpu_predictions_count_the_blocks_operations_from_the_fake_cuda_trace():
    """On a GPU the block's operations come from its fake-CUDA trace (the same GEMMs as the formula),
    compiled blocks with the trace's fusion estimate; ``counts='formula'`` keeps the formula."""
    from megaformer.perf import optrace

    if not optrace.available():
        pytest.skip("no C++ compiler for the fake-CUDA shim: predictions use the formula")
    dev = DEVICE_SPECS["h100-80gb"]
    cfg = _cfg("configs/paper/125m-normformer.yaml")
    compiled = predict(cfg, dev, 8)
    eager = predict(_cfg("configs/paper/125m-normformer.yaml", "train.compile=false"), dev, 8)
    formula = predict(cfg, dev, 8, counts="formula")
    assert compiled.counted == "fake-CUDA trace (compiled block, fusion estimate)"
    assert eager.counted == "fake-CUDA trace (eager block)"
    assert formula.counted.startswith("formula")
    assert compiled.compute == pytest.approx(formula.compute, rel=1e-12)  # exactly the formula's GEMMs
    assert compiled.memory < eager.memory  # fusion saves traffic, never adds
    with pytest.raises(ValueError, match="counts='nope'"):
        predict(cfg, dev, 8, counts="nope")


def test_gpu_loss_term_counts_the_fused_or_the_eager_passes():
    """The loss on a GPU: the fused kernels (where train.compile compiles) read the 16-bit logits
    three times and write the gradient once; eager, the passes over the fp32 copy make 72 bytes per
    logit (the H200 profile's loss, bench/results/gpu/2026-11-26-h200)."""
    from megaformer.perf import steptime

    cfg = load_config("configs/paper/125m-baseline.yaml", ["train.zero_stage=1"])
    eager = load_config("configs/paper/125m-baseline.yaml", ["train.zero_stage=1", "train.compile=false"])
    assert steptime.loss_bytes_per_logit(cfg, 2) == 8.0 and steptime.loss_bytes_per_logit(eager, 2) == 72.0
    assert steptime.loss_bytes_per_logit(eager, 4) == 44.0
    spec = steptime.DEVICE_SPECS["h200-141gb"]
    fused_mem = steptime.predict(cfg, spec, 1, 1, counts="formula").memory
    eager_mem = steptime.predict(eager, spec, 1, 1, counts="formula").memory
    m, t = cfg.model, cfg.train
    logits = t.global_batch_size * m.seq_len * m.padded_vocab_size(1)  # per step, all micro-batches
    assert eager_mem - fused_mem == pytest.approx(64.0 * logits / spec.bytes_per_s("fused"), rel=1e-9)


def test_kernel_class_rates_fall_back_to_the_hbm_and_attention_fractions():
    """A device without the fitted kernel-class constants (the CPU, the unit devices of
    optrace.formula_counts) runs every class at ``hbm_fraction`` and attention at
    ``attention_fraction``; an unknown class is refused by name."""
    plain = DeviceSpec("plain", 100.0, 0.5, 0.25, 1000.0, 0.8, 1, 1, 1, 1)
    for kind in ("stream", "fused", "fused_norm", "copy"):
        assert plain.bytes_per_s(kind) == pytest.approx(800e9)
    for backward in (False, True):
        for dropout in (False, True):
            assert plain.attention_flops_per_s(backward=backward, dropout=dropout) == pytest.approx(25e12)
    h200 = DEVICE_SPECS["h200-141gb"]
    assert h200.bytes_per_s("fused_norm") < h200.bytes_per_s("copy") < h200.bytes_per_s("fused")
    assert h200.attention_flops_per_s(backward=False, dropout=True) < h200.attention_flops_per_s(
        backward=False, dropout=False
    )
    with pytest.raises(ValueError, match="kind='hbm'"):
        plain.bytes_per_s("hbm")


def test_host_term_counts_the_parameter_tensors():
    """The exposed host time per step grows with the parameter tensors DeepSpeed loops over: a
    Pre-LN block has 12 (two LayerNorms, qkv, W_O, fc1, fc2: weight and bias each), NormFormer's
    adds its post-attention LN, HeadScale, FFN LN and ResScale where switched on."""
    from megaformer.perf.steptime import param_tensors

    base = _cfg("configs/paper/125m-baseline.yaml")
    assert param_tensors(base) == 12 * 12 + 3  # + word embedding, final LayerNorm weight and bias
    nf = _cfg("configs/paper/125m-normformer.yaml")
    assert param_tensors(nf) > param_tensors(base)
    st = predict(base, DEVICE_SPECS["h200-141gb"], 1, 1, counts="formula")
    spec = DEVICE_SPECS["h200-141gb"]
    assert st.host == pytest.approx(spec.host_step_s + spec.host_per_tensor_s * 147)
    assert predict(base, cpu_device(), 1, counts="formula").host == 0.0


def test_masked_lm_decoder_terms_scale_with_the_decoded_positions():
    """model.mlm_head_positions masked: the decoder's GEMMs, its loss and the logits' memory are
    predicted at max_masked_positions(T) / T of the positions; the blocks' terms do not move."""
    from megaformer.data.mlm import max_masked_positions
    from megaformer.perf import plan as perf_plan
    from megaformer.perf import steptime

    base = ["train.zero_stage=1", "train.compile=false"]
    every = load_config("configs/paper/mlm-125m-baseline.yaml", base)
    masked = load_config("configs/paper/mlm-125m-baseline.yaml", [*base, "model.mlm_head_positions=masked"])
    m, t = every.model, every.train
    share = max_masked_positions(m.seq_len) / m.seq_len
    spec = steptime.DEVICE_SPECS["h200-141gb"]
    a = steptime.predict(every, spec, 1, 1, counts="formula")
    b = steptime.predict(masked, spec, 1, 1, counts="formula")
    logits = t.global_batch_size * m.seq_len * m.padded_vocab_size(1)  # per step, all micro-batches
    loss = steptime.loss_bytes_per_logit(every, 2) * logits / spec.bytes_per_s("fused")
    assert a.memory - b.memory == pytest.approx((1 - share) * loss, rel=1e-9)
    assert a.compute > b.compute and a.attention == b.attention and a.optimizer == b.optimizer
    device = perf_plan.DEVICES["a100-40gb"]
    want = share * perf_plan.logits_bytes(every, device)
    assert perf_plan.logits_bytes(masked, device) == pytest.approx(want, rel=1e-12)
