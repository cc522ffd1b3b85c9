"""The step-interleaved calibration: every config stepped in one job, turn by turn, so that a machine
whose speed changes from one second to the next cannot tilt the ratio of their step times.

The job itself runs in ``tests/distributed/test_compare_launch.py``; here its turns are stood in
for, and what the calibration makes of them is checked."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from megaformer.experiments import calibrate as cal
from megaformer.experiments import step_timing
from megaformer.experiments.calibrate import Timing


def _turns(step: dict[str, float], rounds: int, level, per_step: int = 1) -> list[dict]:
    """What the job writes: turn by turn in the calibration's order, each step at the config's cost
    times the machine's level at that moment."""
    names, turns, i = list(step), [], 0
    for r in range(rounds):
        for position, name in enumerate(cal.round_order(names, r)):
            seconds = []
            for _ in range(per_step):
                seconds.append(step[name] * level(i))
                i += 1
            turns.append({"round": r, "position": position, "name": name, "step_seconds": seconds})
    return turns


def test_a_machine_that_changes_speed_every_round_does_not_tilt_the_ratio():
    """The level jumps ±20 % from round to round (this VM: single steps spread ±11 %, adjacent
    30-step launches 10-25 %) but holds within a round: the per-round ratios are exact, so the
    ratio is exact and its standard error 0, while the level's own error is large."""
    rng = random.Random(0)
    levels = [rng.uniform(0.8, 1.2) for _ in range(40)]
    step = {"pre": 1.00, "nf": 1.03, "post": 0.99}
    out = cal.summarize_turns(_turns(step, 40, lambda i: levels[i // 3]), list(step))
    for name, cost in step.items():
        assert out[name]["ratio"] == pytest.approx(cost, rel=1e-12)
        assert out[name]["rounds_kept"] == 40 and out[name]["steps"] == 40
    assert out["nf"]["ratio_sem"] == pytest.approx(0.0, abs=1e-12)
    assert out["pre"]["sem"] / out["pre"]["step_seconds"] > 0.01  # the level is noisy; the ratio is not
    mean_level = sum(levels) / 40
    assert out["nf"]["step_seconds"] == pytest.approx(1.03 * mean_level, rel=1e-12)


def test_per_step_noise_gives_the_ratio_its_standard_error():
    """Independent ±10 % noise on every step: the ratio comes out within a few standard errors of
    the truth, and the standard error is what 1/sqrt(rounds) says."""
    rng = random.Random(1)
    step = {"pre": 1.0, "nf": 1.02}
    out = cal.summarize_turns(_turns(step, 400, lambda i: rng.gauss(1.0, 0.1)), list(step))
    sem = out["nf"]["ratio_sem"]
    assert 0.1 * 2**0.5 / 20 * 0.8 < sem < 0.1 * 2**0.5 / 20 * 1.2  # ~sqrt(2) * 10 % / sqrt(400)
    assert abs(out["nf"]["ratio"] - 1.02) < 4 * sem


def test_a_disturbed_turn_drops_its_round_for_every_config(capsys):
    step = {"a": 1.0, "b": 1.1}
    turns = _turns(step, 6, lambda i: 1.0)
    turns[7]["step_seconds"] = [turns[7]["step_seconds"][0] * 3.5]  # round 4's second turn
    out = cal.summarize_turns(turns, ["a", "b"])
    assert out["b"]["ratio"] == pytest.approx(1.1, rel=1e-12) and out["a"]["rounds_kept"] == 5
    said = capsys.readouterr().out
    assert f"{turns[7]['name']}'s turn in round 4 ran" in said and "left out for every config" in said


def test_the_job_replaces_the_launches_step_times_and_keeps_theirs_on_record(monkeypatch, tmp_path, capsys):
    """calibrate(..., interleaved_rounds=N): evaluation and one-time seconds from the launches; the
    step times from the job; the launches' own step time and level stay in the record; the noise
    warning looks at the measured ratio's error, not at the level's (common to every config)."""
    launch_step = {"a": 1.00, "b": 0.90}  # launches that got the order wrong (noise)
    monkeypatch.setattr(cal, "launch_run", lambda config, out, args, nproc, tag: {"name": out.name})
    monkeypatch.setattr(
        cal,
        "measure_launch",
        lambda summary, warmup: ([launch_step[summary["name"]]] * 20, 0.5, 40.0),
    )
    jobs = []

    rng = random.Random(2)
    levels = [rng.uniform(0.8, 1.2) for _ in range(10)]

    def fake_job(module, spec, log, nproc):
        jobs.append(json.loads(spec.read_text()))
        turns = _turns({"a": 1.0, "b": 1.04}, 10, lambda i: levels[i // 2])
        (spec.parent / "turns.json").write_text(json.dumps({"turns": turns}))

    monkeypatch.setattr("megaformer.experiments.launcher.launch_module", fake_job)
    runs = {"a": "a.yaml", "b": "b.yaml"}
    timings = cal.calibrate(runs, ["data.prefix=x"], tmp_path, 2, 2, 10, 20, interleaved_rounds=10)
    assert timings["b"].step_seconds / timings["a"].step_seconds == pytest.approx(1.04, rel=1e-12)
    mean_level = sum(levels) / 10  # the job's level: its mean step, over every round
    assert timings["a"].step_seconds == pytest.approx(1.00 * mean_level, rel=1e-12)
    assert timings["a"].step_seconds_sem > 0
    assert timings["b"].interleaved["launch_step_seconds"] == pytest.approx(0.90)
    launch_level = (1.00 / 1.0 + 0.90 / 1.04) / 2  # the launches', pooled over both configs
    assert timings["b"].interleaved["launch_level"] == pytest.approx(1.04 * launch_level)
    assert timings["b"].interleaved["ratio"] == pytest.approx(1.04)
    assert timings["b"].ratio_sem == pytest.approx(0.0, abs=1e-12)
    # evaluation and one-time seconds from the launches, pooled over both configs in units of a's
    # step (each launch's divided by its config's ratio), then times each config's ratio
    eval_level = (0.5 / 1.0 + 0.5 / 1.04) / 2
    fixed_level = ((40.0 - 30 * 1.00 - 0.5) / 1.0 + (40.0 - 30 * 0.90 - 0.5) / 1.04) / 2
    assert timings["a"].eval_seconds == pytest.approx(eval_level)
    assert timings["b"].eval_seconds == pytest.approx(1.04 * eval_level)
    assert timings["a"].fixed_seconds == pytest.approx(fixed_level)
    assert timings["b"].fixed_seconds == pytest.approx(1.04 * fixed_level)
    assert timings["b"].interleaved["launch_eval_seconds"] == 0.5
    (spec,) = jobs
    assert spec["rounds"] == 10 and spec["steps_per_turn"] == 1 and list(spec["runs"]) == ["a", "b"]
    assert "data.prefix=x" in spec["runs"]["a"]["overrides"]
    assert "train.steps=20" in spec["runs"]["a"]["overrides"]  # warm-up 10 + 10 rounds x 1 step
    said = capsys.readouterr().out
    assert "ratio to" not in said  # the level spreads ±20 %; the ratio is exact: no noise warning
    assert "WARNING the launches' step time" in said  # 0.93 s against the job's ~1.0 s: said


def test_warn_if_noisy_uses_the_paired_ratio_error(capsys):
    base = Timing(1.0, 0.5, 1.0, [], 0.05, "a", interleaved={"rounds_kept": 60})
    quiet = Timing(1.01, 0.5, 1.0, [], 0.05, "b", ratio_sem=0.004, interleaved={"rounds_kept": 60})
    noisy = Timing(1.01, 0.5, 1.0, [], 0.001, "c", ratio_sem=0.018, interleaved={"rounds_kept": 60})
    cal.warn_if_noisy({"a": base, "b": quiet, "c": noisy}, ["a", "b", "c"], "t")
    said = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(said) == 1 and "WARNING c:" in said[0] and "ratio to a ± 1.8%" in said[0]
    assert "over 60 rounds" in said[0] and "--interleaved-rounds" in said[0]


def test_a_saved_calibration_without_the_option_stays_reusable_and_with_it_is_not(monkeypatch, tmp_path):
    """The request of a calibration gains the job's settings only when the job runs: calibrations
    saved before the option are reused as before; asking for the job measures again."""
    monkeypatch.setattr(cal, "launch_run", lambda config, out, args, nproc, tag: {"name": out.name})
    monkeypatch.setattr(cal, "measure_launch", lambda summary, warmup: ([1.0] * 20, 0.5, 40.0))
    monkeypatch.setattr(
        "megaformer.experiments.launcher.launch_module",
        lambda module, spec, log, nproc: (spec.parent / "turns.json").write_text(
            json.dumps({"turns": _turns({"a": 1.0, "b": 1.0}, 4, lambda i: 1.0)})
        ),
    )
    runs = {"a": "a.yaml", "b": "b.yaml"}
    requests = {"a": {"config": {"model": {"x": 1}}}, "b": {"config": {"model": {"x": 2}}}}

    def load(interleaved=(0, 1)):
        return cal.load_or_calibrate(
            runs, requests, [], tmp_path, 2, 2, 10, 20, "t", recheck_rounds=0, interleaved=interleaved
        )

    load()
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert "interleaved_rounds" not in saved["request"]
    assert load()["a"].interleaved == {}  # reused
    assert load((4, 1))["a"].interleaved["rounds_kept"] == 4  # measured again, with the job
    assert json.loads((tmp_path / "calibration.json").read_text())["request"]["interleaved_rounds"] == 4


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"interleaved_rounds": 1}, "--interleaved-rounds 1"),
        ({"interleaved_rounds": 4, "steps_per_turn": 0}, "0 rounds"),
    ],
)
def test_bad_interleaving_settings_are_refused_before_anything_runs(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        cal.calibrate_runs({"a": "configs/cpu-compare/pre_ln.yaml"}, [], tmp_path, 2, settings, "t")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            {"runs": {"a": {}}, "warmup_steps": 1, "rounds": 2, "steps_per_turn": 1, "output": "o"},
            "two or more",
        ),
        (
            {"runs": {"a": {}, "b": {}}, "warmup_steps": 1, "rounds": 1, "steps_per_turn": 1, "output": "o"},
            "'rounds'",
        ),
        ({"runs": {"a": {}, "b": {}}, "rounds": 2}, "exactly the keys"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_file_and_key(tmp_path, spec, match):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match) as e:
        step_timing.read_spec(str(path))
    assert str(path) in str(e.value)


def test_noisy_evaluation_samples_do_not_tilt_the_step_counts():
    """One launch's evaluation is one sample: on 2026-11-26 three of them gave NormFormer 8.43 s and
    Pre-LN 6.60 s, and its run 1,064 steps to Pre-LN's 1,091 where the step-time ratio (1.008) alone
    gives 1.6 % more. Pooled over the configs, the decided lengths follow the step-time ratio."""
    from megaformer.training.budget import steps_for_budget

    def launches(evals: list[float], walls: list[float], step: float) -> list[dict]:
        return [
            {"round": r, "median_step_seconds": step, "eval_seconds": e, "wall_seconds": w, "steps": 40}
            for r, (e, w) in enumerate(zip(evals, walls))
        ]

    base = Timing(1.037, 6.60, 1.6, launches([6.1, 7.0, 6.7], [50.0, 50.0, 50.0], 1.037), 0.04, "pre")
    other = Timing(1.046, 8.43, 0.0, launches([9.9, 7.4, 8.0], [48.0, 52.0, 49.0], 1.046), 0.04, "nf")
    measured = {
        n: {
            "ratio": r,
            "step_seconds": 0.94 * r,
            "sem": 0.01,
            "ratio_sem": 0.008,
            "rounds_kept": 238,
            "steps": 238,
        }
        for n, r in (("pre", 1.0), ("nf", 1.008))
    }
    out = cal.with_interleaved({"pre": base, "nf": other}, measured, "t")

    def steps(t: Timing) -> int:
        return steps_for_budget(
            seconds_left=1206.0 - t.fixed_seconds, done=0, step_seconds=t.step_seconds,
            eval_seconds=t.eval_seconds, eval_interval=100, max_steps=10**6,
        )  # fmt: skip

    assert out["nf"].eval_seconds / out["pre"].eval_seconds == pytest.approx(1.008)
    assert steps(out["pre"]) / steps(out["nf"]) == pytest.approx(1.008, abs=0.002)
    unpooled = {
        n: dataclasses.replace(out[n], eval_seconds=t.eval_seconds) for n, t in (("pre", base), ("nf", other))
    }
    assert steps(unpooled["pre"]) / steps(unpooled["nf"]) > 1.02  # what the launches' own gave


def test_the_table_reports_the_paired_ratio_error_of_the_job():
    """The comparison table's "step time vs baseline" error: the job's paired ratio error, not the
    step times' own errors (which hold the machine's level, common to every config: ±5 % where the
    pairs measured ±0.8 % in the final CPU comparison)."""
    from megaformer.experiments import compare as cmp

    base = Timing(1.037, 7.0, 1.0, [], 0.0386, "pre", ratio_sem=0.0, interleaved={"ratio": 1.0})
    nf = Timing(1.046, 7.0, 1.0, [], 0.0390, "nf", ratio_sem=0.0077, interleaved={"ratio": 1.008})
    assert cmp._ratio_sem(nf, base) == pytest.approx(1.046 / 1.037 * 0.0077)
    launches = Timing(1.046, 7.0, 1.0, [], 0.0390, "nf")  # launch-timed: the propagated errors
    assert cmp._ratio_sem(launches, base) > 0.05


@pytest.mark.parametrize("interleaved", [240, 0])
def test_an_a_a_pair_timed_separately_gets_step_counts_within_one_percent(monkeypatch, tmp_path, interleaved):
    """The A/A check that grouping cannot make equal by construction: the same config under two
    names, each timed itself (no same-work grouping: ``same_work`` unset), on a machine whose
    level wanders ±20 % from round to round with ±10 % noise on every step, and whose 30-step
    launches disagree by 10 %. With the step-interleaved job (240 rounds, as the final runs had)
    the two decided step counts agree within 1 %, and the ratio's standard error, reported beside
    it, is below 1 %; from the launches alone they do not (the check can fail)."""
    from megaformer.training.budget import steps_for_budget

    monkeypatch.setattr(cal, "launch_run", lambda config, out, args, nproc, tag: {"name": out.name})
    rounds_seen: dict[str, int] = {}

    def launch(summary, warmup):  # a and b alternate being the slow one, 10 % apart
        k = rounds_seen[summary["name"]] = rounds_seen.get(summary["name"], 0) + 1
        slow = (k + (summary["name"] == "b")) % 2
        return [1.0 * (1.1 if slow else 1.0)] * 20, 6.6, 40.0

    monkeypatch.setattr(cal, "measure_launch", launch)
    rng = random.Random(3)
    levels = [rng.uniform(0.8, 1.2) for _ in range(interleaved + 1)]

    def job(module, spec, log, nproc):
        turns = _turns({"a": 1.0, "b": 1.0}, interleaved, lambda i: levels[i // 2] * rng.gauss(1.0, 0.1))
        (spec.parent / "turns.json").write_text(json.dumps({"turns": turns}))

    monkeypatch.setattr("megaformer.experiments.launcher.launch_module", job)
    runs = {"a": "a.yaml", "b": "b.yaml"}
    timings = cal.calibrate(runs, [], tmp_path, 2, 3, 10, 20, interleaved_rounds=interleaved)
    assert timings["a"] is not timings["b"] and timings["b"].measured_as == "b"  # timed separately

    def steps(t: Timing) -> int:
        return steps_for_budget(
            seconds_left=1206.0 - t.fixed_seconds, done=0, step_seconds=t.step_seconds,
            eval_seconds=t.eval_seconds, eval_interval=100, max_steps=10**6,
        )  # fmt: skip

    apart = abs(steps(timings["a"]) / steps(timings["b"]) - 1)
    if interleaved:
        assert apart < 0.01 and 0 < timings["b"].ratio_sem < 0.01
        assert abs(timings["b"].interleaved["ratio"] - 1) < 3 * timings["b"].ratio_sem
    else:
        assert apart > 0.01  # launches alone: one config's slow launches decide its length
