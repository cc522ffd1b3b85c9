"""The compute budget's arithmetic and the schedule whose end it fixes."""

from __future__ import annotations

import pytest

from megaformer.config import load_config
from megaformer.training.budget import evaluations_between, steps_for_budget
from megaformer.training.schedule import Schedule, lr_at


def test_evaluations_between_counts_every_interval_and_the_end():
    assert evaluations_between(0, 100, 50) == 2  # 50, 100 (the end is one of them)
    assert evaluations_between(0, 101, 50) == 3  # 50, 100 and the end at 101
    assert evaluations_between(12, 49, 50) == 1  # only the end
    assert evaluations_between(50, 50, 50) == 0


def test_steps_for_budget_is_the_largest_that_fits():
    common = dict(done=12, step_seconds=0.5, eval_seconds=2.0, eval_interval=50, max_steps=10_000)
    # 100 s left: S - 12 steps at 0.5 s plus its evaluations at 2 s
    s = steps_for_budget(seconds_left=100.0, **common)
    cost = lambda n: (n - 12) * 0.5 + evaluations_between(12, n, 50) * 2.0  # noqa: E731
    assert cost(s) <= 100.0 < cost(s + 1)
    # 196: 184 steps (92 s) + evaluations at 50, 100, 150 and the end (8 s) = 100 s; 197 costs 100.5 s
    assert s == 196
    assert steps_for_budget(seconds_left=1e9, **common) == 10_000  # capped by train.steps
    assert steps_for_budget(seconds_left=0.1, **common) == 12  # not one step fits


def test_schedule_end_can_be_fixed_during_warmup_only():
    t = load_config(None, ["train.steps=1000", "train.warmup_steps=20", "train.lr_decay=linear"]).train
    schedule = Schedule(t)
    assert schedule.lr(500) == pytest.approx(lr_at(500, t))
    schedule.set_total_steps(300, step=14)
    assert schedule.lr(299) == pytest.approx(t.min_lr)  # the decay ends exactly at the chosen step
    assert schedule.lr(19) == pytest.approx(t.lr)  # warmup unchanged
    with pytest.raises(ValueError, match=r"after train.warmup_steps=20"):
        schedule.set_total_steps(400, step=21)


def test_budget_must_be_decided_during_warmup():
    from megaformer.config import ConfigError

    with pytest.raises(ConfigError, match=r"raise train.warmup_steps to >= 25"):
        load_config(None, ["budget.device_hours=1", "train.warmup_steps=5"])
    load_config(None, ["budget.device_hours=1", "train.warmup_steps=25"])


def test_machine_factor_scales_the_spend_limit_not_the_length():
    """A run resumed on a slower machine than its calibration's (factor 1.12) may spend 1.12× the
    budget in this machine's seconds; without the factor the same spend ends it."""
    from megaformer.config import ConfigError
    from megaformer.training.budget import overspent

    calibrated = ["budget.device_hours=1", "budget.step_seconds=0.5", "budget.overrun=0.02"]
    same = load_config(None, calibrated)
    slower = load_config(None, [*calibrated, "budget.machine_factor=1.12"])
    spent = 3600.0 * 1.10  # device-seconds: 10 % over the budget in this machine's time
    assert overspent(same, spent, world_size=2)
    assert not overspent(slower, spent, world_size=2)
    assert overspent(slower, 3600.0 * 1.12 * 1.02 + 1.0, world_size=2)
    with pytest.raises(ConfigError, match=r"budget\.machine_factor=1.1: .*budget\.step_seconds > 0"):
        load_config(None, ["budget.device_hours=1", "train.warmup_steps=25", "budget.machine_factor=1.1"])
    with pytest.raises(ConfigError, match=r"budget\.machine_factor=0.0: must be > 0"):
        load_config(None, [*calibrated, "budget.machine_factor=0"])


def test_the_log_names_the_machine_factor_of_a_slower_machine():
    from megaformer.training.budget import BudgetKeeper

    calibrated = ["budget.device_hours=1", "budget.step_seconds=0.5"]
    for extra, said in (([], False), (["budget.machine_factor=1.15"], True)):
        keeper = BudgetKeeper(load_config(None, [*calibrated, *extra]), world_size=2, start_step=0)
        keeper.decided = 3000
        line = keeper.describe(0, 2)
        assert "run length fixed at 3000 steps" in line
        assert ("budget.machine_factor=1.15" in line) is said
