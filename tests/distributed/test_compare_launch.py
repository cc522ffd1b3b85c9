"""``python -m megaformer.experiments.compare`` on the bundled corpus: two schemes calibrated
together, trained at one budget from their calibrated step times, a table and a PNG; a second call
reuses both the calibration and the runs."""

from __future__ import annotations

import json

import pytest

from megaformer.training.budget import steps_for_budget
from tests.distributed.conftest import REPO, SMALL_VOCAB

# runs through the launcher: outside `scripts/check.sh --fast`. Serial: the step counts come from a
# calibration of this machine, and beside another test's load it decided 20 steps where alone ~60
# (a clean-clone CI with compare in the parallel pass failed its `steps > 25`).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

TINY_MODEL = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=2", "model.seq_len=64",
    "train.micro_batch_size=4", "train.global_batch_size=8", "train.eval_interval=10",
    "train.eval_batches=2", "data.valid_fraction=0.02", "train.save_interval=0",
]  # fmt: skip
TINY = [*SMALL_VOCAB, *TINY_MODEL]  # the test tier's 500-entry BPE (conftest's small_vocab_prefix)


def test_compare_writes_its_table_and_plot(small_vocab_prefix, tmp_path, warm_experiment_launches, capsys):
    """In this process, its runs on warm-forked ranks (the subject is the comparison; a run through
    ``launch/pretrain.sh`` is test_launcher_runs.py's, the calibration's job through it below)."""
    from megaformer.experiments import compare

    out = tmp_path / "cmp"
    sets = [arg for item in [*TINY, f"data.prefix={small_vocab_prefix}"] for arg in ("--set", item)]
    cmd = [
        "configs/cpu-compare/pre_ln.yaml", "configs/cpu-compare/normformer.yaml",
        "--budget-device-hours", "0.004", "--output-dir", str(out), *sets,
        "--calibration-rounds", "2", "--calibration-warmup", "3", "--calibration-steps", "6",
    ]  # fmt: skip
    code = compare.main(cmd)
    said = capsys.readouterr()
    assert code == 0, said.out[-3000:] + said.err[-3000:]
    data = json.loads((out / "comparison.json").read_text())
    assert [r["run"] for r in data["rows"]] == ["pre_ln", "normformer"]
    for row in data["rows"]:
        # each run's length is the calibration's decision: the most steps whose calibrated cost (one-time
        # cost, steps, evaluations) fits the budget's 7.2 s of wall-clock on 2 ranks, whatever this
        # machine's speed (at GPT-2's vocabulary, 11x the step, a slow CI machine decided 24 steps at
        # 0.006 device-hours)
        run_config = json.loads((out / row["run"] / "config.json").read_text())
        b = run_config["budget"]
        assert b["step_seconds"] == pytest.approx(row["calibrated_step_seconds"], rel=1e-5)
        decided = steps_for_budget(
            seconds_left=0.004 * 3600 / 2 - b["fixed_seconds"], done=0, step_seconds=b["step_seconds"],
            eval_seconds=b["eval_seconds"], eval_interval=10, max_steps=run_config["train"]["steps"],
        )  # fmt: skip
        assert row["budget_steps"] == decided and row["budget_steps"] >= row["steps"]
        # two evaluations at least (eval_interval=10), for the curve and the hours to the baseline's best
        assert row["steps"] >= 20 and row["device_hours"] > 0 and row["final_valid_ppl"] > 1
    assert sorted(data["order"]) == ["normformer", "pre_ln"] and data["order_rule"] == "random"
    timings = data["calibration"]["timings"]
    assert [r["position"] for r in timings["pre_ln"]["rounds"]] == [0, 1]  # the order alternated
    assert (out / "calibration.json").is_file() and (out / "pre_ln" / "request.json").is_file()
    assert "calibrated step" in (out / "pre_ln" / "train.log").read_text()
    # the final validation read the whole held-out set (issue 37), after the regular one
    summary = json.loads((out / "pre_ln" / "summary.json").read_text())
    assert summary["final_valid_tokens"] > 2 * 8 * 64 and "final_valid_loss_sampled" in summary
    assert "final validation on" in (out / "pre_ln" / "train.log").read_text()
    assert not list((out / "calibration").glob("*/checkpoints"))  # calibration launches keep none
    assert data["rows"][0]["hours_to_baseline_best_ppl"] is not None  # the baseline reaches its own best
    table = (out / "comparison.md").read_text()
    assert "| pre_ln |" in table and "| normformer |" in table
    png = (out / "valid_ppl_vs_device_hours.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # a second call reuses the finished runs instead of training again
    # (after re-checking the reused calibration on this machine: 2 more rounds of short launches)
    code = compare.main(cmd)
    again = capsys.readouterr()
    assert code == 0 and "done before with the same request" in again.out, again.err[-3000:]
    assert (
        "calibration: reused" in again.out and "calibration re-check: this machine's step time" in again.out
    )
    recheck = json.loads((out / "calibration.json").read_text())["rechecks"][-1]
    assert set(recheck["ratios"]) == {"pre_ln", "normformer"} and recheck["measured"] > 0
    assert recheck["factor"] >= 1.0  # the re-check only ever loosens the spend limit


def test_the_step_interleaved_job_times_every_config_in_one_launch(gutenberg_prefix, tmp_path):
    """The calibration's step-interleaved job through launch/pretrain.sh (MEGAFORMER_MODULE): both
    configs built side by side in the same two processes, stepped turn by turn in alternating
    order; every turn timed; the step times and the paired ratio's error come back. Configs with
    different parallel layouts are refused before any process group starts, naming both files.

    On GPT-2's vocabulary: every round must be kept, and at the 500-entry BPE's 0.016 s step one
    turn of a bench run on 2026-12-07 took 0.027 s (a scheduler's hiccup, 1.75x the median), which
    the job rightly left out; at GPT-2's 0.19 s the same hiccup is within the tolerance."""
    from megaformer.experiments.calibrate import interleaved_step_times

    runs = {"pre_ln": "configs/cpu-compare/pre_ln.yaml", "nf": "configs/cpu-compare/normformer.yaml"}
    sets = [*TINY_MODEL, f"data.prefix={gutenberg_prefix}"]
    out = interleaved_step_times(runs, sets, tmp_path / "job", 2, warmup=2, rounds=4, steps_per_turn=2)
    turns = json.loads((tmp_path / "job" / "turns.json").read_text())["turns"]
    assert [(t["round"], t["name"]) for t in turns[:4]] == [
        (0, "pre_ln"),
        (0, "nf"),
        (1, "nf"),
        (1, "pre_ln"),
    ]
    assert all(len(t["step_seconds"]) == 2 and min(t["step_seconds"]) > 0 for t in turns)
    assert out["pre_ln"]["ratio"] == 1.0 and out["nf"]["rounds_kept"] == 4 and out["nf"]["steps"] == 8
    assert 0.5 < out["nf"]["ratio"] < 2.0 and out["nf"]["ratio_sem"] >= 0
    assert "step timing: 2 configs warmed up" in (tmp_path / "job" / "step_timing.log").read_text()

    tp2 = tmp_path / "tp2.yaml"
    tp2.write_text(f"base: {REPO / 'configs/cpu-compare/pre_ln.yaml'}\nparallel:\n  tp_size: 2\n")
    with pytest.raises(RuntimeError, match=r"step_timing.*failed \(exit 2\)"):
        interleaved_step_times({**runs, "tp2": str(tp2)}, sets, tmp_path / "bad", 2, warmup=2, rounds=2)
    said = (tmp_path / "bad" / "step_timing.log").read_text()
    assert "tp2.yaml: its parallel layout differs from configs/cpu-compare/pre_ln.yaml's" in said
