"""Training-dynamics parts on one process: per-layer gradient norms and learned scales against
explicit computations, the fp16 loss-scale correction, non-finite accounting, the divergence rule,
the ramp schedule and its config checks, TensorBoard's non-finite counts and hparams."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from megaformer.config import load_config
from megaformer.config.schema import ConfigError, ModelConfig, TrainConfig
from megaformer.model import NormFormerLM
from megaformer.training.diagnostics import (
    DivergenceDetector,
    LayerDiagnostics,
    StepHealth,
    param_norm_squared,
)
from megaformer.training.metrics import MetricsWriter, format_duration, format_step_line
from megaformer.training.schedule import lr_at
from tests.tiny_model import TINY_MODEL

torch.set_num_threads(1)

TINY = dataclasses.replace(TINY_MODEL, num_layers=3, resid_scale=True)
ONE = SimpleNamespace(
    tp_size=1, pp_size=1, tp_rank=0, dp_rank=0, tp_group=None, pp_group=None, split_tp_group=None
)


def _model_with_grads(config: ModelConfig = TINY, scale: float = 1.0) -> NormFormerLM:
    torch.manual_seed(0)
    model = NormFormerLM(config)
    with torch.no_grad():  # scales away from 1 so their means are informative
        for block in model.blocks if config.head_scale else ():
            block.head_scale.mul_(torch.linspace(0.5, 1.5, block.head_scale.numel()))
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    (model(tokens, tokens) * scale).backward()
    return model


def test_per_layer_grad_norms_equal_explicit_norms():
    model = _model_with_grads()
    diag = LayerDiagnostics(model, TINY, ONE)
    diag.collect_grads()
    out = diag.grad_scalars()
    assert diag.grad_scalars() == {}  # read once
    for i, block in enumerate(model.blocks):
        g = block.fc2.weight.grad
        assert float(out[f"grads/fc2_l1/layer_{i:02d}"]) == pytest.approx(float(g.abs().mean()), rel=1e-6)
        for op in ("qkv", "out_proj", "fc1", "fc2", "ln1", "ln2", "post_attn_ln", "ffn_ln"):
            params = list(getattr(block, op).parameters())
            want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
            assert float(out[f"grads/l2/{op}/layer_{i:02d}"]) == pytest.approx(want, rel=1e-6), op
        for op in ("head_scale", "resid_scale"):
            want = float(getattr(block, op).grad.norm())
            assert float(out[f"grads/l2/{op}/layer_{i:02d}"]) == pytest.approx(want, rel=1e-6), op
    assert "grads/l2/qkv_ln/layer_00" not in out  # a switch that is off has no tag


def test_fp16_loss_scale_is_divided_out():
    plain = LayerDiagnostics(_model_with_grads(), TINY, ONE)
    scaled = LayerDiagnostics(_model_with_grads(scale=1024.0), TINY, ONE, loss_scale=lambda: 1024.0)
    plain.collect_grads()
    scaled.collect_grads()
    a, b = plain.grad_scalars(), scaled.grad_scalars()
    assert a.keys() == b.keys()
    for tag in a:
        assert float(b[tag]) == pytest.approx(float(a[tag]), rel=1e-5), tag


def test_scale_means_and_histograms_are_the_parameters():
    model = _model_with_grads()
    diag = LayerDiagnostics(model, TINY, ONE)
    means, hists = diag.scale_means(), diag.scale_histograms()
    for i, block in enumerate(model.blocks):
        for op, p in (("ffn_ln", block.ffn_ln.weight), ("post_attn_ln", block.post_attn_ln.weight),
                      ("head_scale", block.head_scale), ("resid_scale", block.resid_scale)):  # fmt: skip
            assert float(means[f"scales/{op}_mean/layer_{i:02d}"]) == pytest.approx(
                float(p.detach().mean()), rel=1e-6
            )
            assert torch.equal(hists[f"scales/{op}/layer_{i:02d}"], p.detach().float())
    assert float(param_norm_squared(model, ONE)) == pytest.approx(
        sum(float(p.detach().square().sum()) for p in model.parameters()), rel=1e-5
    )


def test_pre_ln_has_no_scales():
    config = dataclasses.replace(TINY, post_attn_ln=False, head_scale=False, ffn_ln=False, resid_scale=False)
    diag = LayerDiagnostics(_model_with_grads(config), config, ONE)
    assert diag.scale_means() == {} and diag.scale_histograms() == {}
    diag.collect_grads()
    assert {t.split("/")[2] for t in diag.grad_scalars() if t.startswith("grads/l2/")} == {
        "qkv", "out_proj", "fc1", "fc2", "ln1", "ln2"
    }  # fmt: skip


def test_step_health_counts_nonfinite_steps_on_the_device():
    engine = SimpleNamespace(skipped_steps=lambda: 3)
    health = StepHealth(engine, torch.device("cpu"), fp16=False, divergence_factor=0.0)
    for loss, norm in ((1.0, 2.0), (math.nan, 2.0), (1.0, torch.tensor(math.inf)), (1.0, None)):
        values = health.step(torch.tensor(loss, dtype=torch.float64), norm)
    assert int(values["train/nonfinite_steps"]) == 2 and values["train/skipped_steps"] == 3
    assert not health.diverged(torch.tensor(math.nan))  # the stop is off
    assert "2 more step(s)" in health.announce({"train/nonfinite_steps": 2.0})
    assert health.announce({"train/nonfinite_steps": 2.0}) is None  # said once
    fp16 = StepHealth(engine, torch.device("cpu"), fp16=True, divergence_factor=0.0)
    values = fp16.step(torch.tensor(1.0), torch.tensor(math.inf))  # an overflow: skipped, not diverged
    assert int(values["train/nonfinite_steps"]) == 0


def test_divergence_detector():
    d = DivergenceDetector(2.0)
    assert not any(d.diverged(x) for x in (10.0, 6.0, 5.0, 9.9))
    assert d.running_min == 5.0
    assert d.diverged(10.5)
    assert DivergenceDetector(2.0).diverged(math.inf)


def test_ramp_schedule_and_its_config_checks(tmp_path):
    t = TrainConfig(lr_decay="ramp", lr_ramp=5e-5, warmup_steps=10)
    assert [lr_at(s, t) for s in (0, 1, 99)] == pytest.approx([5e-5, 1e-4, 5e-3])
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 10\n  warmup_steps: 0\n")
    load_config(str(path), ["train.lr_decay=ramp", "train.lr_ramp=1e-3", "train.divergence_factor=2"])
    for bad, key in ((["train.lr_decay=ramp"], "train.lr_ramp"), (["train.lr_ramp=1e-3"], "train.lr_ramp"),
                     (["train.divergence_factor=0.5"], "train.divergence_factor"),
                     (["train.diagnostics_interval=-1"], "train.diagnostics_interval")):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            load_config(str(path), bad)


def test_tensorboard_counts_nonfinite_values_and_has_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(str(tmp_path), enabled=True, hparams={"train": {"lr": 0.1, "seq": [1, 2]}})
    writer.scalars(1, {"train/loss": 2.0, "train/tokens": 512})
    writer.scalars(2, {"train/loss": math.nan, "train/grad_norm": math.inf, "train/tokens": 1024})
    writer.scalars(3, {"train/loss": math.inf, "train/tokens": 1536})
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    assert scalars["train/loss"] == {1: 2.0}
    assert scalars["nonfinite/train/loss"] == {2: 1.0, 3: 2.0}
    assert scalars["nonfinite/train/grad_norm"] == {2: 1.0}
    assert scalars["train/loss-vs-tokens"] == {512: 2.0}
    plugins = acc.PluginTagToContent("hparams")
    assert (
        "_hparams_/session_start_info" in plugins and b"train.lr" in plugins["_hparams_/session_start_info"]
    )


def test_console_line_has_time_memory_health_and_eta():
    line = format_step_line(
        3, 10, {"train/loss": 5.0, "train/peak_memory_gib": 1.5, "train/nonfinite_steps": 0.0}, eta_s=3725
    )
    assert line[:2] == "20" and "step 3/10" in line and "peak mem 1.50 GiB" in line and "nonfinite 0" in line
    assert line.endswith("eta 1h02m")
    assert [format_duration(s) for s in (7, 95, 3725)] == ["7s", "1m35s", "1h02m"]


def test_fp16_loss_scale_give_up_becomes_a_typed_error():
    """DeepSpeed 0.19's loss scaler raises a bare Exception at its minimum scale; the adapter names
    it, so the loop can end the run cleanly (and lets any other error through)."""
    from megaformer.training.ds_adapter import Engine, LossScaleExhaustedError

    class FakeDeepSpeed:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def gradient_accumulation_steps(self) -> int:
            return 1

        def fp16_enabled(self) -> bool:
            return True

        def bfloat16_enabled(self) -> bool:
            return False

        def zero_optimization(self) -> bool:
            return False

        def _get_optimizer_loss_scale(self) -> float:
            return 1.0

        def __call__(self, tokens, labels):
            return torch.tensor(1.0, requires_grad=True)

        def backward(self, loss) -> None:
            pass

        def is_gradient_accumulation_boundary(self) -> bool:
            return True  # one micro-batch per step

        def step(self) -> None:
            raise self.error

    batches = iter([(torch.zeros(1), torch.zeros(1))] * 2)
    give_up = Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
    with pytest.raises(LossScaleExhaustedError, match="minimum loss scale"):
        Engine(FakeDeepSpeed(give_up), ONE, pipelined=False).train_step(batches)
    with pytest.raises(RuntimeError, match="something else"):
        Engine(FakeDeepSpeed(RuntimeError("something else")), ONE, pipelined=False).train_step(batches)
