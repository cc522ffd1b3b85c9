"""Budget runs on 2 processes: each self-timed run fixes the length its own timing affords, the
learning rate decays to it, the decision survives a kill and resume, and a run slower than its
calibration is ended at the budget."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from megaformer.training.budget import steps_for_budget
from tests.distributed.conftest import SMALL_VOCAB, read_scalars, run_ranks
from tests.distributed.test_train_launch import CONFIG, _check
from tests.distributed.test_train_launch import TINY as TINY_MODEL

TINY = [*SMALL_VOCAB, *TINY_MODEL]  # on the test tier's 500-entry BPE (conftest's small_vocab_prefix)

# multi-process training runs (run_ranks): outside `scripts/check.sh --fast`; they time the
# machine (the self-timed decisions, the calibrated run's spend guard), so they run alone
pytestmark = [pytest.mark.slow, pytest.mark.serial]

BUDGET = 0.007  # device-hours: 12.6 s of wall-clock on 2 processes
# The decision comes after step DECIDED_AT (5 skipped + budget.measure_steps 20; the learning rate's
# warm-up ends there too). On the 500-entry BPE a TINY step takes 0.017 s on 2 ranks here (2026-12-07;
# 0.19 s at GPT-2's 50,304 rows, which took 0.2-0.5 s on the 2-core CI machines), so the decision
# comes within a few seconds of the start and a machine 10x slower still has steps left to decide on.
# (The bodies are TINY's: an 8-layer body once made NormFormer's extra LayerNorms cost +7 %, but
# NormFormer's fewer steps are for a quiet machine and are not asserted here, and it made a step
# 0.5 s: on a slow CI machine the decision came only once the budget was spent.)
DECIDED_AT = 25
SAVE_INTERVAL = 15  # a checkpoint after the decision (30, 45, ...) for the resume test
PRE_LN = ["model.post_attn_ln=false", "model.head_scale=false", "model.ffn_ln=false"]
NORMFORMER = ["model.post_attn_ln=true", "model.head_scale=true", "model.ffn_ln=true"]


def _budget_run(prefix: str, out, scheme: list[str]):
    # budget.overrun=1: these runs test the decision (its step count, the schedule, the
    # resume); the end-at-the-budget rule, which a loaded CI machine would trigger a step or two
    # early, is tested on its own below.
    start = time.perf_counter()
    proc = run_ranks(
        CONFIG,
        [*TINY, *scheme, f"data.prefix={prefix}", "train.steps=5000", f"train.warmup_steps={DECIDED_AT}",
         f"budget.measure_steps={DECIDED_AT - 5}", f"budget.device_hours={BUDGET}", "train.eval_interval=25",
         f"train.save_interval={SAVE_INTERVAL}", "budget.overrun=1",
         "train.log_interval=25", f"output.dir={out}"],
    )  # fmt: skip
    proc.wall_seconds = time.perf_counter() - start
    _check(proc)
    summary = json.loads((out / "summary.json").read_text())
    # the tests below need steps after the decision and a checkpoint between it and the end
    assert summary["steps"] > DECIDED_AT + SAVE_INTERVAL - DECIDED_AT % SAVE_INTERVAL, (
        f"{out}: {summary['steps']} steps at {summary['budget_step_seconds']:.3f} s a step; this machine "
        f"is too slow for a budget of {BUDGET} device-hours (the decision alone came at step {DECIDED_AT})"
    )
    return proc, summary


@pytest.fixture(scope="module")
def budget_runs(small_vocab_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    return {
        name: (root / name, *_budget_run(small_vocab_prefix, root / name, scheme))
        for name, scheme in (("pre_ln", PRE_LN), ("normformer", NORMFORMER))
    }


def test_each_self_timed_run_fixes_the_length_its_own_timing_affords(budget_runs):
    """Each run times its steps 6..25, fixes the largest length whose forecast fits the budget
    (steps_for_budget on the inputs it logged), and both forecasts fill the budget to one step.

    What the runs then spend is the machine's, not the code's, so it is not asserted here (the
    spends of compare's calibrated runs are measured by bench/budget_fairness.py, BENCHMARKS.md;
    the forecast beside the spend in every summary.json shows a self-timed run's): on the 2-core
    CI machine a 20-step window left these two runs −9 % and +24 % off the budget (CI,
    2026-12-03: 0.0128 and 0.0173 device-hours of 0.014), which failed the ±15 % this test once
    asserted. What is checked of the spend: it is counted once per device over the loop's
    wall-clock (no more than the launch's wall-clock allows).
    """
    for name, (_, proc, summary) in budget_runs.items():
        assert "run length fixed at" in proc.stdout, name
        assert summary["budget_device_hours"] == BUDGET and summary["budget_steps"] == summary["steps"]
        assert summary["steps"] < 5000  # the budget, not train.steps, ended the run
        assert summary["tokens"] == summary["steps"] * 8 * 64
        assert summary["budget_decided_at"] == DECIDED_AT and summary["budget_calibrated"] is False
        step, evaluation = summary["budget_step_seconds"], summary["budget_eval_seconds"]
        logged = re.search(
            r"step ([0-9.]+) s \(steps 6\.\.25, slowest rank\), evaluation ([0-9.]+) s", proc.stdout
        )
        assert logged and logged[1] == f"{step:.4f}" and logged[2] == f"{evaluation:.3f}", name
        spent = summary["budget_spent_at_decision_seconds"]  # job wall-clock at the decision
        assert 0 < spent < BUDGET * 3600 / 2
        assert summary["steps"] == steps_for_budget(
            seconds_left=BUDGET * 3600 / 2 - spent,
            done=DECIDED_AT,
            step_seconds=step,
            eval_seconds=evaluation,
            eval_interval=25,
            max_steps=5000,
        ), name
        # the forecast fits the budget, and one more step (and an evaluation) would not
        forecast = summary["budget_forecast_device_hours"]
        assert forecast <= BUDGET < forecast + 2 * (step + evaluation) / 3600, name
        # device-hours: 2 devices × the loop's wall-clock, within the launch's
        assert spent * 2 / 3600 < summary["device_hours"] <= 2 * proc.wall_seconds / 3600, name


def test_the_learning_rate_decays_to_the_chosen_step(budget_runs):
    out, _, summary = budget_runs["pre_ln"]
    lr = read_scalars(str(out / "tensorboard"))["train/lr"]
    last = summary["steps"]
    assert sorted(lr)[-1] == last
    assert lr[last] == pytest.approx(3e-4, rel=1e-4)  # min_lr of the quickstart config, at the end


def test_a_killed_budget_run_resumes_to_the_same_step(budget_runs, small_vocab_prefix, tmp_path):
    out, _, summary = budget_runs["pre_ln"]
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints", resumed / "checkpoints")
    saved = sorted(
        int(tag.name[len("global_step") :]) for tag in (resumed / "checkpoints").glob("global_step*")
    )
    # killed after the last checkpoint before the end, which came after the decision
    killed_at = max(step for step in saved if step < summary["steps"])
    assert killed_at > DECIDED_AT, saved
    for step in saved:
        if step != killed_at:
            shutil.rmtree(resumed / "checkpoints" / f"global_step{step}")
    (resumed / "checkpoints" / "latest").write_text(f"global_step{killed_at}")
    proc, again = _budget_run(small_vocab_prefix, resumed, [*PRE_LN, "train.resume=auto"])
    assert "as decided before the resume" in proc.stdout
    assert again["steps"] == summary["steps"] and again["resumed_from_step"] == killed_at


def test_a_run_slower_than_its_calibration_ends_at_the_budget(small_vocab_prefix, tmp_path):
    """Calibrated times far below the real ones (0.01 s a step): the run fixes a length it cannot
    afford, then ends once one more step and the final evaluation would pass the budget by more
    than budget.overrun (default +10 %: a guard against a wrong calibration); evaluated and
    saved there, complete (exit 0), and said so."""
    out = tmp_path / "slow"
    proc = run_ranks(
        CONFIG,
        [*TINY, f"data.prefix={small_vocab_prefix}", "train.steps=5000", "train.eval_interval=1000",
         "train.save_interval=0", "train.log_interval=50", "budget.device_hours=0.004",
         "budget.step_seconds=0.01", "budget.eval_seconds=0.01", f"output.dir={out}"],
    )  # fmt: skip
    _check(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert "calibrated step 0.0100 s" in proc.stdout and "budget spent at step" in proc.stdout
    assert summary["budget_stopped_at"] == summary["steps"] < summary["budget_steps"]
    assert summary["stopped"] is None and summary["final_valid_loss"] > 0  # evaluated at that step
    # Where it stopped, the rule held (within one step's noise above the median it predicts
    # from). What follows is the final evaluation, which the rule could only predict from the
    # deliberately wrong calibrated 0.01 s (a loaded CI machine took 0.3 s: 7 % of this small
    # budget), and the final save: charged to the run, so the total is larger still.
    at_stop = float(
        re.search(r"budget spent at step \d+ of \d+ planned: ([0-9.e-]+) device-hours", proc.stdout)[1]
    )
    # the guard's default, +10 % (budget.overrun), named in the log
    assert "budget.overrun=0.1)" in proc.stdout
    assert at_stop <= 0.004 * 1.10 * 1.02
    assert summary["device_hours"] > at_stop
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{summary['steps']}"
