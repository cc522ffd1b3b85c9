"""The comparison table's arithmetic: the compute at which each run reaches the baseline's best."""

from __future__ import annotations

import math
from pathlib import Path

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


def test_the_calibrated_compute_share_does_not_move_with_the_machine():
    """Two runs of the same steps and calibrated times, one trained while the machine ran 30 %
    slower: the wall-clock share of the slow one moves, the calibrated one (steps × calibrated
    times, the budget's own accounting) does not."""
    from megaformer.experiments.compare import costed_curve

    timing = Timing(0.5, 2.0, 3.0, [])
    quiet = [(100, 0.04, 5.5), (200, 0.08, 5.0), (250, 0.1, 4.9)]
    slow = [(100, 0.052, 5.4), (200, 0.104, 4.9), (250, 0.13, 4.85)]
    costed = costed_curve(quiet, timing, world_size=2, eval_interval=100)
    # step 200: 3 s once, 200 steps of 0.5 s, 1 evaluation before it (at 100) of 2 s, on 2 devices
    assert math.isclose(costed[1][1], 2 * (3.0 + 200 * 0.5 + 1 * 2.0) / 3600)
    assert math.isclose(costed[2][1], 2 * (3.0 + 250 * 0.5 + 2 * 2.0) / 3600)  # evaluations at 100, 200
    runs = {
        "quiet": {"summary": _summary(4.9, 0.1), "curve": quiet, "costed": costed},
        "slow": {
            "summary": _summary(4.85, 0.13),
            "curve": slow,
            "costed": costed_curve(slow, timing, 2, 100),
        },
    }
    rows = {r["run"]: r for r in comparison_rows(runs, BUDGET, _timings(*runs))}
    assert rows["slow"]["share_basis"] == "calibrated"
    assert math.isclose(rows["slow"]["share_of_baseline_compute"], costed[1][1] / costed[2][1])
    assert math.isclose(rows["slow"]["share_of_baseline_compute_wallclock"], 0.104 / 0.1)
    assert math.isclose(rows["slow"]["calibrated_device_hours"], rows["quiet"]["calibrated_device_hours"])
    table = markdown_table(list(rows.values()), math.exp(4.9), BUDGET)
    assert "calibrated (steps × calibrated times" in table and "[wall-clock 104%]" in table


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


def _row(run: str, loss: float | None, share: float | None = 1.0, steps: int = 100) -> dict:
    return {"run": run, "final_valid_loss": loss, "steps": steps, "share_of_baseline_compute": share}


def _cfg(scheme: str, seed: int, out: str) -> dict:
    return {"model": {"norm_scheme": scheme}, "train": {"seed": seed, "lr": 1e-3}, "output": {"dir": out}}


def test_runs_that_differ_only_in_their_seed_form_one_group():
    from megaformer.experiments.seeds import group_label, seed_groups

    resolved = {
        "pre_ln_s1234": _cfg("pre_ln", 1234, "a"),
        "pre_ln_s5678": _cfg("pre_ln", 5678, "b"),
        "normformer_s1234": _cfg("normformer", 1234, "c"),
        "normformer_s5678": _cfg("normformer", 5678, "d"),
        "post_ln_s1234": _cfg("post_ln", 1234, "e"),
        "pre_ln_lr": {**_cfg("pre_ln", 1234, "f"), "train": {"seed": 1234, "lr": 3e-3}},
    }
    assert seed_groups(resolved) == {
        "pre_ln": ["pre_ln_s1234", "pre_ln_s5678"],
        "normformer": ["normformer_s1234", "normformer_s5678"],
        "post_ln_s1234": ["post_ln_s1234"],
        "pre_ln_lr": ["pre_ln_lr"],
    }
    assert group_label(["a-seed1", "a-seed2"]) == "a" and group_label(["x1", "y1"]) == "x1"


def test_over_seeds_mean_std_and_paired_differences_against_the_baseline():
    from megaformer.experiments.seeds import seed_summary, seed_table

    rows = [
        _row("pre_s1", 5.0),
        _row("pre_s2", 5.2),
        _row("pre_s3", 5.1),
        _row("nf_s1", 4.9, share=0.8),
        _row("nf_s2", 5.15, share=0.9),
        _row("nf_s3", 5.05, share=None),
        _row("post_s1", 5.5, share=None),
    ]
    groups = {"pre": ["pre_s1", "pre_s2", "pre_s3"], "nf": ["nf_s1", "nf_s2", "nf_s3"], "post": ["post_s1"]}
    seeds = {r["run"]: int(r["run"][-1]) for r in rows}
    summary = {g["group"]: g for g in seed_summary(rows, groups, seeds, {n: 7 for n in seeds})}
    assert math.isclose(summary["pre"]["final_valid_loss_mean"], 5.1)
    assert math.isclose(summary["pre"]["final_valid_loss_std"], 0.1)  # sample std (n - 1)
    assert summary["pre"]["paired"] is None and summary["nf"]["share_mean"] is None
    paired = summary["nf"]["paired"]  # -0.1, -0.05, -0.05
    assert paired["n"] == 3 and math.isclose(paired["mean"], -0.2 / 3)
    assert math.isclose(paired["std"], 0.0288675, rel_tol=1e-5)
    assert summary["post"]["final_valid_loss_std"] is None and summary["post"]["paired"]["std"] is None
    table = seed_table(list(summary.values()))
    assert "| nf | 1, 2, 3 | 5.0333 ± 0.1258 | 4.9000 – 5.1500 | -0.0667 ± 0.0289 (n = 3); 95 % CI [" in table
    assert "| +0.5000 (n = 1) | one seed pair: the comparison cannot be decided |" in table  # post: 1 seed
    assert "held out other documents" not in table
    # each seed its own held-out documents: said under the table; no pair across held-out sets
    own = seed_summary(rows, groups, seeds, seeds)
    assert "held out other documents" in seed_table(own)
    # one run per group: no table
    assert seed_table(seed_summary(rows[:1], {"pre": ["pre_s1"]}, seeds, seeds)) == ""


def test_paired_statistics_agree_with_scipy():
    """The seed table's statistics, each against scipy's own routine (and the power against a
    simulation of the test it sizes)."""
    import numpy as np
    from scipy import stats

    from megaformer.experiments.seeds import paired_test, pairs_for_power, power_of_paired_t

    diffs = [-0.0148, -0.0312, -0.0517, 0.004, -0.022, -0.009, -0.035, 0.011]
    out = paired_test(diffs, effect=0.036)
    ref = stats.ttest_1samp(diffs, 0.0)
    assert out["decidable"] and out["n"] == 8 and out["negative"] == 6
    assert math.isclose(out["t"], ref.statistic, rel_tol=1e-12) and math.isclose(
        out["p_t"], ref.pvalue, rel_tol=1e-9
    )
    ci = ref.confidence_interval(0.95)
    assert math.isclose(out["ci_low"], ci.low, rel_tol=1e-9) and math.isclose(
        out["ci_high"], ci.high, rel_tol=1e-9
    )
    assert math.isclose(out["p_wilcoxon"], stats.wilcoxon(diffs).pvalue, rel_tol=1e-12)
    assert math.isclose(out["p_sign"], stats.binomtest(6, 8).pvalue, rel_tol=1e-12)
    # the paired t-test is the one-sample test of the differences: scipy's paired form agrees
    base = np.linspace(5.0, 5.2, 8)
    assert math.isclose(stats.ttest_rel(base + np.array(diffs), base).pvalue, out["p_t"], rel_tol=1e-6)
    # power: Monte Carlo of the two-sided test at n = 6, effect 0.02, sd 0.02
    rng = np.random.default_rng(0)
    sims = rng.normal(0.02, 0.02, size=(20000, 6))
    rejected = stats.ttest_1samp(sims, 0.0, axis=1).pvalue < 0.05
    assert abs(power_of_paired_t(6, 0.02, 0.02) - rejected.mean()) < 0.015
    # the fewest pairs: the audit (sd 0.02: 6 pairs for 0.03, 8 for 0.025, 10 for 0.02)
    assert [pairs_for_power(e, 0.02) for e in (0.03, 0.025, 0.02)] == [6, 8, 10]
    n = out["pairs_for_power"]
    assert power_of_paired_t(n, 0.036, out["std"]) >= 0.8 > power_of_paired_t(n - 1, 0.036, out["std"])
    # fewer than two pairs, or no spread: not decided, and said why
    assert (
        paired_test([-0.02])["decidable"] is False and "cannot be decided" in paired_test([-0.02])["reason"]
    )
    assert paired_test([0.01, 0.01])["p_t"] is None


def test_plot_zooms_on_the_end_and_names_runs_off_the_scale(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megaformer.experiments import compare as cmp

    hours = [0.1 * k for k in range(1, 11)]
    runs = {
        "base": {"curve": [(k, h, 8.0 - 0.3 * k) for k, h in enumerate(hours, 1)]},  # ends at 5.0
        "better": {"curve": [(k, h, 7.9 - 0.31 * k) for k, h in enumerate(hours, 1)]},
        "stuck": {"curve": [(k, h, 7.5) for k, h in enumerate(hours, 1)]},
    }
    _, ax = plt.subplots()
    off = cmp._zoom(ax, runs, 1.0, math.exp(5.0))
    assert off == ["stuck"]
    low, high = ax.get_ylim()
    # from the lowest end to the highest shown value from 40 % of the budget on (base: 6.8 at 0.4)
    assert low < math.exp(4.8) < low + 0.05 * (high - low)  # the lowest end just above the bottom
    assert math.exp(6.8) < high < math.exp(7.5)  # the stuck run is not what sets the range
    assert ax.get_xlim()[0] == 0.4
    path = tmp_path / "plot.png"
    cmp.plot(runs, str(path), 1.0, {"base": ["base"], "better": ["better"], "stuck": ["stuck"]})
    assert path.stat().st_size > 10_000


def test_compare_groups_seeds_and_writes_the_table_json_and_plot(monkeypatch, tmp_path):
    """compare() from the calibration on, with the calibration and the runs stood in for: three
    configs that differ only in their seed form one group (same held-out documents through
    data.split_seed), reported as mean ± std and paired against the baseline's seeds."""
    import json

    import yaml

    from megaformer.config import load_config, to_dict
    from megaformer.experiments import calibrate as cal
    from megaformer.experiments import compare as cmp

    paths, final = [], {}
    for scheme, losses in (("pre_ln", (5.0, 5.2, 5.1)), ("normformer", (4.9, 5.15, 5.05))):
        for seed, loss in zip((1, 2, 3), losses):
            cfg = to_dict(load_config(f"configs/cpu-compare/{scheme}.yaml", [f"train.seed={seed}"]))
            path = tmp_path / f"{scheme}_s{seed}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            paths.append(str(path))
            final[path.stem] = loss
    names = [Path(p).stem for p in paths]
    timings = {n: Timing(0.1, 0.5, 1.0, []) for n in names}
    monkeypatch.setattr(cal, "calibrate_runs", lambda *a, **k: (timings, {"rounds": []}, "c" * 16))
    asked = {}

    def train_one(config, out, *a):
        asked[out.name] = a[-1]  # run_args: what the runs get beyond the calibration's overrides
        return {**_summary(final[out.name], 1.0), "tensorboard_dir": out.name}

    monkeypatch.setattr(cmp, "train_one", train_one)
    monkeypatch.setattr(cmp, "valid_curve", lambda tb: [(1, 0.5, final[tb] + 0.5), (2, 1.0, final[tb])])
    (tmp_path / "out").mkdir()  # calibrate_runs makes it
    cmp.compare(paths, names, BUDGET, str(tmp_path / "out"), ["data.split_seed=1"], nproc=2)
    record = json.loads((tmp_path / "out" / "comparison.json").read_text())
    groups = {g["group"]: g for g in record["seed_groups"]}
    assert list(groups) == ["pre_ln", "normformer"] and groups["pre_ln"]["seeds"] == [1, 2, 3]
    assert groups["normformer"]["same_heldout"] and groups["normformer"]["paired"]["n"] == 3
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "| normformer | 1, 2, 3 | 5.0333 ± 0.1258 |" in table and "held out other documents" not in table
    assert (tmp_path / "out" / "valid_ppl_vs_device_hours.png").stat().st_size > 10_000
    # the final validation reads the whole held-out set by default, in the runs only
    assert set(map(tuple, asked.values())) == {("train.final_eval_batches=0",)}
    assert record["final_eval_batches"] == 0 and record["effect"] == 0.036
    # the statistics of the pairs, and the calibrated compute share beside the wall-clock one
    paired = groups["normformer"]["paired"]
    assert paired["decidable"] and paired["ci_low"] < paired["mean"] < paired["ci_high"] and paired["p_t"] > 0
    assert "p (t / Wilcoxon / sign)" in table and "95 % CI [" in table
    assert {r["share_basis"] for r in record["rows"]} == {"calibrated"}


def test_group_labels_never_collide_and_a_repeated_baseline_seed_is_not_paired():
    from megaformer.experiments.seeds import group_label, seed_groups, seed_summary

    resolved = {
        "pre_ln_s1": _cfg("pre_ln", 1, "a"),
        "pre_ln_s2": _cfg("pre_ln", 2, "b"),
        "pre_ln": {**_cfg("pre_ln", 1, "c"), "train": {"seed": 1, "lr": 3e-3}},  # its name is the label
    }
    groups = seed_groups(resolved)
    assert sorted(n for m in groups.values() for n in m) == sorted(resolved)  # each run in one group
    assert groups["pre_ln#2"] == ["pre_ln_s1", "pre_ln_s2"] and groups["pre_ln"] == ["pre_ln"]
    assert group_label(["nf_s1234", "nf_s1235"]) == "nf"
    # A/A: the same config twice (same seed) is one group; no pair for its repeated seed
    rows = [_row("a", 5.0), _row("b", 5.1), _row("c", 5.2)]
    summary = seed_summary(
        rows, {"a": ["a", "b"], "c": ["c"]}, {"a": 1, "b": 1, "c": 1}, dict.fromkeys("abc", 1)
    )
    assert math.isclose(summary[0]["final_valid_loss_mean"], 5.05) and summary[1]["paired"] is None


def test_plot_survives_a_diverged_run(tmp_path):
    from megaformer.experiments import compare as cmp

    runs = {
        "base": {"curve": [(1, 0.5, 6.0), (2, 1.0, 5.0)]},
        "diverged": {"curve": [(1, 0.5, 800.0), (2, 1.0, float("nan"))]},
        "one_eval": {"curve": [(1, 1.0, 5.5)]},
    }
    cmp.plot(runs, str(tmp_path / "p.png"), 1.0)
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_noisy_calibration_is_said_in_the_table_the_json_and_the_plot(monkeypatch, tmp_path):
    """A calibration whose ratio error is above 1 % (the console warned) leaves a caveat above
    comparison.md's table, the warnings in comparison.json, and a red title on the plot."""
    import json

    from megaformer.experiments import calibrate as cal
    from megaformer.experiments import compare as cmp

    paths = ["configs/cpu-compare/pre_ln.yaml", "configs/cpu-compare/normformer.yaml"]
    names = ["pre_ln", "normformer"]
    timings = {
        "pre_ln": Timing(0.1, 0.5, 1.0, [], 0.001, "pre_ln", 1.0, 0.0),
        "normformer": Timing(0.1, 0.5, 1.0, [], 0.001, "normformer", 1.0, 0.19),  # ±19 %
    }
    monkeypatch.setattr(cal, "calibrate_runs", lambda *a, **k: (timings, {"rounds": []}, "c" * 16))
    final = {"pre_ln": 5.0, "normformer": 4.9}
    monkeypatch.setattr(
        cmp,
        "train_one",
        lambda config, out, *a: {**_summary(final[out.name], 1.0), "tensorboard_dir": out.name},
    )
    monkeypatch.setattr(cmp, "valid_curve", lambda tb: [(1, 0.5, final[tb] + 0.5), (2, 1.0, final[tb])])
    titles = []
    real_plot = cmp.plot
    monkeypatch.setattr(cmp, "plot", lambda *a, **k: titles.append(k.get("warning")) or real_plot(*a, **k))
    (tmp_path / "out").mkdir()
    cmp.compare(paths, names, BUDGET, str(tmp_path / "out"), [], nproc=2)
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert table.startswith("> **Caveat: the calibration was noisy** (1 warning(s))")
    assert "normformer: step time" in table and "± 19.0%" in table
    record = json.loads((tmp_path / "out" / "comparison.json").read_text())
    assert len(record["calibration_warnings"]) == 1 and titles == [1]
    assert (tmp_path / "out" / "valid_ppl_vs_device_hours.png").stat().st_size > 10_000


def test_a_refused_comparison_leaves_nothing_behind(tmp_path, capsys):
    """A bad override is refused (exit 2, naming it) and the output directory it would have
    written is not left behind (issue 39: compare left empty directories when it refused)."""
    from megaformer.experiments.compare import main

    out = tmp_path / "cmp"
    code = main(["configs/cpu-compare/pre_ln.yaml", "--budget-device-hours", "0.01", "--output-dir", str(out),
                 "--set", "train.nosuchkey=1"])  # fmt: skip
    assert code == 2 and "train.nosuchkey" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()  # a directory the user made is theirs: kept
    assert main(["configs/cpu-compare/pre_ln.yaml", "--budget-device-hours", "0.01", "--output-dir", str(out),
                 "--set", "train.nosuchkey=1"]) == 2  # fmt: skip
    assert out.is_dir()


def test_a_config_the_runs_would_refuse_is_refused_before_the_calibration(monkeypatch, tmp_path):
    """compare checks every config with what its runs get (train.final_eval_batches) first: the
    refusal came after minutes of calibration before."""
    import pytest

    from megaformer.config import ConfigError
    from megaformer.experiments import calibrate as cal
    from megaformer.experiments import compare as cmp

    calibrated = []
    monkeypatch.setattr(cal, "calibrate_runs", lambda *a, **k: calibrated.append(a) or ({}, {}, "c" * 16))
    with pytest.raises(ConfigError, match="final_eval_batches=-2"):
        cmp.compare(
            ["configs/cpu-compare/pre_ln.yaml"], ["pre_ln"], BUDGET, str(tmp_path / "out"),
            final_eval_batches=-2,
        )  # fmt: skip
    assert calibrated == []
