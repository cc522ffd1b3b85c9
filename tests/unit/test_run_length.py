"""The run's length as a policy (RunLength) and its config section (budget): the loop asks after
every step; the decision is saved and restored; the old train.budget_* keys are refused with the new
name, and a run's own records written with them still load and resume."""

from __future__ import annotations

import json
import math
import signal
from types import SimpleNamespace

import pytest

from megaformer.checkpoint.resume_rules import config_changes
from megaformer.config import ConfigError, load_config, to_dict
from megaformer.training.budget import evaluations_between, steps_for_budget
from megaformer.training.run_length import GO_ON, RunLength
from megaformer.training.schedule import Schedule
from megaformer.training.stopping import BUDGET_SPENT, StopCheck
from megaformer.training.summary_file import null_non_finite

CONFIG = "configs/normformer-quickstart.yaml"
LAYOUT = SimpleNamespace(world_size=2, is_main=False)
CALIBRATED = [
    "train.steps=1000",
    "train.warmup_steps=50",
    "train.eval_interval=100",
    "budget.device_hours=0.1",
    "budget.step_seconds=0.5",
    "budget.eval_seconds=4",
    "budget.fixed_seconds=10",
]


@pytest.mark.parametrize("old", ["train.budget_overrun=0.1", "train.budget_device_hours=1"])
def test_an_old_budget_override_names_its_new_key(old):
    key = old.split("=")[0].removeprefix("train.budget_")
    with pytest.raises(ConfigError, match=rf"override '{old}': train\.budget_{key} is now budget\.{key}"):
        load_config(CONFIG, [old])


def test_an_old_budget_key_in_a_yaml_names_the_file_and_the_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  budget_measure_steps: 10\n")
    with pytest.raises(
        ConfigError, match=r"old\.yaml: train\.budget_measure_steps is now budget\.measure_steps"
    ):
        load_config(str(path))


def test_a_runs_own_record_written_with_the_old_keys_loads_and_resumes(tmp_path):
    cfg = load_config(CONFIG, ["budget.device_hours=0.5", "budget.overrun=0.02", "train.warmup_steps=30"])
    record = to_dict(cfg)
    old = dict(record["train"])
    for key, value in record.pop("budget").items():
        old[f"budget_{key}"] = value
    record["train"] = old
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**record, "provenance": {"commit": "e8dab63"}}))
    assert load_config(str(path)) == cfg  # the run's config.json, as an older version wrote it
    assert config_changes(record, cfg) == {}  # its checkpoints resume under the new names
    changed = config_changes(
        record, load_config(CONFIG, ["budget.device_hours=0.5", "train.warmup_steps=30"])
    )
    assert changed == {"budget.overrun": (0.02, 0.10)}  # a real change is still named, by its new key


def test_a_calibrated_budget_fixes_the_length_before_the_first_step_and_keeps_it_on_resume():
    cfg = load_config(CONFIG, CALIBRATED)
    schedule = Schedule(cfg.train)
    length = RunLength(cfg, LAYOUT, schedule, 0, {})
    assert length.total == 1000 and length.state_dict() == {}  # not decided yet
    assert "budget_forecast_device_hours" not in length.summary()  # no forecast before a decision
    with pytest.raises(RuntimeError, match="before the run length was decided"):
        length.budget.forecast_device_hours(2)
    length.begin(0, lambda: 0.0, lambda: 0.0)
    expect = steps_for_budget(
        seconds_left=0.1 * 3600 / 2 - 10,
        done=0,
        step_seconds=0.5,
        eval_seconds=4,
        eval_interval=100,
        max_steps=1000,
    )
    assert length.total == schedule.total_steps == expect < 1000
    assert length.state_dict() == {"budget_steps": expect}
    again = RunLength(cfg, LAYOUT, Schedule(cfg.train), 200, length.state_dict())
    assert again.total == expect and again.budget is None  # not decided a second time
    summary = length.summary()
    assert summary["budget_steps"] == expect and summary["budget_calibrated"] is True
    # the decision's inputs and its forecast, in device-hours: budget.fixed_seconds (10 s) and the
    # decided steps with their evaluations, on 2 devices; it fits the budget, one more step would not
    assert summary["budget_decided_at"] == 0 and summary["budget_spent_at_decision_seconds"] == 10
    forecast = (10 + expect * 0.5 + evaluations_between(0, expect, 100) * 4) * 2 / 3600
    assert summary["budget_forecast_device_hours"] == pytest.approx(forecast, rel=1e-12)
    recorded = summary["budget_forecast_device_hours"]
    assert recorded <= 0.1 < recorded + 2 * (0.5 + 4) / 3600


def test_a_self_timed_budget_stopped_before_its_decision_summarises_without_its_timings():
    # a preempted run (SIGTERM, train.exit_duration_mins) can end before step 5 + measure_steps:
    # its summary.json says the step time was not measured instead of failing to be written
    cfg = load_config(CONFIG, ["train.steps=1000", "budget.device_hours=0.1"])
    length = RunLength(cfg, LAYOUT, Schedule(cfg.train), 0, {})
    assert not length.calibrated
    summary = length.summary()
    assert math.isnan(summary["budget_step_seconds"]) and summary["budget_calibrated"] is False
    assert "budget_decided_at" not in summary and "budget_forecast_device_hours" not in summary
    written = null_non_finite(summary, length.missing_reasons())  # as the trainer writes it
    assert written["budget_step_seconds"] is None
    assert written["missing"] == {
        "budget_step_seconds": "the run stopped before its budget timed its steps (budget.measure_steps)"
    }
    json.dumps(written, allow_nan=False)  # strict JSON, as the trainer writes it


def test_the_policy_answers_after_each_step_with_the_reason():
    cfg = load_config(CONFIG, ["train.steps=100"])
    assert (
        RunLength(cfg, LAYOUT, Schedule(cfg.train), 0, {}).after_step(5, 0.0) == GO_ON
    )  # nothing to stop it
    asked = []

    def preempt() -> str | None:
        asked.append(1)
        return "signal SIGTERM"

    length = RunLength(cfg, LAYOUT, Schedule(cfg.train), 0, {}, stop=preempt)
    verdict = length.after_step(40, 0.0)
    assert verdict.stop and verdict.preempted and verdict.reason == "signal SIGTERM"
    assert length.after_step(100, 0.0) == GO_ON and len(asked) == 1  # the last step: not asked
    length.end_at(60)  # a divergence
    assert length.total == 60 and length.summary() == {}


def test_a_spent_budget_ends_the_run_complete_and_says_where():
    cfg = load_config(CONFIG, CALIBRATED)
    stop = StopCheck("", 0.0)
    length = RunLength(cfg, LAYOUT, Schedule(cfg.train), 0, {}, stop=stop)
    spent = {"seconds": 0.0}
    length.begin(0, lambda: spent["seconds"], lambda: 0.5)
    planned = length.total
    assert length.after_step(10, 0.0) == GO_ON
    spent["seconds"] = 0.1 * 3600 * 1.11  # past the budget and its 10 % overrun
    verdict = length.after_step(11, 0.111)
    assert verdict.stop and not verdict.preempted and verdict.reason is None
    assert length.total == 11
    summary = length.summary()
    assert summary["budget_stopped_at"] == 11 and summary["budget_steps"] == planned
    assert BUDGET_SPENT == "budget spent"


def test_a_signal_beats_a_budget_and_is_named(monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # no handler installed in the test process
    cfg = load_config(CONFIG, CALIBRATED)
    stop = StopCheck("SIGTERM", 0.0)
    stop.received = "SIGTERM"
    length = RunLength(cfg, LAYOUT, Schedule(cfg.train), 0, {}, stop=stop)
    length.begin(0, lambda: 1e9, lambda: 0.0)  # over budget too
    verdict = length.after_step(3, 0.0)
    assert (
        verdict.preempted
        and verdict.reason == "signal SIGTERM"
        and length.summary()["budget_stopped_at"] is None
    )
