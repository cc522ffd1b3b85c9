"""Issue 23, items 1 and 2: an extended run's first new update takes the new schedule's learning
rate; a finished run relaunched is recognised before anything is written; summary.json is strict
JSON (a figure not measured is null, with why)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from data_tools.files import atomic_write_json
from megaformer.checkpoint import integrity
from megaformer.checkpoint.manager import finished_run
from megaformer.config import ConfigError, load_config, to_dict
from megaformer.training.schedule import Schedule, apply_schedule, build_scheduler, lr_at
from megaformer.training.summary_file import null_non_finite

CONFIG = "configs/normformer-quickstart.yaml"
SHORT = ["train.warmup_steps=2"]  # the quickstart's warmup exceeds these runs' lengths


def _optimizer(t):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr)
    return model, opt


def _train(model, opt, scheduler, steps):
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()


def test_an_extension_resumes_at_the_new_schedules_lr():
    """A 6-step run saved, resumed as an 8-step run: the checkpoint's optimizer state brings back
    the 6-step schedule's rate (min_lr); every later update must take the uninterrupted 8-step
    run's rate, the first one included."""
    t6 = load_config(CONFIG, ["train.steps=6", "train.warmup_steps=2"]).train
    t8 = dataclasses.replace(t6, steps=8)
    model, opt = _optimizer(t6)
    scheduler = build_scheduler(opt, t6, Schedule(t6))
    _train(model, opt, scheduler, 6)
    saved_opt, saved_sched = opt.state_dict(), scheduler.state_dict()

    model2, opt2 = _optimizer(t8)
    scheduler2 = build_scheduler(opt2, t8, Schedule(t8))
    opt2.load_state_dict(saved_opt)  # what DeepSpeed's load_checkpoint does
    scheduler2.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(5, t6, 6))  # the stale rate
    assert lr_at(6, t8) != pytest.approx(lr_at(5, t6, 6))  # so the fix matters
    assert apply_schedule(scheduler2) == pytest.approx(lr_at(6, t8), rel=1e-12)

    model3, opt3 = _optimizer(t8)  # the uninterrupted 8-step run
    scheduler3 = build_scheduler(opt3, t8, Schedule(t8))
    _train(model3, opt3, scheduler3, 6)
    for _ in range(2):  # updates 7 and 8 take the same rate
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt3.param_groups[0]["lr"], rel=1e-12)
        assert scheduler2.get_last_lr() == pytest.approx(scheduler3.get_last_lr(), rel=1e-12)
        _train(model2, opt2, scheduler2, 1)
        _train(model3, opt3, scheduler3, 1)


def test_apply_schedule_changes_nothing_on_an_unchanged_schedule():
    t = load_config(CONFIG, ["train.steps=10", "train.warmup_steps=2"]).train
    model, opt = _optimizer(t)
    scheduler = build_scheduler(opt, t, Schedule(t))
    _train(model, opt, scheduler, 4)
    before = opt.param_groups[0]["lr"]
    assert apply_schedule(scheduler) == pytest.approx(before, rel=1e-15)


def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_summary_non_finite_figures_become_null_with_a_reason(tmp_path):
    summary = {
        "steps": 8,
        "stopped": None,
        "tokens_per_s": math.nan,
        "final_valid_loss": math.nan,
        "final_valid_ppl": math.inf,
        "mfu": None,
        "tokens": 16384,
        "nested": {"x": -math.inf, "y": 1.5},
    }
    reasons = {"tokens_per_s": "no training step ran", "mfu": "no peak known"}
    cleaned = null_non_finite(summary, reasons)
    assert cleaned["tokens_per_s"] is None and cleaned["final_valid_ppl"] is None
    assert cleaned["nested"] == {"x": None, "y": 1.5} and cleaned["tokens"] == 16384
    assert cleaned["missing"] == {
        "tokens_per_s": "no training step ran",
        "final_valid_loss": "not finite (nan)",
        "final_valid_ppl": "not finite (inf)",
        "mfu": "no peak known",
        "nested.x": "not finite (-inf)",
    }
    assert summary["tokens_per_s"] is not None  # the input is left as it was
    path = tmp_path / "summary.json"
    atomic_write_json(path, cleaned, allow_nan=False)
    assert _strict_loads(path.read_text()) == cleaned
    assert null_non_finite({"a": 1.0}) == {"a": 1.0}  # nothing missing: no "missing" key


def test_strict_json_writer_refuses_nan_and_leaves_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(ValueError):
        atomic_write_json(path, {"a": math.nan}, allow_nan=False)
    assert _strict_loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left


def _checkpoint(out, step, steps, summary=None):
    cfg = load_config(CONFIG, [*SHORT, f"train.steps={steps}", f"output.dir={out}"])
    tag_dir = out / "checkpoints" / f"global_step{step}"
    tag_dir.mkdir(parents=True)
    integrity.write_manifest(str(tag_dir), {}, step, to_dict(cfg))
    integrity.write_latest(str(out / "checkpoints"), tag_dir.name)
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary))
    return cfg


def test_finished_run_is_recognised_only_when_nothing_is_left_to_train(tmp_path):
    out = tmp_path / "run"
    cfg = _checkpoint(out, 12, 12, {"steps": 12, "stopped": None})
    assert finished_run(cfg) is None  # train.resume=none: a fresh start is check_output_dir's
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="auto"))
    message, summary = finished_run(auto)
    assert "run already complete" in message and str(out / "summary.json") in message
    assert "global_step12 is at train.steps=12" in message and summary == {"steps": 12, "stopped": None}
    extend = load_config(
        CONFIG,
        [*SHORT, "train.steps=16", "train.extend_steps=true", "train.resume=auto", f"output.dir={out}"],
    )
    assert finished_run(extend) is None  # an extension trains on
    changed = load_config(
        CONFIG, [*SHORT, "train.steps=12", "train.resume=auto", "model.hidden_size=256", f"output.dir={out}"]
    )
    with pytest.raises(ConfigError, match=r"model\.hidden_size: saved 128, now 256"):
        finished_run(changed)  # the resume rules still apply


def test_finished_run_ended_before_train_steps_by_its_summary(tmp_path):
    """A budget run or a divergence stop ends before train.steps; its summary says where."""
    out = tmp_path / "run"
    _checkpoint(out, 7, 20, {"steps": 7, "stopped": None, "diverged_at_step": 7})
    auto = load_config(CONFIG, [*SHORT, "train.steps=20", "train.resume=auto", f"output.dir={out}"])
    message, _ = finished_run(auto)
    assert "at step 7, where its summary says it ended (train.steps=20)" in message
    stopped = tmp_path / "stopped"  # a signal stop is not an end: the run continues
    _checkpoint(stopped, 7, 20, {"steps": 7, "stopped": "signal SIGTERM"})
    assert (
        finished_run(dataclasses.replace(auto, output=dataclasses.replace(auto.output, dir=str(stopped))))
        is None
    )
    older = tmp_path / "older"  # the summary of an earlier segment: the run continues
    _checkpoint(older, 9, 20, {"steps": 7, "stopped": None})
    assert (
        finished_run(dataclasses.replace(auto, output=dataclasses.replace(auto.output, dir=str(older))))
        is None
    )


def test_finished_run_without_a_summary_still_writes_nothing(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 12, 12)
    auto = load_config(CONFIG, [*SHORT, "train.steps=12", "train.resume=auto", f"output.dir={out}"])
    message, summary = finished_run(auto)
    assert summary is None and "no summary.json" in message
