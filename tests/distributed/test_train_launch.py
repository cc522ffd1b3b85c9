"""End to end through launch/pretrain.sh: 2 DeepSpeed processes on gloo, real text, TensorBoard,
resume, and the launcher's refusals; the precision and ZeRO paths on ranks started by the tests
(``run_ranks``: their subject is the engine, not the launcher), on the test tier's 500-entry BPE of
the same novels (conftest's ``small_vocab_prefix``)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from tests.distributed.conftest import CPU_FP16_PATH, SMALL_VOCAB, read_scalars, run_pretrain, run_ranks

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=5",
    "train.log_interval=5",
    "train.eval_interval=10",
    "train.eval_batches=2",
    "data.valid_fraction=0.02",
]


def _check(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    )


# Dropout on in the run that is resumed: exact resume needs every rank's generator state back.
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


@pytest.fixture(scope="module")
def run30(gutenberg_prefix, tmp_path_factory):
    out = tmp_path_factory.mktemp("run30")
    proc = run_pretrain(
        CONFIG,
        [
            *TINY,
            f"data.prefix={gutenberg_prefix}",
            "train.steps=30",
            "train.save_interval=15",
            *DROPOUT,
            f"output.dir={out}",
        ],
    )
    _check(proc)
    return out, proc


def test_two_process_run_loss_falls_and_tensorboard_has_every_scalar(run30):
    out, proc = run30
    scalars = read_scalars(str(out / "tensorboard"))
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s"):
        assert sorted(scalars[tag]) == list(range(1, 31)), tag  # every step
    assert sorted(scalars["valid/loss"]) == [10, 20, 30]
    assert scalars["valid/ppl"][30] == pytest.approx(math.exp(scalars["valid/loss"][30]), rel=1e-4)
    loss = scalars["train/loss"]
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(26, 31)) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(50257)=10.8 toward the unigram entropy
    assert scalars["valid/loss"][30] < scalars["valid/loss"][10]
    assert scalars["train/lr"][5] == pytest.approx(3e-3, rel=1e-5)  # end of warmup
    assert all(v > 0 and math.isfinite(v) for v in scalars["train/grad_norm"].values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["final_valid_loss"] == pytest.approx(scalars["valid/loss"][30], rel=1e-5)
    assert "TensorBoard: tensorboard --logdir" in proc.stdout
    # compute accounting: model FLOPs, TFLOP/s per device, MFU against the measured CPU peak,
    # tokens and device-hours consumed, every step in TensorBoard and in the summary
    for tag in ("train/tflops_per_device", "train/mfu", "train/tokens", "train/device_hours"):
        assert sorted(scalars[tag]) == list(range(1, 31)), tag
    assert scalars["train/tokens"][30] == 30 * 8 * 64  # steps × global batch × seq_len
    from megaformer.config import load_config
    from megaformer.training.flops import model_flops_per_token

    cfg = load_config(CONFIG, TINY)
    assert summary["model_flops_per_token"] == pytest.approx(model_flops_per_token(cfg.model))
    assert summary["tokens"] == 30 * 8 * 64 and 0 < summary["mfu"] < 1
    assert summary["tflops_per_device"] == pytest.approx(
        summary["model_flops_per_token"] * summary["tokens_per_s"] / 2 / 1e12
    )
    assert 0 < summary["device_hours"] <= 2 * summary["train_seconds"] / 3600 * 1.05
    assert "GFLOP per token" in proc.stdout and "MFU" in proc.stdout
    assert os.path.isdir(out / "checkpoints" / "global_step15")
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step30"


def test_resume_auto_continues_exactly(run30, gutenberg_prefix, tmp_path):
    """Drop the last checkpoint, resume from step 15: steps 16..30 repeat the uninterrupted losses.

    With dropout on, so the per-rank generator states must come back with the checkpoint.
    """
    out, _ = run30
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / "global_step30")
    (resumed / "checkpoints" / "latest").write_text("global_step15")
    proc = run_pretrain(
        CONFIG,
        [*TINY, f"data.prefix={gutenberg_prefix}", "train.steps=30", "train.save_interval=15",
         "train.resume=auto", *DROPOUT, f"output.dir={resumed}"],
    )  # fmt: skip
    _check(proc)
    assert "resumed from" in proc.stdout and "at step 15" in proc.stdout
    assert "restored generator states on 2/2 ranks" in proc.stdout
    manifest = json.loads((resumed / "checkpoints" / "global_step15" / "manifest.json").read_text())
    assert manifest["optimizer_param_order"] == "aligned"  # what this resume built its optimizer in
    assert "saved before the optimizer's parameters were ordered" not in proc.stdout
    full = read_scalars(str(out / "tensorboard"))["train/loss"]
    again = read_scalars(str(resumed / "tensorboard"))["train/loss"]
    assert sorted(again) == list(range(16, 31))
    for step in range(16, 31):
        assert again[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    # tokens and device-hours continue from the checkpoint's count, not from zero
    first, second = read_scalars(str(out / "tensorboard")), read_scalars(str(resumed / "tensorboard"))
    assert second["train/tokens"][16] == 16 * 8 * 64
    assert second["train/device_hours"][16] > first["train/device_hours"][15]


@pytest.mark.parametrize(("precision", "zero"), [("bf16", 3), ("fp32", 0), ("fp32", 2)])
def test_precision_and_zero_stage_run(small_vocab_prefix, tmp_path, precision, zero):
    proc = run_ranks(
        CONFIG,
        [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.steps=6",
         f"train.precision={precision}", f"train.zero_stage={zero}", "train.eval_interval=6",
         f"output.dir={tmp_path}"],
    )  # fmt: skip
    _check(proc)
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert len(scalars["train/loss"]) == 6 and all(math.isfinite(v) for v in scalars["train/loss"].values())
    assert all(v > 0 for v in scalars["train/grad_norm"].values())  # reported on every path
    assert f"{precision} | ZeRO {zero}" in proc.stdout


def test_impossible_layout_fails_before_training(gutenberg_prefix, tmp_path):
    proc = run_pretrain(
        CONFIG,
        [*TINY, f"data.prefix={gutenberg_prefix}", "train.micro_batch_size=4", "train.global_batch_size=12",
         f"output.dir={tmp_path}"],
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        "train.global_batch_size=12 is not divisible by train.micro_batch_size × data-parallel size"
        in proc.stderr
    )
    assert not (tmp_path / "tensorboard").exists()


def test_missing_dataset_is_a_clear_error(tmp_path):
    proc = run_pretrain(
        CONFIG, [*TINY, f"data.prefix={tmp_path}/none_text_document", f"output.dir={tmp_path}/run"]
    )
    assert proc.returncode != 0
    assert "none_text_document.bin" in proc.stderr and "data_tools.preprocess" in proc.stderr


def test_fp16_dynamic_loss_scale_is_logged(small_vocab_prefix, tmp_path, monkeypatch):
    """The fp16 path (DeepSpeed's dynamic loss scaler) on CPU, which DeepSpeed refuses unless told."""
    monkeypatch.setenv("PYTHONPATH", CPU_FP16_PATH)
    proc = run_ranks(
        CONFIG,
        [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.steps=6", "train.precision=fp16",
         "train.zero_stage=1", "train.eval_interval=6", f"output.dir={tmp_path}"],
    )  # fmt: skip
    _check(proc)
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert sorted(scalars["train/loss_scale"]) == list(range(1, 7))
    assert all(v >= 1 for v in scalars["train/loss_scale"].values())
    assert all(math.isfinite(v) for v in scalars["train/loss"].values())
