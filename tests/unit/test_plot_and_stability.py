"""The plot tool on TensorBoard events written like a run's, and the stability command's parts."""

from __future__ import annotations

import json

import pytest
import torch

from megaformer.config import load_config
from megaformer.experiments.lr_stability import markdown, ramp_overrides, summarize
from megaformer.tools.plot import main as plot_main
from megaformer.training.metrics import MetricsWriter


def _fake_run(path, layers: int = 3, scale: float = 1.0) -> None:
    writer = MetricsWriter(str(path / "tensorboard"), enabled=True, hparams={"train": {"lr": 1e-3}})
    for step in range(1, 21):
        values = {"train/loss": 10.0 / step, "train/tokens": 512 * step}
        if step % 10 == 0:
            for layer in range(layers):
                values[f"grads/fc2_l1/layer_{layer:02d}"] = scale * (layer + 1) / step
                values[f"grads/l2/fc2/layer_{layer:02d}"] = scale * (layer + 2) / step
            writer.histograms(
                step, {f"scales/head_scale/layer_{i:02d}": torch.linspace(0.5, 1.5, 8) for i in range(layers)}
            )
        writer.scalars(step, values)
    writer.scalars(20, {"valid/loss": 2.5}, tokens=512 * 20)
    writer.close()


def test_plot_writes_every_figure(tmp_path, capsys):
    _fake_run(tmp_path / "a")
    _fake_run(tmp_path / "b", scale=2.0)
    assert plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "png")]) == 0
    names = {
        "loss.png",
        "grads_fc2_l1_by_layer.png",
        "a_grads_l2.png",
        "b_grads_l2.png",
        "a_scales.png",
        "b_scales.png",
    }
    assert {p.name for p in (tmp_path / "png").iterdir()} == names
    for name in names:
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(tmp_path / "a"), "--step", "7"]) == 2  # not a diagnostics step
    assert "not a diagnostics step" in capsys.readouterr().err
    assert not (tmp_path / "a" / "plots").exists()  # nothing written for a bad request
    assert plot_main([str(tmp_path / "missing")]) == 2
    assert "no tensorboard/ events" in capsys.readouterr().err


def test_stability_overrides_load_and_the_median_skips_runs_that_did_not_diverge(tmp_path):
    cfg = load_config("configs/normformer-quickstart.yaml", ramp_overrides(5e-5, 2.0, 1000, seed=3))
    assert (cfg.train.lr_decay, cfg.train.lr_ramp, cfg.train.seed, cfg.train.steps) == ("ramp", 5e-5, 3, 1000)
    table = summarize({"pre_ln": {1: 0.01, 2: 0.03, 3: None}, "normformer": {1: None}})
    assert table["pre_ln"]["median_lr"] == pytest.approx(0.02) and table["pre_ln"]["not_diverged"] == 1
    assert table["normformer"]["median_lr"] is None
    text = markdown(table, 5e-5, 2.0, 1000)
    assert "| pre_ln | 0.02 | 1: 0.01, 2: 0.03, 3: — | 1 |" in text
    json.dumps(table)  # the table is written as JSON


def test_a_run_without_diagnostics_is_named_when_the_fc2_figure_is_skipped(tmp_path, capsys):
    """One run without FC2 gradient norms: the figure is skipped, and the console says which run
    and how to record them (before, it was skipped silently)."""
    _fake_run(tmp_path / "a")
    writer = MetricsWriter(str(tmp_path / "plain" / "tensorboard"), enabled=True, hparams={})
    for step in range(1, 21):
        writer.scalars(step, {"train/loss": 10.0 / step, "train/tokens": 512 * step})
    writer.close()
    assert (
        plot_main([str(tmp_path / "a"), str(tmp_path / "plain"), "--output-dir", str(tmp_path / "png")]) == 0
    )
    assert not (tmp_path / "png" / "grads_fc2_l1_by_layer.png").exists()
    err = capsys.readouterr().err
    assert "grads_fc2_l1_by_layer.png not written: plain logged no FC2 gradient norms" in err
    assert "train.diagnostics_interval > 0" in err
