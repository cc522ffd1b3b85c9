"""Pipeline parallelism (issue 5) end to end on gloo, real text (the ranks
started as DeepSpeed's launcher starts them: tests/distributed/conftest.py run_ranks).

One reference run in one process (pp = 1: the layer list without the pipeline engine); the other
layouts repeat its per-step losses from the same seed (same weights) and the same samples:

* pp = 2 (2 processes) within 1e-5 relative, grad norms too (fp32, clipping active);
* pp = 2 with activation checkpointing (type:NormFormerBlock partition) = pp = 2 without it;
* tp = 2 × pp = 2 (4 processes, activation checkpointing with partitioned activations) within 1e-4;
* a checkpoint of the tp 2 × pp 2 run loads in one process (tp 2 → 1, pp 2 → 1) and one of the
  pp = 2 run at pp = 1 × dp = 2 (train.init_from): the next step's loss equals the uninterrupted
  run's (weights only; the optimizer restarts, so later steps differ and are not compared);
* pp = 2 resumes exactly from its own DeepSpeed checkpoint (train.resume=auto);
* pp = 2 × dp = 2 with ZeRO-1 in bf16 trains (loss falls), one TensorBoard writer;
* the fp16 path (dynamic loss scaling) runs at pp = 2 on CPU (tests/support/cpu_fp16 on PYTHONPATH);
* ZeRO-2 with pp = 2 is refused before any process group starts.
"""

from __future__ import annotations

import glob
import math
import shutil

import pytest

from tests.distributed.conftest import CPU_FP16_PATH, SMALL_VOCAB, read_scalars, run_pretrain, run_ranks

pytestmark = pytest.mark.slow  # multi-process training runs: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
# Every layout sees the same 8 samples per step: 1 process = 2 micro-batches of 4, pp = 2 (dp = 1)
# = 2 pipeline micro-batches, pp = 1 × dp = 2 = one micro-batch per rank. The data: the test
# tier's 500-entry BPE of the same novels (conftest's small_vocab_prefix; an 11x shorter step).
TINY_MODEL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "model.resid_scale=true",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=3",
    "train.steps=10",
    "train.log_interval=5",
    "train.eval_interval=10",
    "train.eval_batches=1",
    "train.save_interval=5",
    "train.zero_stage=0",
    "data.valid_fraction=0.02",
]
TINY = [*SMALL_VOCAB, *TINY_MODEL]
STEPS = range(1, 11)
RUNS = {  # name: (processes, overrides)
    "pp1": (1, []),
    "pp2": (2, ["parallel.pp_size=2"]),
    "pp2_ac": (
        2,
        [
            "parallel.pp_size=2",
            "train.activation_checkpointing=true",
            "parallel.partition_method=type:NormFormerBlock",
        ],
    ),
    "tp2_pp2_ac": (4, ["parallel.tp_size=2", "parallel.pp_size=2", "train.activation_checkpointing=true"]),
}


def _check(name: str, proc) -> None:
    assert proc.returncode == 0, (
        f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


@pytest.fixture(scope="module")
def runs(small_vocab_prefix, tmp_path_factory):
    out = {}
    for name, (nproc, extra) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(name)
        proc = run_ranks(
            CONFIG, [*TINY, *extra, f"data.prefix={small_vocab_prefix}", f"output.dir={run_dir}"], nproc=nproc
        )
        _check(name, proc)
        out[name] = (run_dir, proc, read_scalars(str(run_dir / "tensorboard")))
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_pp2_repeats_pp1_step_for_step(runs):
    ref = runs["pp1"][2]
    got = runs["pp2"][2]
    assert "| pp 2 (parameters) | dp 1 |" in runs["pp2"][1].stdout
    assert sorted(got["train/loss"]) == list(STEPS)
    for step in STEPS:
        assert _rel(got["train/loss"][step], ref["train/loss"][step]) <= 1e-5, step
        assert _rel(got["train/grad_norm"][step], ref["train/grad_norm"][step]) <= 1e-4, step
    assert _rel(got["valid/loss"][10], ref["valid/loss"][10]) <= 1e-5
    loss = ref["train/loss"]
    assert loss[10] < loss[1] - 1.0  # it trains: the comparison is not between two stuck runs
    assert max(ref["train/grad_norm"].values()) > 1.0  # clipping (grad_clip = 1) was active


def test_activation_checkpointing_gives_the_same_losses(runs):
    off, on = runs["pp2"][2], runs["pp2_ac"][2]
    assert "| pp 2 (type:NormFormerBlock) |" in runs["pp2_ac"][1].stdout
    for step in STEPS:
        assert _rel(on["train/loss"][step], off["train/loss"][step]) <= 1e-6, step


def test_tp2_pp2_repeats_one_process(runs):
    ref, got = runs["pp1"][2], runs["tp2_pp2_ac"][2]
    assert "| tp 2 | pp 2 (parameters) | dp 1 |" in runs["tp2_pp2_ac"][1].stdout
    for step in STEPS:
        assert _rel(got["train/loss"][step], ref["train/loss"][step]) <= 1e-4, step
        assert _rel(got["train/grad_norm"][step], ref["train/grad_norm"][step]) <= 1e-3, step


@pytest.mark.parametrize(
    ("source", "nproc", "layout"),
    [("tp2_pp2_ac", 1, []), ("pp2", 2, [])],  # tp 2 → 1 and pp 2 → 1; pp 2 → 1 and dp 1 → 2
    ids=["tp2pp2-to-1proc", "pp2-to-pp1dp2"],  # the processes alone fix dp: 1 → 1 × 1, 2 → 1 × 2
)
def test_checkpoint_loads_at_another_layout_with_the_same_next_loss(
    runs, small_vocab_prefix, tmp_path, source, nproc, layout
):
    src_dir, _, full = runs[source]
    proc = run_ranks(
        CONFIG,
        [*TINY, *layout, f"data.prefix={small_vocab_prefix}",
         f"train.init_from={src_dir / 'checkpoints' / 'global_step5'}", f"output.dir={tmp_path}"],
        nproc=nproc,
    )  # fmt: skip
    _check(source, proc)
    assert "initialised weights from" in proc.stdout and "fresh optimizer" in proc.stdout
    got = read_scalars(str(tmp_path / "tensorboard"))
    assert sorted(got["train/loss"]) == list(range(6, 11))  # (steps fixes the sample order: keep 10)
    assert _rel(got["train/loss"][6], full["train/loss"][6]) <= 1e-5


def test_pp2_resume_auto_continues_exactly(runs, small_vocab_prefix, tmp_path):
    src_dir, _, full = runs["pp2"]
    assert glob.glob(str(src_dir / "checkpoints" / "global_step5" / "layer_0*-model_00-model_states.pt"))
    shutil.copytree(src_dir / "checkpoints", tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "checkpoints" / "global_step10")
    (tmp_path / "checkpoints" / "latest").write_text("global_step5")
    proc = run_ranks(
        CONFIG,
        [
            *TINY,
            *RUNS["pp2"][1],
            f"data.prefix={small_vocab_prefix}",
            "train.resume=auto",
            f"output.dir={tmp_path}",
        ],
        nproc=2,
    )
    _check("resume", proc)
    assert "at step 5" in proc.stdout
    again = read_scalars(str(tmp_path / "tensorboard"))["train/loss"]
    assert sorted(again) == list(range(6, 11))
    for step in range(6, 11):
        assert again[step] == pytest.approx(full["train/loss"][step], rel=1e-6, abs=1e-7), step


def test_pp2_dp2_zero1_bf16_trains_with_one_writer(gutenberg_prefix, tmp_path):
    """On GPT-2's vocabulary: its fall of more than 1 nat in 20 steps is a third of the way from
    ln(50257) to the unigram entropy; the 500-entry BPE has less than 1 nat to fall."""
    proc = run_ranks(
        CONFIG,
        [*TINY_MODEL, "parallel.pp_size=2", "train.zero_stage=1", "train.precision=bf16", "train.steps=20",
         "train.micro_batch_size=2", "train.eval_interval=20", "train.save_interval=0",
         f"data.prefix={gutenberg_prefix}", f"output.dir={tmp_path}"],
        nproc=4,
    )  # fmt: skip
    _check("bf16", proc)
    assert "| pp 2 (parameters) | dp 2 |" in proc.stdout and "bf16 | ZeRO 1" in proc.stdout
    assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 1
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    for tag in ("train/loss", "train/grad_norm", "train/tokens_per_s"):
        assert sorted(scalars[tag]) == list(range(1, 21)), tag
    loss = scalars["train/loss"]
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(16, 21)) / 5
    assert last < first - 1.0, (first, last)
    assert math.isfinite(scalars["valid/loss"][20])


def test_pp2_fp16_dynamic_loss_scaling_runs_on_cpu(small_vocab_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", CPU_FP16_PATH)
    proc = run_ranks(
        CONFIG,
        [*TINY, "parallel.pp_size=2", "train.zero_stage=1", "train.precision=fp16", "train.steps=3",
         "train.warmup_steps=1", "train.eval_interval=3", "train.save_interval=0",
         f"data.prefix={small_vocab_prefix}", f"output.dir={tmp_path}"],
        nproc=2,
    )  # fmt: skip
    _check("fp16", proc)
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert sorted(scalars["train/loss_scale"]) == list(range(1, 4))
    assert all(v >= 1 for v in scalars["train/loss_scale"].values())
    assert all(math.isfinite(v) for v in scalars["train/loss"].values())


def test_zero2_with_pipeline_is_refused_before_any_process_group(small_vocab_prefix, tmp_path):
    proc = run_pretrain(
        CONFIG,
        [*TINY, "parallel.pp_size=2", "train.zero_stage=2", f"data.prefix={small_vocab_prefix}",
         f"output.dir={tmp_path}"],
        nproc=2,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "train.zero_stage=2 with parallel.pp_size=2" in proc.stderr
    assert not (tmp_path / "tensorboard").exists()


def test_reshard_tool_reads_pipeline_checkpoints(runs, tmp_path):
    """The tp 2 × pp 2 checkpoint's layer files consolidate to the same full weights as the
    pp = 1 files the reshard tool writes from them (any (tp, pp) -> tp ranks at pp = 1)."""
    import torch

    from megaformer.checkpoint.reshard import consolidate, reshard

    src = str(runs["tp2_pp2_ac"][0] / "checkpoints")
    out = reshard(src, str(tmp_path / "tp1"), tp=1)
    full, saved, _ = consolidate(out)
    original, _, info = consolidate(src + "/global_step10")
    assert (info["tp_size"], info["pp_size"]) == (2, 2) and saved["parallel"]["pp_size"] == 1
    assert full.keys() == original.keys() and "tied_modules.embed.token.weight" in full
    for name, tensor in original.items():
        assert torch.equal(full[name], tensor), name
    # What one pipeline stage asks for at init_from: its own parameters only, the same tensors.
    wanted = {name for name in original if name.startswith(("tied_modules.embed.", "1."))}
    part, _, _ = consolidate(src + "/global_step10", names=wanted)
    assert part.keys() == wanted and len(wanted) < len(original)
    assert all(torch.equal(part[name], original[name]) for name in wanted)
