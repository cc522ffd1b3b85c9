"""The comparison's calibration (interleaved order, medians) and its rule for reusing finished runs.

The launches are replaced by stand-ins that write what a run writes (a ``summary.json``): the rules
under test are the experiment's, the training itself is covered by the launcher tests.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from megaformer.experiments import calibrate as cal
from megaformer.experiments import compare as cmp
from megaformer.experiments.calibrate import Timing, round_order
from megaformer.experiments.provenance import code_version, data_fingerprint, differences, resolved_config

CONFIG = "configs/cpu-compare/pre_ln.yaml"


@pytest.fixture
def dataset(tmp_path) -> str:
    prefix = tmp_path / "corpus_text_document"
    Path(f"{prefix}.bin").write_bytes(b"\0" * 64)
    Path(f"{prefix}.idx").write_bytes(b"MMIDIDX\0\0" + b"\1" * 32)
    return str(prefix)


def test_round_order_alternates_so_drift_hits_every_config_alike():
    assert [round_order(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]
    three = [round_order(["a", "b", "c"], r) for r in range(6)]
    for name in "abc":  # every config takes every position, each as often
        positions = [order.index(name) for order in three]
        assert sorted(positions) == [0, 0, 1, 1, 2, 2]


def test_calibration_takes_medians_over_interleaved_rounds(monkeypatch, tmp_path):
    """A machine that slows down round by round: each config's times come from all rounds, in
    alternating order, so the drift does not favour the one launched first."""
    launched: list[str] = []
    slow = {"a": 0.10, "b": 0.11}

    def fake_launch(config, out, args, nproc, tag):
        launched.append(out.name)
        (out / "checkpoints" / "global_step30").mkdir(parents=True)  # what a launch's final save leaves
        return {"name": out.name, "drift": 1.0 + 0.05 * (len(launched) - 1)}

    def fake_measure(summary, warmup):
        base = slow[summary["name"]] * summary["drift"]
        return [base] * 20, 0.5 * summary["drift"], 30 * base + 0.5 * summary["drift"] + 2.0

    monkeypatch.setattr(cal, "launch_run", fake_launch)
    monkeypatch.setattr(cal, "measure_launch", fake_measure)
    timings = cal.calibrate({"a": "a.yaml", "b": "b.yaml"}, [], tmp_path, 2, rounds=4, warmup=10, measure=20)
    assert launched == ["a", "b", "b", "a", "b", "a", "a", "b"]
    assert not list(tmp_path.glob("*/checkpoints"))  # timed, then thrown away: launches keep none
    ratio = timings["b"].step_seconds / timings["a"].step_seconds
    assert ratio == pytest.approx(1.1, rel=1e-9)  # a linear drift cancels: 1.1 exactly
    first_always = (0.11 * statistics.fmean([1.05, 1.15, 1.25, 1.35])) / (
        0.10 * statistics.fmean([1.0, 1.1, 1.2, 1.3])
    )
    assert first_always > 1.14  # what launching a first in every round would have measured
    assert [r["position"] for r in timings["a"].rounds] == [0, 1, 1, 0]
    assert timings["a"].fixed_seconds == pytest.approx(
        statistics.fmean(
            r["wall_seconds"] - 30 * timings["a"].step_seconds - timings["a"].eval_seconds
            for r in timings["a"].rounds
        )
    )
    with pytest.raises(ValueError, match="rounds >= 2"):
        cal.calibrate({"a": "a.yaml"}, [], tmp_path, 2, rounds=1)


def test_timing_overrides_give_the_launch_its_length_and_no_budget():
    args = cal.timing_overrides(10, 20)
    assert "train.steps=30" in args and "budget.device_hours=0" in args
    assert "train.eval_interval=30" in args and "train.resume=none" in args


def _fake_run(calls):
    def launch(config, out, args, nproc, tag):
        calls.append(args)
        summary = {"steps": 100, "final_valid_loss": 5.0}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    return launch


def test_a_finished_run_is_reused_only_for_the_same_request(monkeypatch, tmp_path, dataset, capsys):
    calls: list[list[str]] = []
    monkeypatch.setattr(cmp, "launch_run", _fake_run(calls))
    out, timing, code = tmp_path / "a", Timing(0.1, 0.5, 1.0, []), code_version()
    base = [f"data.prefix={dataset}"]

    def run(overrides, budget=0.04, t=timing, c=code):
        return cmp.train_one(CONFIG, out, budget, overrides, 2, t, c)

    run(base)
    assert len(calls) == 1 and "budget.step_seconds=0.1" in calls[0]
    run(base)
    assert len(calls) == 1 and "done before with the same request" in capsys.readouterr().out
    # the A/A rerun of the issue: another seed and learning rate must not reuse the old run
    run([*base, "train.seed=4321", "train.lr=1e-3"])
    said = capsys.readouterr().out
    assert (
        len(calls) == 2
        and "config.train.seed: 1234 -> 4321" in said
        and "config.train.lr: 0.003 -> 0.001" in said
    )
    run([*base, "train.seed=4321", "train.lr=1e-3"], budget=0.05)
    assert len(calls) == 3 and "budget_device_hours: 0.04 -> 0.05" in capsys.readouterr().out
    run([*base, "train.seed=4321", "train.lr=1e-3"], budget=0.05, t=Timing(0.12, 0.5, 1.0, []))
    assert len(calls) == 4  # another calibration: another step count
    run([*base, "train.seed=4321", "train.lr=1e-3"], budget=0.05, t=Timing(0.12, 0.5, 1.0, []), c="0" * 16)
    assert len(calls) == 5 and "code_version" in capsys.readouterr().out
    Path(f"{dataset}.idx").write_bytes(b"MMIDIDX\0\0" + b"\2" * 32)  # the corpus tokenised again
    run([*base, "train.seed=4321", "train.lr=1e-3"], budget=0.05, t=Timing(0.12, 0.5, 1.0, []), c="0" * 16)
    assert len(calls) == 6 and "idx_sha256" in capsys.readouterr().out


def test_a_run_that_failed_is_not_reused(monkeypatch, tmp_path, dataset):
    """request.json is written only after the launch returns: a summary without it is retrained."""
    calls: list[list[str]] = []
    monkeypatch.setattr(cmp, "launch_run", _fake_run(calls))
    out = tmp_path / "a"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"steps": 3}))
    cmp.train_one(CONFIG, out, 0.04, [f"data.prefix={dataset}"], 2, Timing(0.1, 0.5, 1.0, []), "x" * 16)
    assert len(calls) == 1 and (out / "request.json").is_file()


def test_provenance_names_what_differs(dataset):
    a = resolved_config(CONFIG, [f"data.prefix={dataset}"])
    b = resolved_config(CONFIG, [f"data.prefix={dataset}", "model.ffn_ln=true"])
    assert "output" not in a
    assert differences(a, b) == ["model.ffn_ln: False -> True"]
    fp = data_fingerprint(a)
    assert fp[dataset]["bin_bytes"] == 64 and len(fp[dataset]["idx_sha256"]) == 64
    assert data_fingerprint(resolved_config(CONFIG, ["data.prefix=/nonexistent/x"])) == {
        "/nonexistent/x": {"missing": True}
    }


def test_run_order_is_random_from_the_seed_and_recorded():
    names = ["pre_ln", "normformer", "post_ln", "deepnorm"]
    assert cmp.run_order(names, "given", 0) == names
    assert cmp.run_order(names, "random", 1) == cmp.run_order(names, "random", 1)
    assert {tuple(cmp.run_order(names, "random", s)) for s in range(10)} != {tuple(names)}


def test_runs_with_the_same_work_share_one_measurement(monkeypatch, tmp_path, dataset):
    """An A/A pair, or cells that differ in learning rate or seed, are timed once (the same cost,
    the same step count); a change of shape or scheme is timed separately."""
    from megaformer.experiments.calibrate import same_work_groups
    from megaformer.experiments.provenance import run_request

    base = [f"data.prefix={dataset}"]
    requests = {
        "a": run_request(CONFIG, base, {}, "c"),
        "b": run_request(CONFIG, base, {}, "c"),
        "lr": run_request(CONFIG, [*base, "train.lr=1e-3", "train.seed=7"], {}, "c"),
        "nf": run_request(CONFIG, [*base, "model.ffn_ln=true"], {}, "c"),
        "eval": run_request(CONFIG, [*base, "train.eval_batches=4"], {}, "c"),
    }
    groups = same_work_groups(requests)
    assert groups == {"a": "a", "b": "a", "lr": "a", "nf": "nf", "eval": "eval"}

    launched: list[str] = []

    def fake_launch(config, out, args, nproc, tag):
        launched.append(out.name)
        return {"name": out.name}

    monkeypatch.setattr(cal, "launch_run", fake_launch)
    monkeypatch.setattr(cal, "measure_launch", lambda summary, warmup: ([0.1] * 20, 0.5, 4.0))
    runs = dict.fromkeys(requests, CONFIG)
    timings = cal.calibrate(runs, [], tmp_path, 2, rounds=2, warmup=10, measure=20, same_work=groups)
    assert sorted(set(launched)) == ["a", "eval", "nf"] and len(launched) == 6
    assert timings["b"] is timings["a"] and timings["lr"].measured_as == "a"
    assert timings["nf"].measured_as == "nf" and timings["a"].step_seconds_sem == 0.0


def test_ratio_standard_error_is_zero_for_a_shared_measurement():
    a = Timing(0.10, 0.5, 1.0, [], 0.002, "a")
    b = Timing(0.11, 0.5, 1.0, [], 0.0011, "b")
    assert cmp._ratio_sem(a, a) == 0.0
    expected = 1.1 * ((0.0011 / 0.11) ** 2 + (0.002 / 0.10) ** 2) ** 0.5
    assert cmp._ratio_sem(b, a) == pytest.approx(expected)


def _machine(step: dict[str, float], launched: list[str]):
    """Stand-ins for a calibration launch on a machine whose step times are ``step`` (by run)."""

    def launch(config, out, args, nproc, tag):
        launched.append(out.name)
        return {"name": out.name}

    def measure(summary, warmup):
        t = step[summary["name"]]
        return [t] * 20, 0.5, 30 * t + 2.0

    return launch, measure


def test_a_reused_calibration_is_rechecked_on_this_machine(monkeypatch, tmp_path, dataset, capsys):
    """A comparison resumed on a machine 12 % slower than its calibration's keeps the step times it
    was calibrated with (the same step counts as its finished runs) and scales the spend limit by
    the re-measured factor, widened by the re-check's noise (3 %); the factor is not part of a run's
    request, so finished runs stay reused. Within the noise, or on a faster machine, nothing changes
    (the limit is only loosened); --recheck-rounds 0 trusts the saved calibration; 1 is refused."""
    runs = {"pre": CONFIG, "nf": "configs/cpu-compare/normformer.yaml"}
    base = [f"data.prefix={dataset}"]
    launched: list[str] = []
    settings = {"rounds": 2, "warmup": 10, "measure": 20}

    def calibrate_on(step: dict[str, float], recheck_rounds: int = 2):
        launch, measure = _machine(step, launched)
        monkeypatch.setattr(cal, "launch_run", launch)
        monkeypatch.setattr(cal, "measure_launch", measure)
        launched.clear()
        return cal.calibrate_runs(
            runs, base, tmp_path, 2, {**settings, "recheck_rounds": recheck_rounds}, "t"
        )[0]

    first = calibrate_on({"pre": 0.10, "nf": 0.11})
    assert len(launched) == 4 and first["pre"].machine_factor == 1.0
    later = calibrate_on({"pre": 0.112, "nf": 0.1232})  # another day, a slower machine
    assert len(launched) == 4, "the re-check times every config, interleaved"
    assert later["pre"].step_seconds == pytest.approx(0.10) and later["nf"].step_seconds == pytest.approx(
        0.11
    )
    widened = 1.12 * (1 + cal.RECHECK_TOLERANCE)
    assert later["pre"].machine_factor == pytest.approx(widened) and later[
        "nf"
    ].machine_factor == pytest.approx(widened)
    assert "1.120× the saved one" in capsys.readouterr().out
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["rechecks"][-1]["factor"] == pytest.approx(widened)
    assert saved["rechecks"][-1]["measured"] == pytest.approx(1.12)
    assert saved["rechecks"][-1]["ratios"] == {"nf": pytest.approx(1.12), "pre": pytest.approx(1.12)}

    calls: list[list[str]] = []
    monkeypatch.setattr(cmp, "launch_run", _fake_run(calls))
    out, code = tmp_path / "run", code_version()
    cmp.train_one(CONFIG, out, 0.04, base, 2, later["pre"], code)
    assert f"budget.machine_factor={widened:.6g}" in calls[0] and "budget.step_seconds=0.1" in calls[0]
    request = json.loads((out / "request.json").read_text())
    assert request["config"]["budget"]["machine_factor"] == 1.0  # the default: not what is asked
    cmp.train_one(CONFIG, out, 0.04, base, 2, first["pre"], code)  # back on the calibration's machine
    assert len(calls) == 1, "a run trained on a slower machine is the same run: reused"

    same = calibrate_on({"pre": 0.1025, "nf": 0.1125})  # 2.3 % slower: within the re-check's noise
    assert same["pre"].machine_factor == 1.0 and same["pre"].machine_overrides() == []
    assert "nothing changes" in capsys.readouterr().out
    faster = calibrate_on({"pre": 0.08, "nf": 0.088})  # a faster machine never tightens the limit
    assert faster["pre"].machine_factor == 1.0 and faster["nf"].machine_overrides() == []
    calibrate_on({"pre": 0.2, "nf": 0.2}, recheck_rounds=0)
    assert launched == [], "--recheck-rounds 0: the saved calibration is trusted"
    with pytest.raises(ValueError, match="--recheck-rounds 1: use 0"):
        calibrate_on({"pre": 0.1, "nf": 0.11}, recheck_rounds=1)


def test_a_recheck_warns_when_relative_costs_moved(capsys):
    saved = {"a": Timing(0.10, 0.5, 1.0, [], 0.0, "a"), "b": Timing(0.11, 0.5, 1.0, [], 0.0, "b")}
    now = {"a": Timing(0.10, 0.5, 1.0, [], 0.0, "a"), "b": Timing(0.121, 0.5, 1.0, [], 0.0, "b")}
    factor, record = cal.recheck(saved, now, "t")
    assert record["measured"] == pytest.approx(1.05) and record["ratios"]["b"] == pytest.approx(1.1)
    assert factor == pytest.approx(1.05 * (1 + cal.RECHECK_TOLERANCE))
    assert "WARNING the configs' speeds changed by different factors" in capsys.readouterr().out


def test_a_disturbed_round_is_left_out_for_every_config_and_said(monkeypatch, tmp_path, capsys):
    """One launch at 3.5× its config's speed (seen on a shared VM: a whole 30-step launch): the
    mean of the rounds would give that config 60 % more seconds per step and 40 % fewer steps.
    Its round is left out for every config (keeping the others' rounds balanced), and said."""
    launched: list[tuple[str, int]] = []
    step = {"a": 1.00, "b": 1.05}

    def fake_launch(config, out, args, nproc, tag):
        r = len(launched) // 2
        launched.append((out.name, r))
        return {"name": out.name, "slow": 3.5 if (out.name, r) == ("b", 3) else 1.0 + 0.01 * r}

    def fake_measure(summary, warmup):
        base = step[summary["name"]] * summary["slow"]
        return [base] * 20, 0.5, 30 * base + 2.5

    monkeypatch.setattr(cal, "launch_run", fake_launch)
    monkeypatch.setattr(cal, "measure_launch", fake_measure)
    timings = cal.calibrate({"a": "a.yaml", "b": "b.yaml"}, [], tmp_path, 2, rounds=4, warmup=10, measure=20)
    assert timings["b"].step_seconds / timings["a"].step_seconds == pytest.approx(1.05, rel=1e-9)
    assert [x["anomalous_round"] for x in timings["a"].rounds] == [False, False, False, True]
    assert len(timings["b"].rounds) == 4  # all launches stay on record
    said = capsys.readouterr().out
    assert "b's launch in round 4 ran 3.68 s per step, 3.45× off its median" in said


def test_a_noisy_calibration_warns_with_its_standard_error(monkeypatch, tmp_path, capsys):
    """Launches of one config that spread ±6 % (this VM on 2026-11-26): the calibration says that
    the step counts can be tilted by its standard error, and how to shrink it."""
    spread = {"a": iter([1.0, 1.0, 1.0, 1.0]), "b": iter([1.12, 0.94, 1.06, 1.0])}

    monkeypatch.setattr(cal, "launch_run", lambda config, out, args, nproc, tag: {"name": out.name})
    monkeypatch.setattr(
        cal, "measure_launch", lambda summary, warmup: ([next(spread[summary["name"]])] * 20, 0.5, 33.0)
    )
    cal.calibrate({"a": "a.yaml", "b": "b.yaml"}, [], tmp_path, 2, rounds=4, warmup=10, measure=20)
    said = capsys.readouterr().out
    assert "WARNING b: step time" in said and "more --calibration-rounds" in said
    assert "WARNING a:" not in said  # a's launches agree
