"""Training dynamics in multi-process runs (2 processes, gloo): runs that survive divergence,
the learning rate the optimizer really used under fp16 overflows, per-layer gradient norms equal at
every layout, the learning-rate stability test's stop.

The runs read the small-vocabulary novels (``small_vocab_prefix`` with ``SMALL_VOCAB``: their subject
is the training's diagnostics, not the GPT-2 vocabulary), all but the stability test's: its "it
learned first" (a loss more than 1 nat below the first step's) and the learning rate at which it
diverges are the GPT-2 vocabulary's, so it keeps that data."""

from __future__ import annotations

import json
import math

import pytest

from megaformer.config.schema import TrainConfig
from megaformer.training.schedule import lr_at
from tests.distributed.conftest import CPU_FP16_PATH, SMALL_VOCAB, read_scalars, run_ranks
from tests.distributed.test_train_launch import CONFIG, TINY, _check

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks): outside `scripts/check.sh --fast`


def test_lr_1000_without_clipping_ends_cleanly_and_counts_nonfinite_steps(small_vocab_prefix, tmp_path):
    # ZeRO 0, fp32: nothing skips the non-finite updates, so the weights themselves become inf/NaN.
    proc = run_ranks(
        CONFIG,
        [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.steps=6", "train.lr=1000",
         "train.grad_clip=0", "train.zero_stage=0", "train.eval_interval=3", f"output.dir={tmp_path}"],
    )  # fmt: skip
    _check(proc)
    assert "Traceback" not in proc.stderr and "OverflowError" not in proc.stderr
    assert "non-finite loss or gradient norm" in proc.stdout
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    count = scalars["train/nonfinite_steps"]
    assert sorted(count) == list(range(1, 7))
    assert count[6] >= 1 and all(count[s] <= count[s + 1] for s in range(1, 6))
    assert count[1] == 0  # the first step (lr 500, initial weights) is still finite
    # the values TensorBoard cannot draw are counted under nonfinite/<tag>
    assert scalars["nonfinite/train/grad_norm"][6] >= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nonfinite_steps"] == count[6]


def test_fp16_skipped_steps_counted_and_lr_is_the_optimizers(small_vocab_prefix, tmp_path, monkeypatch):
    """A huge initial loss scale forces overflows: DeepSpeed skips those updates and does not step
    the scheduler, so the lr of step s is the schedule's at the number of updates applied before."""
    monkeypatch.setenv("PYTHONPATH", CPU_FP16_PATH)
    engine_json = tmp_path / "fp16.json"
    engine_json.write_text(json.dumps({"fp16": {"initial_scale_power": 19, "hysteresis": 1}}))
    overrides = ["train.steps=8", "train.warmup_steps=4", "train.lr=3e-3", "train.min_lr=3e-4"]
    proc = run_ranks(
        CONFIG,
        [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", *overrides, "train.precision=fp16",
         "train.zero_stage=1", f"train.deepspeed_config={engine_json}", "train.eval_interval=8",
         f"output.dir={tmp_path}/run"],
    )  # fmt: skip
    _check(proc)
    scalars = read_scalars(str(tmp_path / "run" / "tensorboard"))
    skipped = scalars["train/skipped_steps"]
    assert sorted(skipped) == list(range(1, 9))
    assert 1 <= skipped[8] < 8, skipped  # some overflows, then real updates
    t = TrainConfig(steps=8, warmup_steps=4, lr=3e-3, min_lr=3e-4, lr_decay="cosine")
    before = {1: 0, **{s + 1: int(skipped[s]) for s in range(1, 8)}}  # skipped before step s
    for s in range(1, 9):
        assert scalars["train/lr"][s] == pytest.approx(lr_at(s - 1 - before[s], t), rel=1e-6), s
    # the step counter's lr (what was logged before) differs once a step was skipped
    assert any(abs(scalars["train/lr"][s] - lr_at(s - 1, t)) > 1e-6 for s in range(2, 9))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == skipped[8]


def test_per_layer_grad_norms_equal_at_tp2_and_pp2(small_vocab_prefix, tmp_path):
    """grads/* and scales/* at TP = 2 and at pp = 2 equal TP = 1 (there dp = 2 under ZeRO-1, so the
    reference's gradients are assembled by safe_get_full_grad) at the same steps."""
    common = [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "model.resid_scale=true",
              "train.steps=2", "train.warmup_steps=2", "train.diagnostics_interval=1",
              "train.eval_interval=2", "train.zero_stage=1"]  # fmt: skip
    runs = {}
    for name, layout in (("tp1", []), ("tp2", ["parallel.tp_size=2"]), ("pp2", ["parallel.pp_size=2"])):
        proc = run_ranks(CONFIG, [*common, *layout, f"output.dir={tmp_path}/{name}"])
        _check(proc)
        runs[name] = read_scalars(str(tmp_path / name / "tensorboard"))
    ref = runs["tp1"]
    tags = [t for t in ref if t.startswith(("grads/", "scales/"))]
    ops = {
        "qkv",
        "out_proj",
        "fc1",
        "fc2",
        "ln1",
        "ln2",
        "post_attn_ln",
        "ffn_ln",
        "head_scale",
        "resid_scale",
    }
    for layer in ("00", "01"):
        assert {f"grads/l2/{op}/layer_{layer}" for op in ops} | {f"grads/fc2_l1/layer_{layer}"} <= set(tags)
        for op in ("ffn_ln", "post_attn_ln", "head_scale", "resid_scale"):
            assert f"scales/{op}_mean/layer_{layer}" in tags
    for name in ("tp2", "pp2"):
        for tag in tags:
            for step in (1, 2):
                assert runs[name][tag][step] == pytest.approx(ref[tag][step], rel=1e-5), (name, tag, step)
    assert all(v > 0 and math.isfinite(v) for t in tags if t.startswith("grads/") for v in ref[t].values())


def test_lr_stability_test_stops_at_a_finite_divergence_lr(gutenberg_prefix, tmp_path):
    """Pre-LN, lr rising by a fixed amount per step from 0, no clipping: the run stops at the first
    step whose loss exceeds 1.5 × its running minimum (or is not finite), saves and records it. On
    the GPT-2 data: the 1-nat fall below and the divergence point are that vocabulary's."""
    proc = run_ranks(
        CONFIG,
        [*TINY, f"data.prefix={gutenberg_prefix}", "model.post_attn_ln=false", "model.head_scale=false",
         "model.ffn_ln=false", "train.lr_decay=ramp", "train.lr_ramp=0.02", "train.grad_clip=0",
         "train.divergence_factor=1.5", "train.steps=60", "train.eval_interval=60", "train.zero_stage=0",
         f"output.dir={tmp_path}"],
    )  # fmt: skip
    _check(proc)
    summary = json.loads((tmp_path / "summary.json").read_text())
    step, lr = summary["diverged_at_step"], summary["diverged_at_lr"]
    assert 1 < step < 60 and summary["steps"] == step
    assert lr == pytest.approx(step * 0.02, rel=1e-6) and math.isfinite(lr)
    assert (tmp_path / "checkpoints" / f"global_step{step}").is_dir()
    assert "diverged at step" in proc.stdout
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    loss = scalars["train/loss"]
    assert sorted(loss) == list(range(1, step + 1))
    assert all(scalars["train/lr"][s] == pytest.approx(s * 0.02, rel=1e-6) for s in loss)
    lowest = min(loss[s] for s in range(1, step))
    assert lowest < loss[1] - 1.0  # it learned first, then diverged
    assert not math.isfinite(loss[step]) or loss[step] > 1.5 * lowest
