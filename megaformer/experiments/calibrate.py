"""Step times of the configs of a comparison, measured together so that noise cannot tilt them.

A compute-matched comparison gives each config the number of steps its step time fits into the
budget. If every run timed itself in its own window (the trainer's uncalibrated budget mode), the
machine's drift between the windows would decide part of the step counts: on the 2-core project
machine, one config compared with itself got 90 and 80 steps. Here all configs are timed in one
calibration, interleaved:

* configs that do the same work per step (they differ only in the learning rate, seed,
  initialisation and other :data:`COMPUTE_NEUTRAL` keys; an A/A comparison, the cells of a sweep)
  are timed once and share the result: the same cost gets the same step count, not two noisy
  readings of it;
* ``rounds`` rounds; in each, every config is launched once through ``launch/pretrain.sh`` (the
  users' path, the same engine, loader and layout as the real run) for ``warmup + measure`` steps
  and one evaluation, no budget, no checkpoint but the final one;
* the order alternates, round by round (A B, B A, A B, ...; for more configs, rotated and
  alternated), so that a drift of the machine during the calibration hits every config alike
  (to first order: a linear drift cancels over two rounds);
* the first ``warmup`` steps of each launch are discarded (allocator, kernel selection, autotuning,
  compilation, the loader's start); each launch's step time is the median of its measured steps
  (robust to the stragglers of a shared machine), and a config's step time is the mean of its
  launches' (with the alternating order, a linear drift adds as much to every config's mean); a
  round in which some launch ran :data:`ANOMALY_FACTOR` × off its config's median (a disturbed
  machine: seen, a whole launch at 3.5× on a shared VM) is left out for every config, and a
  warning names it; another warns when a step time's standard error is above 1 %; its
  evaluation time the mean of its launches' evaluations, and its one-time cost (the warm-up steps
  beyond the step time, the loop's start, the final checkpoint) the mean of each launch's loop
  wall-clock minus its steps and evaluation at those times.

With ``interleaved_rounds`` > 0, the step times' ratios come instead from one job that steps every
config in the same processes, turn by turn (:func:`interleaved_step_times`,
:mod:`megaformer.experiments.step_timing`): on a shared VM whose speed changes from one launch to
the next by 10-25 %, launch-by-launch interleaving cannot resolve a few percent. The launches then
give the evaluation and one-time seconds pooled over every config (:func:`pooled_launch_costs`).

Each config's step time comes with its standard error over the launches, and the comparison
reports it: on the 2-core project machine with one more core's worth of load, launches of one
config spread by about ±2% (``bench/results/budget_fairness*.json``), so two different configs'
relative cost is known to about ±1.5% after 4 rounds.

The run is then given these times (``budget.step_seconds`` / ``budget_eval_seconds`` /
``budget_fixed_seconds``) and fixes its length from them before its first step
(:mod:`megaformer.training.budget`). The calibration costs ``rounds × len(configs)`` short launches
(on the project machine about 15 s each); it is not charged to any run's budget.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_tools.files import atomic_write_json
from megaformer.experiments import launcher
from megaformer.experiments.launcher import launch_run
from megaformer.experiments.provenance import code_version, differences, run_request
from megaformer.experiments.scalars import read_tb_dir


@dataclass
class Timing:
    """A config's calibrated times (seconds of the job's wall-clock).

    Attributes:
        step_seconds: mean over the launches of each launch's median step after the warm-up (rounds
            left out as anomalous, :func:`anomalous_rounds`, excluded; ``rounds`` keeps them,
            marked ``anomalous_round``).
        eval_seconds: mean evaluation (``train.eval_batches`` batches) over the launches.
        fixed_seconds: mean one-time cost of a run (see the module docstring); >= 0.
        rounds: per launch: round, position in the round's order, its median step, evaluation
            and one-time seconds.
        step_seconds_sem: standard error of ``step_seconds`` (the launches' spread / sqrt(n)): how
            well the calibration knows this config's cost on this machine.
        measured_as: the run whose launches measured these times (a run with the same work, see
            :func:`compute_key`), or the run itself.
        machine_factor: the spend-limit factor :func:`recheck` gives this machine when the
            calibration is reused and the machine is slower than the calibration's (1: not).
        ratio_sem: standard error of ``step_seconds`` / the first config's, measured directly
            from paired turns when the step times come from the step-interleaved job
            (:func:`interleaved_step_times`); -1: not measured (the launches' errors combine).
        interleaved: the step-interleaved job's record for this config (empty without one):
            ``rounds_kept``, ``steps``, ``ratio``, ``launch_step_seconds`` (the launches' own
            mean, which the job's replaced) and ``launch_level`` (the launches' level pooled over
            every config, times this config's ratio; :func:`with_interleaved`).
    """

    step_seconds: float
    eval_seconds: float
    fixed_seconds: float
    rounds: list[dict[str, Any]]
    step_seconds_sem: float = 0.0
    measured_as: str = ""
    machine_factor: float = 1.0
    ratio_sem: float = -1.0
    interleaved: dict[str, Any] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        """The trainer overrides that hand these times to a budget run (part of its request)."""
        return [
            f"budget.step_seconds={self.step_seconds:.6g}",
            f"budget.eval_seconds={self.eval_seconds:.6g}",
            f"budget.fixed_seconds={self.fixed_seconds:.6g}",
        ]

    def machine_overrides(self) -> list[str]:
        """What the launch adds for this machine (:func:`recheck`): not part of the run's request,
        since it describes where the run trains, not what it trains."""
        return [] if self.machine_factor == 1.0 else [f"budget.machine_factor={self.machine_factor:.6g}"]


COMPUTE_NEUTRAL = frozenset(
    {
        "train.seed",
        "data.split_seed",
        "train.lr",
        "train.min_lr",
        "train.warmup_steps",
        "train.lr_decay",
        "train.lr_ramp",
        "train.adam_beta1",
        "train.adam_beta2",
        "train.adam_eps",
        "train.weight_decay",
        "train.weight_decay_params",
        "train.steps",
        "train.resume",
        "train.init_from",
        "train.extend_steps",
        "train.trust_checkpoint_code",
        "train.keep_last_checkpoints",
        "train.exit_signals",
        "train.exit_duration_mins",
        "budget.device_hours",
        "budget.measure_steps",
        "budget.step_seconds",
        "budget.eval_seconds",
        "budget.fixed_seconds",
        "budget.overrun",
        "budget.machine_factor",
        "model.init",
        "model.init_std",
        "model.embedding_init_std",
        "data.index_cache_dir",
    }
)
"""Config keys that change what a step computes with, never how much: runs that differ only in
these do the same work per step, and share one calibration (the same step count at the same
budget, by construction, instead of two noisy measurements of one cost). The learning rate, seed
and initialisation are here; anything that changes shapes, kernels, precision, layout, dropout,
evaluation size or the host work of a step (checkpoint cadence, diagnostics, the divergence check)
is not."""


def compute_key(resolved: dict[str, Any]) -> str:
    """The resolved config without :data:`COMPUTE_NEUTRAL` keys, as canonical JSON: equal keys mean
    equal work per step."""
    kept = {
        section: {k: v for k, v in values.items() if f"{section}.{k}" not in COMPUTE_NEUTRAL}
        for section, values in resolved.items()
        if isinstance(values, dict)
    }
    return json.dumps(kept, sort_keys=True)


def same_work_groups(requests: dict[str, dict]) -> dict[str, str]:
    """``{run: the first run with the same work}`` (:func:`compute_key` of each request's config)."""
    first: dict[str, str] = {}
    out = {}
    for name, request in requests.items():
        out[name] = first.setdefault(compute_key(request["config"]), name)
    return out


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s launch order: rotated by ``r // 2`` and reversed on odd rounds (A B, B A, ...)."""
    k = (r // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if r % 2 else order


def _scalars(tb_dir: str, tag: str) -> dict[int, float]:
    """``{step: value}`` of one tag of a run's TensorBoard events, or of its ``scalars.json.gz``."""
    scalars = read_tb_dir(tb_dir)
    if tag not in scalars:
        raise ValueError(f"{tb_dir}: no '{tag}' scalars; was it written by megaformer.train?")
    return dict(scalars[tag])


def timing_overrides(warmup: int, measure: int) -> list[str]:
    """What a calibration launch sets on top of the run's own overrides: its length, one
    evaluation at the end, no budget, no intermediate checkpoint, a fresh start."""
    steps = warmup + measure
    return [
        f"train.steps={steps}",
        f"train.warmup_steps={steps}",  # within the run's length; the rate does not change the speed
        f"train.eval_interval={steps}",
        f"train.log_interval={steps}",
        "train.save_interval=0",
        "budget.device_hours=0",
        "budget.step_seconds=0",
        "train.resume=none",
        "train.init_from=",
        "output.overwrite=true",
    ]


def measure_launch(summary: dict, warmup: int) -> tuple[list[float], float, float]:
    """``(measured step times, evaluation seconds, loop wall-clock seconds)`` of one calibration
    launch, from its TensorBoard events and summary."""
    tb = summary["tensorboard_dir"]
    times = _scalars(tb, "train/step_time_s")
    steps = sorted(times)
    measured = [times[s] for s in steps if s > warmup]
    evals = _scalars(tb, "valid/seconds")
    wall = summary["device_hours"] * 3600.0 / summary["world_size"]
    return measured, evals[max(evals)], wall


def interleaved_step_times(
    runs: dict[str, str],
    overrides: list[str],
    out_dir: Path,
    nproc: int,
    warmup: int,
    rounds: int,
    steps_per_turn: int = 1,
    tag: str = "calibrate",
) -> dict[str, dict[str, Any]]:
    """Every config of ``runs`` (name -> YAML; two or more, the first the reference) stepped in one
    job, interleaved every ``steps_per_turn`` steps (:mod:`megaformer.experiments.step_timing`,
    through ``launch/pretrain.sh``); see :func:`summarize_turns` for what is returned.

    On the 2-core project VM on 2026-11-26, where single steps spread ±11 % and 6 rounds of
    launches left the ratio of two configs' step times uncertain by ±5-6 %, 60 rounds of single
    steps (6 minutes, 5 configs) gave ±1.6-1.9 %; the error falls as 1/sqrt(rounds).

    Raises:
        RuntimeError: the job failed; names its log.
    """

    out_dir.mkdir(parents=True, exist_ok=True)
    fixed = timing_overrides(warmup, rounds * steps_per_turn)
    spec = {
        "runs": {
            n: {"config": c, "overrides": [*overrides, *fixed, f"output.dir={out_dir / n}"]}
            for n, c in runs.items()
        },
        "warmup_steps": warmup,
        "rounds": rounds,
        "steps_per_turn": steps_per_turn,
        "output": str(out_dir / "turns.json"),
    }
    atomic_write_json(out_dir / "spec.json", spec)
    print(f"[{tag}] calibration: {len(runs)} configs in one job, {rounds} rounds of {steps_per_turn} step(s) "
          f"each, interleaved (log: {out_dir / 'step_timing.log'})", flush=True)  # fmt: skip
    launcher.launch_module(
        "megaformer.experiments.step_timing", out_dir / "spec.json", out_dir / "step_timing.log", nproc
    )
    return summarize_turns(json.loads((out_dir / "turns.json").read_text())["turns"], list(runs), tag)


def summarize_turns(turns: list[dict[str, Any]], names: list[str], tag: str = "calibrate") -> dict[str, dict]:
    """Each config's step time and its ratio to ``names[0]``'s, from the step-interleaved job's turns.

    A turn's value is the mean of its steps. Rounds in which a turn ran :data:`ANOMALY_FACTOR` ×
    off its config's median are left out for every config (:func:`anomalous_rounds`). A config's
    step time is the mean of its turns over the kept rounds (the spend is a sum of steps: the mean,
    not the median, predicts it), with its standard error; its ratio is that mean over the
    reference's, with the standard error of the per-round ratios (paired: the turns of one round
    are seconds apart, so the machine's level cancels in them).

    Returns:
        ``{name: {"step_seconds", "sem", "ratio", "ratio_sem", "rounds_kept", "steps"}}``.
    """
    per: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for turn in turns:
        per[turn["name"]].append(
            {"round": turn["round"], "median_step_seconds": statistics.fmean(turn["step_seconds"])}
        )
    dropped = anomalous_rounds(per, tag, what="turn")
    value = {
        n: {x["round"]: x["median_step_seconds"] for x in per[n] if x["round"] not in dropped} for n in names
    }
    kept = sorted(value[names[0]])
    ref = statistics.fmean(value[names[0]][r] for r in kept)
    out = {}
    for n in names:
        times = [value[n][r] for r in kept]
        ratios = [value[n][r] / value[names[0]][r] for r in kept]
        mean = statistics.fmean(times)
        out[n] = {
            "step_seconds": mean,
            "sem": statistics.stdev(times) / math.sqrt(len(kept)),
            "ratio": mean / ref,
            "ratio_sem": 0.0 if n == names[0] else statistics.stdev(ratios) / math.sqrt(len(kept)),
            "rounds_kept": len(kept),
            "steps": sum(len(t["step_seconds"]) for t in turns if t["name"] == n and t["round"] in kept),
        }
    return out


def calibrate(
    runs: dict[str, str],
    overrides: list[str],
    out_dir: Path,
    nproc: int,
    rounds: int = 4,
    warmup: int = 10,
    measure: int = 20,
    tag: str = "calibrate",
    same_work: dict[str, str] | None = None,
    interleaved_rounds: int = 0,
    steps_per_turn: int = 1,
) -> dict[str, Timing]:
    """Time every config of ``runs`` (name -> YAML path) interleaved; see the module docstring.

    Args:
        runs: the configs, by run name.
        overrides: ``section.key=value`` items of every run (data, seed, ...), applied before the
            calibration's own (:func:`timing_overrides`).
        out_dir: launches write under ``out_dir/<name>`` (overwritten every round).
        nproc: processes per launch (the runs' own).
        rounds: rounds (at least 2, so that the order alternates).
        warmup: steps discarded at the start of each launch.
        measure: steps timed per launch.
        same_work: ``{run: the run that measures for it}`` (:func:`same_work_groups`): only the
            measuring runs are launched; the others get their times. None: every run measures.
        interleaved_rounds: > 0 (and two or more measuring runs): the step times then come from
            one job that steps every config interleaved, ``steps_per_turn`` steps per turn, this
            many rounds (:func:`interleaved_step_times`; far less noisy on a shared machine); the
            launches still give the evaluation and one-time seconds, pooled over the configs.

    Raises:
        ValueError: ``rounds < 2``, ``warmup < 1`` or ``measure < 3``.
        RuntimeError: a launch failed (names the config and its log).
    """
    if rounds < 2 or warmup < 1 or measure < 3:
        raise ValueError(
            f"calibration rounds={rounds}, warmup={warmup}, measure={measure}: need rounds >= 2 (the "
            "order alternates), warmup >= 1 and measure >= 3"
        )
    same_work = same_work or {n: n for n in runs}
    names = [n for n in runs if same_work[n] == n]
    per_launch: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        for position, name in enumerate(round_order(names, r)):
            out = out_dir / name
            args = [*overrides, *timing_overrides(warmup, measure), f"output.dir={out}"]
            print(f"[{tag}] round {r + 1}/{rounds}: {name}", flush=True)
            summary = launch_run(runs[name], out, args, nproc, tag)
            measured, eval_s, wall = measure_launch(summary, warmup)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # its save was timed; keep no copy
            per_launch[name].append(
                {
                    "round": r,
                    "position": position,
                    "median_step_seconds": statistics.median(measured),
                    "eval_seconds": eval_s,
                    "wall_seconds": wall,
                    "steps": warmup + measure,
                }
            )
    dropped = anomalous_rounds(per_launch, tag)
    timings = {}
    for name in names:
        for x in per_launch[name]:
            x["anomalous_round"] = x["round"] in dropped
        launches = [x for x in per_launch[name] if x["round"] not in dropped]
        step_s = statistics.fmean(x["median_step_seconds"] for x in launches)
        eval_s = statistics.fmean(x["eval_seconds"] for x in launches)
        fixed = statistics.fmean(x["wall_seconds"] - x["steps"] * step_s - eval_s for x in launches)
        sem = statistics.stdev(x["median_step_seconds"] for x in launches) / math.sqrt(len(launches))
        timings[name] = Timing(step_s, eval_s, max(0.0, fixed), per_launch[name], sem, name)
    if interleaved_rounds > 0 and len(names) > 1:
        steps = interleaved_step_times(
            {n: runs[n] for n in names}, overrides, out_dir / "interleaved", nproc, warmup,
            interleaved_rounds, steps_per_turn, tag,
        )  # fmt: skip
        timings = with_interleaved({n: timings[n] for n in names}, steps, tag)
    warn_if_noisy(timings, names, tag)
    return {n: timings[same_work[n]] for n in runs}


LEVEL_DISAGREEMENT = 0.05
"""The step-interleaved job's level and the launches' (pooled over every config) further apart than
this are warned about (:func:`with_interleaved`)."""


def with_interleaved(
    timings: dict[str, Timing], measured: dict[str, dict[str, Any]], tag: str = "calibrate"
) -> dict[str, Timing]:
    """``timings`` (from the launches) with their step times from the step-interleaved job
    (:func:`summarize_turns`): each config's mean step in the job, whose ratios are known to the
    paired turns' standard error. The job's level is also the better estimate of the machine's:
    it samples every config over the whole job (the 2026-11-26 calibration: 1,190 steps over 20
    minutes), where 3 rounds of launches sampled it 3 times (and one slow round put their level
    10 % above the job's and the runs' own, ``EXPERIMENTS.md``); switching models every step can
    only add cache misses to the job's, which errs toward runs spending less. Neither level
    foresees a machine that slows after the calibration (the spend limit then ends runs early).
    The launches' level (the mean over every kept launch of its median step divided by its
    config's ratio) is kept on record (``launch_level``) with the launches' own mean
    (``launch_step_seconds``), and a disagreement above :data:`LEVEL_DISAGREEMENT` is warned about.
    Each timing also keeps the job's ``ratio``, ``rounds_kept`` and ``steps``.

    The evaluation and one-time seconds are pooled the same way (:func:`pooled_launch_costs`):
    one launch's evaluation is a single ~7 s sample, and per config they scattered by more than the
    configs differ (the 2026-11-26 calibration gave NormFormer 8.43 s and Pre-LN 6.60 s per
    evaluation over 3 launches, which alone cost NormFormer 1.7 % of its steps)."""
    est = [
        x["median_step_seconds"] / measured[n]["ratio"]
        for n, t in timings.items()
        for x in t.rounds
        if not x.get("anomalous_round")
    ]
    launch_level, first = statistics.fmean(est), next(iter(timings))
    job_level = measured[first]["step_seconds"]
    if abs(launch_level / job_level - 1) > LEVEL_DISAGREEMENT:
        print(
            f"[{tag}] calibration: WARNING the launches' step time ({launch_level:.4g} s for {first}) is "
            f"{launch_level / job_level - 1:+.1%} off the step-interleaved job's ({job_level:.4g} s), which "
            "is used (more samples, over a longer time): the machine's speed moved during the calibration, "
            "and runs that see the launches' speed will spend that much more or less than the budget",
            flush=True,
        )
    eval_level, fixed_level = pooled_launch_costs(timings, {n: m["ratio"] for n, m in measured.items()})
    out = {}
    for name, t in timings.items():
        m = measured[name]
        record = {k: m[k] for k in ("ratio", "rounds_kept", "steps")}
        out[name] = dataclasses.replace(
            t,
            step_seconds=m["step_seconds"],
            eval_seconds=eval_level * m["ratio"],
            fixed_seconds=fixed_level * m["ratio"],
            step_seconds_sem=m["sem"],
            ratio_sem=m["ratio_sem"],
            interleaved={
                **record,
                "launch_level": launch_level * m["ratio"],
                "launch_step_seconds": t.step_seconds,
                "launch_eval_seconds": t.eval_seconds,
                "launch_fixed_seconds": t.fixed_seconds,
            },
        )
    return out


def pooled_launch_costs(timings: dict[str, Timing], ratios: dict[str, float]) -> tuple[float, float]:
    """``(evaluation seconds, one-time seconds)`` of a config whose step costs 1 × the first
    config's, pooled over every kept launch of every config: each launch's evaluation and its
    one-time cost (loop wall-clock minus its steps at its own median step and its evaluation; the
    mean clamped at 0) divided by its config's step-time ``ratio``. A config's own are these times its
    ratio: an evaluation is the same model's forward passes, so it costs what a step costs
    relative to the others, and pooling the ``rounds × configs`` launches makes the estimate
    ``√configs`` times less noisy than each config's own few (seconds; the step times' ratios
    come from :func:`summarize_turns`)."""
    evals, fixed = [], []
    for name, t in timings.items():
        for x in t.rounds:
            if x.get("anomalous_round"):
                continue
            evals.append(x["eval_seconds"] / ratios[name])
            own = x["wall_seconds"] - x["steps"] * x["median_step_seconds"] - x["eval_seconds"]
            fixed.append(own / ratios[name])
    return statistics.fmean(evals), max(0.0, statistics.fmean(fixed))


ANOMALY_FACTOR = 1.5
"""A launch whose median step is this factor above or below its config's median over the rounds
is a machine anomaly, not drift (seen: a whole 30-step launch at 3.5× on a shared VM)."""

NOISE_WARNING = 0.01
"""Relative standard error of a config's step time (or its ratio to the first config's) above which
the calibration warns: the issue's bar for step counts is 1 %."""


def anomalous_rounds(
    per_launch: dict[str, list[dict[str, Any]]], tag: str = "calibrate", what: str = "launch"
) -> set[int]:
    """Rounds to leave out of every config's means: those in which some config's launch ran
    :data:`ANOMALY_FACTOR` × off its median over the rounds. The whole round goes, for every
    config, so that the remaining rounds keep each config's positions balanced against the others
    (the interleaving's drift cancellation); at least 2 rounds are kept (the least anomalous).

    Args:
        per_launch: ``{config: [launch record with "round" and "median_step_seconds"]}``.
        what: what a record is, for the warning (``"launch"``, or ``"turn"`` for the
            step-interleaved job's).
    """
    score: dict[int, float] = {}
    for name, launches in per_launch.items():
        mid = statistics.median(x["median_step_seconds"] for x in launches)
        for x in launches:
            off = max(x["median_step_seconds"] / mid, mid / x["median_step_seconds"])
            score[x["round"]] = max(score.get(x["round"], 1.0), off)
            if off > ANOMALY_FACTOR:
                print(
                    f"[{tag}] calibration: WARNING {name}'s {what} in round {x['round'] + 1} ran "
                    f"{x['median_step_seconds']:.3g} s per step, {off:.2f}× off its median {mid:.3g} s: "
                    "the machine was disturbed; that round is left out for every config",
                    flush=True,
                )
    bad = sorted((r for r, s in score.items() if s > ANOMALY_FACTOR), key=lambda r: -score[r])
    return set(bad[: max(0, len(score) - 2)])


def noise_warnings(timings: dict[str, Timing], names: list[str]) -> list[str]:
    """One line per config whose step time, or its ratio to the first config's, has a relative
    standard error above :data:`NOISE_WARNING`: step counts from it may be tilted by that much.

    With the step-interleaved job (``ratio_sem`` measured on paired turns), what can tilt a
    comparison is the ratio alone; the level's error (every config's alike) only moves where the
    spend limit falls, for all runs alike, and is not warned about."""
    base = timings[names[0]]
    out = []
    for name in names:
        t = timings[name]
        rel = t.step_seconds_sem / t.step_seconds
        if name == names[0]:  # its level: with the step-interleaved job, common to all (no tilt)
            ratio, worst = 0.0, 0.0 if t.interleaved else rel
        elif t.ratio_sem >= 0:  # paired turns: the level's noise is common to all and cancels
            ratio = worst = t.ratio_sem
        else:
            ratio = math.hypot(rel, base.step_seconds_sem / base.step_seconds)
            worst = max(rel, ratio)
        if worst > NOISE_WARNING:
            kept = t.interleaved.get("rounds_kept") or len(
                [x for x in t.rounds if not x.get("anomalous_round")]
            )
            out.append(
                f"{name}: step time {t.step_seconds:.4g} s ± {rel:.1%} "
                + (f"(ratio to {names[0]} ± {ratio:.1%}) " if ratio else "")
                + f"over {kept} rounds, above {NOISE_WARNING:.0%}: this machine's noise can tilt the step "
                "counts by that much; calibrate with more --calibration-rounds (or --interleaved-rounds), "
                "or on a quieter machine"
            )
    return out


def warn_if_noisy(timings: dict[str, Timing], names: list[str], tag: str = "calibrate") -> None:
    """Print :func:`noise_warnings` (the comparison's table, JSON and plot repeat them)."""
    for line in noise_warnings(timings, names):
        print(f"[{tag}] calibration: WARNING {line}", flush=True)


def load_or_calibrate(
    runs: dict[str, str],
    requests: dict[str, dict],
    overrides: list[str],
    out_dir: Path,
    nproc: int,
    rounds: int,
    warmup: int,
    measure: int,
    tag: str,
    share: bool = True,
    recheck_rounds: int = 2,
    interleaved: tuple[int, int] = (0, 1),
) -> dict[str, Timing]:
    """:func:`calibrate`, or the calibration saved in ``out_dir/calibration.json`` when it was made
    for the same runs (each run's :func:`~.provenance.run_request` without the budget) and the
    same settings; the reuse or the reason to measure again is printed. ``share``: runs with the
    same work (:func:`same_work_groups`) share one measurement; off, every run is timed itself
    (to measure the calibration's own noise). A reused calibration is re-checked on this machine
    first (:func:`recheck`, ``recheck_rounds`` rounds of launches; 0: not re-checked).
    ``interleaved``: ``(rounds, steps_per_turn)`` of the step-interleaved job (0 rounds: none)."""

    path = out_dir / "calibration.json"
    asked = {
        "runs": requests,
        "rounds": rounds,
        "warmup": warmup,
        "measure": measure,
        "nproc": nproc,
        "share": share,
    }
    if interleaved[0] > 0:  # only then: calibrations saved before the option stay reusable
        asked["interleaved_rounds"], asked["steps_per_turn"] = interleaved
    groups = same_work_groups(requests) if share else None
    if path.is_file():
        saved = json.loads(path.read_text())
        changed = differences(saved.get("request", {}), asked)
        if not changed:
            print(f"[{tag}] calibration: reused {path}", flush=True)
            timings = {n: Timing(**t) for n, t in saved["timings"].items()}
            if recheck_rounds <= 0:
                return timings
            now = calibrate(
                runs,
                overrides,
                out_dir / "recheck",
                nproc,
                recheck_rounds,
                warmup,
                measure,
                f"{tag} re-check",
                groups,
            )
            factor, record = recheck(timings, now, tag)
            saved["rechecks"] = [*saved.get("rechecks", []), record]
            atomic_write_json(path, saved)
            return {n: dataclasses.replace(t, machine_factor=factor) for n, t in timings.items()}
        print(
            f"[{tag}] calibration: {path} was made for other runs ({'; '.join(changed[:3])}): measuring again"
        )
    for name, leader in (groups or {}).items():
        if leader != name:
            print(f"[{tag}] calibration: {name} does the same work per step as {leader}: timed once, shared")
    timings = calibrate(
        runs, overrides, out_dir / "calibration", nproc, rounds, warmup, measure, tag, groups, *interleaved
    )
    atomic_write_json(path, {"request": asked, "timings": {n: asdict(t) for n, t in timings.items()}})
    return timings


RECHECK_TOLERANCE = 0.03
"""The re-check's own uncertainty: 2 rounds of launches that spread about ±2 % each on the 2-core
project machine (``bench/results/budget_fairness*.json``) know the ratio of two step times to about
±2-3 %. A machine measured slower by more than this gets the factor, widened by it; anything else,
a faster machine included, is treated as the calibration's (the limit is only ever loosened, so
the re-check's noise cannot cut a run short)."""
RELATIVE_TOLERANCE = 0.05
"""Re-checked configs whose speed changed by ratios further apart than this: their relative costs
moved, which a common factor cannot represent (warned)."""


def recheck(saved: dict[str, Timing], now: dict[str, Timing], tag: str = "calibrate") -> tuple[float, dict]:
    """This machine's speed against a saved calibration's, from a new interleaved measurement.

    A comparison or sweep resumed later, perhaps on another machine, keeps the step counts its
    finished runs got (equal work); but the saved step times no longer describe this machine, and a
    run on a slower one would reach the enforced spend limit before its decided length and end
    early (observed: 1,327 of 1,500 steps on a VM about 12 % slower than the calibration's). The
    measured factor is the median over the measured configs of ``now / saved`` step time; above
    ``1 +`` :data:`RECHECK_TOLERANCE` the runs get it, widened by that tolerance, as
    ``budget.machine_factor`` (the limit is scaled; the length is not). A faster machine, or
    one within the tolerance, changes nothing: the factor only ever loosens the limit.

    Args:
        saved: the calibration's timings, by run.
        now: the re-check's (:func:`calibrate` on this machine, the same runs and settings).

    Returns:
        ``(factor, record)``: ``factor`` >= 1.0 (see above); ``record`` (for
        ``calibration.json``'s ``rechecks``) holds the time, the measured median, the per-run ratios
        and the factor applied.
    """
    leaders = sorted({t.measured_as or n for n, t in now.items()})
    ratios = {n: now[n].step_seconds / saved[n].step_seconds for n in leaders}
    measured = statistics.median(ratios.values())
    factor = measured * (1.0 + RECHECK_TOLERANCE) if measured > 1.0 + RECHECK_TOLERANCE else 1.0
    per_run = ", ".join(f"{n} {r:.3f}" for n, r in ratios.items())
    if factor == 1.0:
        said = f"not slower by more than the re-check's noise ({RECHECK_TOLERANCE:.0%}): nothing changes"
    else:
        said = (
            f"the runs keep the step counts fixed from the saved times and their spend limit is scaled by "
            f"{factor:.3f} (that, widened by the re-check's noise; budget.machine_factor)"
        )
    print(f"[{tag}] calibration re-check: this machine's step time is {measured:.3f}× the saved one "
          f"({per_run}); {said}", flush=True)  # fmt: skip
    if max(ratios.values()) - min(ratios.values()) > RELATIVE_TOLERANCE:
        print(
            f"[{tag}] calibration re-check: WARNING the configs' speeds changed by different factors "
            f"({per_run}): their relative costs on this machine differ from the calibration's, which "
            "a resumed comparison cannot correct; a new output directory calibrates afresh",
            flush=True,
        )
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "measured": measured,
        "ratios": ratios,
        "factor": factor,
        "timings": {n: asdict(now[n]) for n in leaders},
    }
    return factor, record


def calibrate_runs(
    runs: dict[str, str],
    overrides: Sequence[str],
    root: Path,
    nproc: int,
    calibration: dict[str, int] | None,
    tag: str,
    share: bool = True,
) -> tuple[dict[str, Timing], dict[str, int], str]:
    """What ``compare`` and ``sweep`` do first: each run's request (resolved config, data, code
    version; :mod:`.provenance`), then :func:`load_or_calibrate` under ``root``.

    Args:
        calibration: ``{"rounds", "warmup", "measure", "recheck_rounds", "interleaved_rounds",
            "steps_per_turn"}`` (default 4, 10, 20, 2, 0, 1).

    Returns:
        ``(timings by run, the calibration settings used, the code version)``.

    Raises:
        ValueError: ``recheck_rounds`` is 1 or negative (before anything is launched).
    """
    root.mkdir(parents=True, exist_ok=True)
    cal = {
        "rounds": 4,
        "warmup": 10,
        "measure": 20,
        "recheck_rounds": 2,
        "interleaved_rounds": 0,
        "steps_per_turn": 1,
        **(calibration or {}),
    }
    if cal["interleaved_rounds"] == 1 or cal["interleaved_rounds"] < 0 or cal["steps_per_turn"] < 1:
        raise ValueError(
            f"--interleaved-rounds {cal['interleaved_rounds']}, --steps-per-turn {cal['steps_per_turn']}: "
            "use 0 rounds (no step-interleaved job) or >= 2 (the order alternates), and >= 1 step per turn"
        )
    if cal["recheck_rounds"] == 1 or cal["recheck_rounds"] < 0:
        raise ValueError(
            f"--recheck-rounds {cal['recheck_rounds']}: use 0 (trust a saved calibration) or >= 2 (the order "
            "alternates, as in the calibration)"
        )
    code = code_version()
    requests = {n: run_request(c, list(overrides), {}, code) for n, c in runs.items()}
    settings = (cal["rounds"], cal["warmup"], cal["measure"])
    timings = load_or_calibrate(
        runs,
        requests,
        list(overrides),
        root,
        nproc,
        *settings,
        tag,
        share,
        cal["recheck_rounds"],
        (cal["interleaved_rounds"], cal["steps_per_turn"]),
    )
    return timings, cal, code
