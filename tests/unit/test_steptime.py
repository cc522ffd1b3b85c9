"""The step-time model (megaformer.tools.steptime): formulas, MFU definition, CPU validation."""

from __future__ import annotations

import json
import os

import pytest

from megaformer.config import load_config
from megaformer.tools import plan as plan_tool
from megaformer.tools.steptime import (
    DEVICE_SPECS,
    bubble_fraction,
    collective_time,
    cpu_device,
    predict,
    ring_allreduce_bytes,
    ring_gather_bytes,
)
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
    # The 125M NormFormer row's committed median (13.1 s) is the slowest of the three committed runs
    # (BENCHMARKS.md: 12.4 s in another); the model is 25-29 % under it: a looser bound, stated.
    [("quickstart", 0.25), ("125m_pre_ln", 0.25), ("125m_normformer", 0.35)],
)
def test_cpu_prediction_against_committed_measurements(case, tolerance):
    """Predicted from bench/results/cpu_device.json; measured figures as committed (not re-measured)."""
    with open(VALIDATION) as f:
        measured = json.load(f)["cases"][case]["measured_step_s"]
    if case == "quickstart":
        cfg, dev, world = _cfg("configs/normformer-quickstart.yaml"), cpu_device(1, 2), 2
    else:
        nf = case.endswith("normformer")
        cfg = _cfg(
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
        dev, world = cpu_device(2, 1), 1
    predicted = predict(cfg, dev, world, world).total
    assert abs(predicted / measured - 1) <= tolerance, (predicted, measured)
