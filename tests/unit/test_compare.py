"""The comparison table's arithmetic: the compute at which each run reaches the baseline's best."""

from __future__ import annotations

import math

from megaformer.experiments.calibrate import Timing
from megaformer.experiments.compare import comparison_rows, hours_to_reach, markdown_table

BUDGET = 1.0


def _timings(*names: str, step: float = 0.1) -> dict[str, Timing]:
    return {n: Timing(step, 0.5, 1.0, []) for n in names}


def _summary(loss: float, hours: float) -> dict:
    return {
        "final_valid_loss": loss,
        "final_valid_ppl": math.exp(loss),
        "steps": 100,
        "tokens": 1000,
        "device_hours": hours,
    }


def test_hours_to_reach_is_the_first_evaluation_at_or_below_the_target():
    curve = [(10, 0.1, 6.0), (20, 0.2, 5.5), (30, 0.3, 5.0), (40, 0.4, 5.2)]
    assert hours_to_reach(curve, 5.5) == 0.2
    assert hours_to_reach(curve, 5.1) == 0.3
    assert hours_to_reach(curve, 4.0) is None


def test_rows_compare_every_run_with_the_baseline_best():
    runs = {
        "baseline": {"summary": _summary(5.0, 1.0), "curve": [(1, 0.5, 5.5), (2, 1.0, 5.0)]},
        "better": {"summary": _summary(4.8, 1.0), "curve": [(1, 0.5, 5.2), (2, 0.8, 4.9), (3, 1.0, 4.8)]},
        "worse": {"summary": _summary(5.3, 1.0), "curve": [(1, 1.0, 5.3)]},
    }
    rows = {r["run"]: r for r in comparison_rows(runs, BUDGET, _timings(*runs))}
    assert rows["baseline"]["hours_to_baseline_best_ppl"] == 1.0
    assert rows["better"]["hours_to_baseline_best_ppl"] == 0.8
    assert rows["better"]["share_of_baseline_compute"] == 0.8
    assert rows["worse"]["hours_to_baseline_best_ppl"] is None
    table = markdown_table(list(rows.values()), math.exp(5.0), BUDGET)
    assert "| better | 4.8000 |" in table and "80% of the baseline's" in table and "| never |" in table


def test_compute_share_uses_the_baseline_measured_like_the_others():
    """The share's denominator is the baseline's device-hours at its last evaluation (logged before
    it, as every run's numerator), not its summary's total with the final evaluation and save."""
    runs = {
        "baseline": {"summary": _summary(5.0, 1.1), "curve": [(1, 0.5, 5.5), (2, 1.0, 5.0)]},
        "better": {"summary": _summary(4.8, 1.1), "curve": [(1, 0.5, 5.2), (2, 0.8, 4.9)]},
    }
    timings = {"baseline": Timing(0.10, 0.5, 1.0, []), "better": Timing(0.106, 0.5, 1.0, [])}
    rows = {r["run"]: r for r in comparison_rows(runs, BUDGET, timings)}
    assert rows["baseline"]["share_of_baseline_compute"] == 1.0
    assert rows["better"]["share_of_baseline_compute"] == 0.8
    assert math.isclose(rows["better"]["step_time_ratio"], 1.06)
    assert math.isclose(rows["better"]["spend_deviation"], 0.1)


def test_a_run_on_a_slower_machine_is_counted_in_the_calibration_machines_hours(monkeypatch):
    """A resumed comparison's run trained on a machine 1.2× slower (budget_machine_factor 1.2):
    its curve, device-hours, spend and compute share are divided by the factor, like the baseline's
    that trained on the calibration's machine, so the share is not inflated by the slower VM."""
    from megaformer.experiments import compare as cmp

    raw = [(1, 0.6, 5.2), (2, 0.96, 4.9), (3, 1.2, 4.8)]  # this machine's hours
    monkeypatch.setattr(cmp, "valid_curve", lambda tb: raw)
    slow = {**_summary(4.8, 1.2), "budget_machine_factor": 1.2, "tensorboard_dir": "tb"}
    curve = cmp.calibrated_curve(slow)
    assert [round(h, 9) for _, h, _ in curve] == [0.5, 0.8, 1.0]
    runs = {
        "baseline": {"summary": _summary(5.0, 1.0), "curve": [(1, 0.5, 5.5), (2, 1.0, 5.0)]},
        "slow": {"summary": slow, "curve": curve},
    }
    rows = {r["run"]: r for r in comparison_rows(runs, BUDGET, _timings(*runs))}
    assert math.isclose(rows["slow"]["share_of_baseline_compute"], 0.8)
    assert math.isclose(rows["slow"]["device_hours"], 1.0) and rows["slow"]["device_hours_measured"] == 1.2
    assert math.isclose(rows["slow"]["spend_deviation"], 0.0, abs_tol=1e-12)
    assert rows["baseline"]["budget_machine_factor"] == 1.0
