"""Compare configs at equal compute: the paper's Fig. 2 and its blue stars, as one command.

    python -m megaformer.experiments.compare CONFIG [CONFIG ...] --budget-device-hours H \\
        --output-dir runs/compare [--name NAME ...] [--nproc 2] [--set section.key=value ...] \\
        [--calibration-rounds 4] [--order random|given] [--order-seed 0]

1. **Calibration** (:mod:`.calibrate`): every config's step time, evaluation time and one-time
   cost are measured in short launches, interleaved round by round in alternating order, so that
   the machine's drift hits every config alike; saved in ``OUTPUT_DIR/calibration.json`` and
   reused only for the same runs.
2. **Runs**: every config is trained through ``launch/pretrain.sh`` with the same
   ``budget.device_hours`` and its own calibrated times (``budget.step_seconds`` ...),
   from which it fixes its number of steps before its first step (:mod:`megaformer.training.budget`;
   a run that the machine slows past the budget ends there, and says so); the same overrides (give
   ``data.prefix`` / ``data.blend`` there, and ``data.split_seed`` when the configs differ in
   ``train.seed``, so every run reads the same data and the same held-out set), into
   ``OUTPUT_DIR/<name>``, in a random order drawn from ``--order-seed`` (recorded). A run that
   finished before is reused only when its ``request.json`` (resolved config, data fingerprint,
   budget, calibrated times, code version; :mod:`.provenance`) equals what is asked now; otherwise
   what differs is printed and it is trained again.

Written to ``OUTPUT_DIR``:

* ``comparison.md`` and ``comparison.json``: per run the final validation loss and perplexity,
  steps (and the decided number), tokens, the calibrated step time and its ratio to the
  baseline's, device-hours and their deviation from the budget, and the device-hours at which its
  validation perplexity first reached the baseline's best, with its share of the baseline's
  compute measured the same way (the first config is the baseline; Shleifer et al. 2021, Fig. 2's
  stars: "compute needed to match the baseline's final perplexity"); the JSON also holds the
  calibration, the run order and the code version;
* the same files, for runs that differ only in ``train.seed`` (:mod:`.seeds`): per group the final
  validation loss as mean ± sample std over seeds, min – max, and the paired difference against
  the baseline's run of the same seed;
* ``valid_ppl_vs_device_hours.png``: validation perplexity against device-hours, one curve per run
  (the paper's Fig. 2, on this run's scale), a seed group in one colour; beside it the last 60 %
  of the budget on a range that shows where the curves end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from data_tools.files import atomic_write_json
from megaformer.config import ConfigError, load_config, to_dict
from megaformer.experiments import calibrate
from megaformer.experiments.calibrate import Timing, noise_warnings
from megaformer.experiments.launcher import launch_run
from megaformer.experiments.provenance import differences, run_request
from megaformer.experiments.scalars import read_tb_dir
from megaformer.experiments.seeds import PAPER_EFFECT, seed_groups, seed_summary, seed_table


def valid_curve(tb_dir: str) -> list[tuple[int, float, float]]:
    """``[(step, device_hours, valid_loss)]`` of a run, from its TensorBoard events in ``tb_dir``
    (``<run dir>/tensorboard``) or, when there are none, from the compact file beside it
    (``<run dir>/scalars.json.gz``, as committed runs keep them; :mod:`.scalars`).

    The device-hours of an evaluation are those logged for its step (``train/device_hours``).

    Raises:
        ScalarsNotFoundError: neither form is there (the message names both and the fix); a
            ``ValueError`` too.
        ValueError: the run holds no ``valid/loss`` or no ``train/device_hours`` scalars.
    """
    scalars = read_tb_dir(tb_dir)
    for tag in ("valid/loss", "train/device_hours"):
        if tag not in scalars:
            raise ValueError(f"{tb_dir}: no '{tag}' scalars; was it written by megaformer.train?")
    hours = dict(scalars["train/device_hours"])
    return [(step, hours[step], loss) for step, loss in scalars["valid/loss"] if step in hours]


def calibrated_curve(summary: dict) -> list[tuple[int, float, float]]:
    """:func:`valid_curve` of a run, its device-hours in the calibration machine's units: divided by
    the run's ``budget_machine_factor`` (1 unless it trained on a slower machine than the
    calibration's, :func:`~.calibrate.recheck`), so that runs of one comparison trained on
    different machines are measured alike."""
    factor = summary.get("budget_machine_factor", 1.0)
    return [(step, hours / factor, loss) for step, hours, loss in valid_curve(summary["tensorboard_dir"])]


def costed_curve(
    curve: list[tuple[int, float, float]], timing: Timing, world_size: int, eval_interval: int
) -> list[tuple[int, float, float]]:
    """``curve`` with each evaluation's device-hours in **calibrated** device-hours: what the budget
    decided the run's length with (:mod:`megaformer.training.budget`), ``world_size × (one-time
    seconds + step × calibrated step seconds + the evaluations before it × calibrated evaluation
    seconds) / 3600``. No drift of the machine during the run moves it (the wall-clock curve,
    :func:`calibrated_curve`, keeps what the machine did); a run's last point is at most its
    budget."""
    t = timing
    return [
        (
            step,
            world_size
            * (t.fixed_seconds + step * t.step_seconds + (step - 1) // eval_interval * t.eval_seconds)
            / 3600.0,
            loss,
        )
        for step, _, loss in curve
    ]


def hours_to_reach(curve: list[tuple[int, float, float]], target_loss: float) -> float | None:
    """Device-hours of the first evaluation whose loss is at most ``target_loss`` (None: never)."""
    for _, hours, loss in curve:
        if loss <= target_loss:
            return hours
    return None


def comparison_rows(runs: dict[str, dict], budget: float, timings: dict[str, Timing]) -> list[dict]:
    """One row per run (``runs``: name -> {"summary": ..., "curve": ..., "costed": ...}, baseline
    first; ``costed``, :func:`costed_curve`: without it for every run the share is the wall-clock
    one, and ``share_basis`` says so).

    Compute shares are measured one way for every run, the baseline included: the device-hours at
    an evaluation's step (before that evaluation), so the baseline's own compute is the value at
    its last evaluation. The share (``share_of_baseline_compute``) is in calibrated device-hours
    (steps × calibrated times: the machine's drift during the runs cannot move it); the wall-clock
    share (``train/device_hours`` as logged) is kept beside it (``*_wallclock``).
    """
    names = list(runs)
    base_curve = runs[names[0]]["curve"]
    baseline_best = min(loss for _, _, loss in base_curve)
    baseline_hours = base_curve[-1][1]
    costed_all = all("costed" in r for r in runs.values())
    base_costed = runs[names[0]]["costed"] if costed_all else base_curve
    base_step = timings[names[0]].step_seconds
    rows = []
    for name in names:
        s, curve = runs[name]["summary"], runs[name]["curve"]
        costed = runs[name]["costed"] if costed_all else curve
        factor = s.get("budget_machine_factor", 1.0)
        reach = hours_to_reach(curve, baseline_best)
        reach_cal = hours_to_reach(costed, baseline_best)
        rows.append(
            {
                "run": name,
                "final_valid_loss": s["final_valid_loss"],
                "final_valid_ppl": s["final_valid_ppl"],
                "steps": s["steps"],
                "tokens": s["tokens"],
                "calibrated_step_seconds": timings[name].step_seconds,
                "calibrated_step_sem": timings[name].step_seconds_sem,
                "calibration_measured_as": timings[name].measured_as,
                "step_time_ratio": timings[name].step_seconds / base_step,
                "step_time_ratio_sem": _ratio_sem(timings[name], timings[names[0]]),
                "budget_steps": s.get("budget_steps"),
                "budget_stopped_at": s.get("budget_stopped_at"),
                # device-hours in the calibration machine's units, as the curves (calibrated_curve)
                "device_hours": s["device_hours"] / factor,
                "device_hours_measured": s["device_hours"],
                "budget_machine_factor": factor,
                "spend_deviation": s["device_hours"] / factor / budget - 1.0,
                "calibrated_device_hours": costed[-1][1] if costed_all else None,
                "share_basis": "calibrated" if costed_all else "wallclock",
                "hours_to_baseline_best_ppl": reach_cal,
                "share_of_baseline_compute": None if reach_cal is None else reach_cal / base_costed[-1][1],
                "hours_to_baseline_best_ppl_wallclock": reach,
                "share_of_baseline_compute_wallclock": None if reach is None else reach / baseline_hours,
            }
        )
    return rows


def _ratio_sem(t: Timing, base: Timing) -> float:
    """Standard error of ``t.step_seconds / base.step_seconds`` (first-order propagation of the two
    calibrations' standard errors; 0 for runs that share one measurement). Step times from the
    step-interleaved job carry their ratio's own error (``ratio_sem``, relative to the job's
    first config, whose is 0), measured from paired turns: the step times' own errors hold the
    machine's level, common to both, and would overstate it (±5 % where the pairs give ±0.8 %)."""
    ratio = t.step_seconds / base.step_seconds
    if t.measured_as and t.measured_as == base.measured_as:
        return 0.0
    if t.ratio_sem >= 0 and base.ratio_sem >= 0:
        return ratio * math.hypot(t.ratio_sem, base.ratio_sem)
    return ratio * math.hypot(t.step_seconds_sem / t.step_seconds, base.step_seconds_sem / base.step_seconds)


def _num(value: float | None, spec: str) -> str:
    """A figure for the table; ``null`` in a summary (not measured, e.g. a diverged run) as "—"."""
    return "—" if value is None else format(value, spec)


def markdown_table(rows: list[dict], baseline_best_ppl: float, budget: float) -> str:
    """The rows as a Markdown table."""
    lines = [
        f"Budget {budget:g} device-hours per run. Baseline ({rows[0]['run']}) best validation perplexity: "
        f"{baseline_best_ppl:.2f}",
        "",
        "| run | final valid loss | final valid ppl | steps (decided) | tokens | calibrated step (s, ± s.e.) "
        "| step time vs baseline | device-hours (vs budget) | device-hours to the baseline's best ppl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    calibrated = all(r.get("share_basis") == "calibrated" for r in rows)
    if calibrated:
        lines[0] += (
            ". Device-hours to the baseline's best: calibrated (steps × calibrated times, as the budget "
            "decided the runs' lengths; the machine's drift cannot move them), wall-clock in brackets"
        )
    for r in rows:
        reach, share = r["hours_to_baseline_best_ppl"], r["share_of_baseline_compute"]
        reach = "never" if reach is None else f"{reach:.4g} ({share:.0%} of the baseline's)"
        wall = r.get("share_of_baseline_compute_wallclock")
        if calibrated and wall is not None:
            reach += f" [wall-clock {wall:.0%}]"
        steps = f"{r['steps']:,} ({r['budget_steps']:,})" if r["budget_steps"] else f"{r['steps']:,}"
        if r["budget_stopped_at"]:
            steps += ", ended at the budget"
        lines.append(
            f"| {r['run']} | {_num(r['final_valid_loss'], '.4f')} | {_num(r['final_valid_ppl'], '.2f')} | "
            f"{steps} | "
            f"{r['tokens']:,} | {r['calibrated_step_seconds']:.4f} ± {r['calibrated_step_sem']:.4f} | "
            f"{r['step_time_ratio']:.3f}× ± {r['step_time_ratio_sem']:.3f} | "
            f"{r['device_hours']:.4g} ({r['spend_deviation']:+.1%}) | {reach} |"
        )
    return "\n".join(lines) + "\n"


def plot(
    runs: dict[str, dict],
    path: str,
    budget: float,
    groups: dict[str, list[str]] | None = None,
    warning: int = 0,
) -> None:
    """Validation perplexity against device-hours (the paper's Fig. 2), one line per run; the runs of
    a seed group (:func:`~.seeds.seed_groups`) share a colour, one line style per seed; ``warning``
    > 0: that many calibration noise warnings, said in the figure's title. Stars: where
    a run first reaches the baseline's best perplexity (the grey dashed line). Left, the whole run
    (log scale); right, the last 60 % of the budget on a range that shows where the curves end (a run
    ending above 1.5× the best final perplexity, e.g. one on the unigram plateau, is left above it,
    and its legend entry says so)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = list(runs)
    groups = groups or {n: [n] for n in names}
    look = {
        n: (f"C{k % 10}", ["-", "--", ":", "-."][j % 4])
        for k, m in enumerate(groups.values())
        for j, n in enumerate(m)
    }
    best_loss = min(loss for _, _, loss in runs[names[0]]["curve"])
    best = _ppl(best_loss)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax in axes:
        for name in names:
            curve, (colour, style) = runs[name]["curve"], look[name]
            hours, ppl = [h for _, h, _ in curve], [_ppl(v) for _, _, v in curve]
            marker = "." if ax is axes[0] else None
            ax.plot(hours, ppl, color=colour, linestyle=style, marker=marker, label=name)
            reach = hours_to_reach(curve, best_loss)
            if reach is not None:
                ax.plot([reach], [best], marker="*", markersize=13, color=colour, linestyle="none")
        ax.axhline(best, color="grey", linewidth=0.9, linestyle="--")
        ax.set_xlabel("device-hours (calibration machine's)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("validation perplexity")
    axes[0].set_title(f"whole runs (budget {budget:g} device-hours each)")
    off = _zoom(axes[1], runs, budget, best)
    axes[1].set_title("the end: the last 60 % of the budget")
    handles = [h for h in axes[0].get_lines() if h.get_label() in names]
    for h in handles:
        if h.get_label() in off:
            h.set_label(f"{h.get_label()} (above the right panel)")
    handles += [
        Line2D(
            [],
            [],
            marker="*",
            markersize=11,
            color="black",
            linestyle="none",
            label="first reaches the baseline's best",
        ),
        Line2D([], [], color="grey", linestyle="--", label=f"baseline's best ({names[0]}): {best:.1f}"),
    ]
    axes[1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    if warning:
        fig.suptitle(
            f"Caveat: the calibration was noisy ({warning} warning(s) in comparison.md): the step counts "
            "may be tilted",
            color="darkred",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _ppl(loss: float) -> float:
    """Perplexity of a loss in nats; inf where ``exp`` overflows or the loss is not finite."""
    return math.exp(loss) if loss < 700 else math.inf


def _zoom(ax, runs: dict[str, dict], budget: float, best: float) -> list[str]:
    """Limit ``ax`` to the last 60 % of the budget and the perplexities the runs reach there; return
    the runs left out of the range (final perplexity above 1.5× the lowest final one)."""
    finals = {n: _ppl(r["curve"][-1][2]) for n, r in runs.items() if r["curve"]}
    finals = {n: v for n, v in finals.items() if math.isfinite(v)}
    if not finals:
        return []
    shown = [n for n, v in finals.items() if v <= 1.5 * min(finals.values())]
    start = 0.4 * budget
    values = [_ppl(v) for n in shown for _, h, v in runs[n]["curve"] if h >= start and math.isfinite(_ppl(v))]
    values = values or [finals[n] for n in shown]
    low, high = min([*values, best]), max(values)
    pad = 0.04 * (high - low) or 0.02 * high
    ax.set_xlim(start, max(h for r in runs.values() for _, h, _ in r["curve"]) * 1.01)
    ax.set_ylim(low - pad, high + pad)
    return [n for n in finals if n not in shown]


def train_one(
    config: str,
    out: Path,
    budget: float,
    overrides: Sequence[str],
    nproc: int,
    timing: Timing,
    code: str,
    run_args: Sequence[str] = (),
) -> dict:
    """Train ``config`` into ``out`` at ``budget`` device-hours with its calibrated ``timing``
    (``run_args``: overrides of the run alone, not of its calibration, e.g. the final validation's
    size); return its summary. A finished run there is reused only when its ``request.json`` equals what
    is asked now (:func:`~.provenance.run_request`: resolved config, data, budget, calibrated
    times, code version); otherwise what differs is printed and the run is trained again.

    Raises:
        RuntimeError: the launch failed (names the config and the log file).
        ConfigError: a bad override (names it).
    """
    args = [
        *overrides,
        *run_args,
        f"budget.device_hours={budget}",
        *timing.overrides(),
        "output.overwrite=true",
    ]
    request = run_request(config, args, {"budget_device_hours": budget}, code)
    summary_path, request_path = out / "summary.json", out / "request.json"
    if summary_path.is_file() and request_path.is_file():
        changed = differences(json.loads(request_path.read_text()), request)
        if not changed:
            summary = json.loads(summary_path.read_text())
            print(
                f"[compare] {out.name}: done before with the same request, {summary['steps']} steps",
                flush=True,
            )
            return summary
        print(f"[compare] {out.name}: an earlier run differs ({'; '.join(changed[:4])}): training again")
    elif summary_path.is_file():
        print(f"[compare] {out.name}: an earlier run without request.json: training again", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    request_path.unlink(missing_ok=True)  # written back only once the run has finished
    launch = [*args, *timing.machine_overrides(), f"output.dir={out}"]
    summary = launch_run(config, out, launch, nproc, "compare")
    atomic_write_json(request_path, request)
    print(
        f"[compare] {out.name}: {summary['steps']} steps, "
        f"valid loss {_num(summary['final_valid_loss'], '.4f')}",
        flush=True,
    )
    return summary


def run_order(names: Sequence[str], order: str, seed: int) -> list[str]:
    """The order the runs are trained in: ``"random"`` (a permutation drawn from ``seed``, so that a
    drift of the machine is not confounded with the baseline) or ``"given"``."""
    import random

    if order == "given":
        return list(names)
    shuffled = list(names)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def seed_rows(
    rows: list[dict], loaded: dict, effect: float = PAPER_EFFECT
) -> tuple[dict[str, list[str]], list[dict]]:
    """``(seed groups, per-group summary)`` of the table's ``rows`` (:mod:`.seeds`), from each run's
    loaded config (``loaded``: name -> RunConfig); the paired statistics sized for ``effect``
    (nats)."""
    groups = seed_groups({n: to_dict(c) for n, c in loaded.items()})
    seeds = {n: c.train.seed for n, c in loaded.items()}
    split = {n: c.split_seed for n, c in loaded.items()}
    return groups, seed_summary(rows, groups, seeds, split, effect)


def compare(
    configs: Sequence[str],
    names: Sequence[str],
    budget: float,
    output_dir: str,
    overrides: Sequence[str] = (),
    nproc: int = 2,
    calibration: dict[str, int] | None = None,
    order: str = "random",
    order_seed: int = 0,
    share_calibration: bool = True,
    effect: float = PAPER_EFFECT,
    final_eval_batches: int = 0,
) -> list[dict]:
    """Calibrate every config's step time interleaved (:mod:`.calibrate`), train each at
    ``budget`` device-hours from it, in ``order``, then write the table and the plot.

    Args:
        calibration: ``{"rounds", "warmup", "measure", "recheck_rounds", "interleaved_rounds",
            "steps_per_turn"}`` of
            :func:`~.calibrate.calibrate_runs` (default 4 rounds, 10 warm-up steps, 20 measured
            steps; a reused calibration re-checked in 2 rounds).
        share_calibration: configs with the same work per step share one measurement
            (:func:`~.calibrate.same_work_groups`); False times each itself.
        effect: nats; the seed table sizes the number of seed pairs for it (:func:`~.seeds.paired_test`).
        final_eval_batches: every run's ``train.final_eval_batches`` (0: the final validation
            reads the whole held-out set, so the figure the runs are ranked by adds no sampling
            noise; -1: as the regular ones). Not passed to the calibration's launches.

    Returns:
        The table's rows (baseline first).
    """
    root = Path(output_dir)
    by_name = dict(zip(names, configs))
    run_args = [f"train.final_eval_batches={final_eval_batches}"]
    for n in names:  # what the runs will be given, refused now rather than after the calibration
        load_config(by_name[n], [*overrides, *run_args])
    timings, cal, code = calibrate.calibrate_runs(
        by_name, overrides, root, nproc, calibration, "compare", share_calibration
    )
    sequence = run_order(names, order, order_seed)
    print(f"[compare] training order: {', '.join(sequence)} ({order}, seed {order_seed})", flush=True)
    summaries = {
        n: train_one(by_name[n], root / n, budget, overrides, nproc, timings[n], code, run_args)
        for n in sequence
    }
    loaded = {n: load_config(by_name[n], list(overrides)) for n in names}
    runs = {}
    for n in names:
        curve = calibrated_curve(summaries[n])
        every = loaded[n].train.eval_interval
        costed = costed_curve(curve, timings[n], summaries[n].get("world_size", nproc), every)
        runs[n] = {"summary": summaries[n], "curve": curve, "costed": costed}
    rows = comparison_rows(runs, budget, timings)
    best_ppl = _ppl(min(loss for _, _, loss in runs[names[0]]["curve"]))
    groups, over_seeds = seed_rows(rows, loaded, effect)
    seeds_md = seed_table(over_seeds)
    measured = [n for n in names if timings[n].measured_as in ("", n)] or list(names)
    noisy = noise_warnings(timings, measured)
    table = _caveat(noisy) + markdown_table(rows, best_ppl, budget) + (f"\n{seeds_md}" if seeds_md else "")
    (root / "comparison.md").write_text(table, encoding="utf-8")
    record = {
        "budget_device_hours": budget,
        "order": sequence,
        "order_rule": order,
        "order_seed": order_seed,
        "calibration": {**cal, "timings": {n: asdict(t) for n, t in timings.items()}},
        "code_version": code,
        "effect": effect,
        "final_eval_batches": final_eval_batches,
        "calibration_warnings": noisy,
        "rows": rows,
        "seed_groups": over_seeds,
    }
    (root / "comparison.json").write_text(json.dumps(record, indent=2))
    # the plot's x: calibrated device-hours, the budget's own units (the wall-clock is in the JSON)
    shown = {n: {**r, "curve": r["costed"]} for n, r in runs.items()}
    plot(shown, str(root / "valid_ppl_vs_device_hours.png"), budget, groups, warning=len(noisy))
    return rows


def _caveat(warnings: list[str]) -> str:
    """The calibration's noise warnings as a block above the table ('' without any)."""
    if not warnings:
        return ""
    head = (
        f"> **Caveat: the calibration was noisy** ({len(warnings)} warning(s)); the step counts may be "
        "tilted by as much:"
    )
    return "\n".join([head, ">", *(f"> - {w}" for w in warnings), "", ""])


def remove_if_empty(root: Path) -> None:
    """Remove ``root`` when it holds directories only (what a refused comparison made before its
    refusal); a directory with any file (a launch's log, a run) is kept for the user to read."""
    if root.is_dir() and not any(p.is_file() or p.is_symlink() for p in root.rglob("*")):
        for d in sorted((p for p in root.rglob("*")), key=lambda p: len(p.parts), reverse=True):
            d.rmdir()
        root.rmdir()


def add_calibration_args(parser: argparse.ArgumentParser) -> None:
    """The calibration and run-order options shared by ``compare`` and ``sweep``."""
    parser.add_argument("--calibration-rounds", type=int, default=4, help="interleaved rounds (>= 2)")
    parser.add_argument(
        "--calibration-warmup",
        type=int,
        default=10,
        help="steps discarded per calibration launch (compilation, autotuning, start-up)",
    )
    parser.add_argument(
        "--calibration-steps", type=int, default=20, help="steps timed per calibration launch"
    )
    parser.add_argument(
        "--interleaved-rounds",
        type=int,
        default=0,
        help="also time the step in one job that alternates every config every --steps-per-turn steps, "
        "this many rounds, and take the step times from it (launch-by-launch timing is too coarse for a "
        "shared machine: 0 = off; ~240 for 1 %% on the 2-core VM, 4 s per config per round)",
    )
    parser.add_argument(
        "--steps-per-turn", type=int, default=1, help="steps per config per turn of --interleaved-rounds"
    )
    parser.add_argument("--order", choices=["random", "given"], default="random",
                        help="training order of the runs (recorded in the JSON)")  # fmt: skip
    parser.add_argument("--order-seed", type=int, default=0, help="seed of the random order")
    parser.add_argument(
        "--recheck-rounds",
        type=int,
        default=2,
        help="when a saved calibration is reused (a resumed comparison), re-time the configs this many "
        "interleaved rounds on this machine and scale the runs' spend limit by its speed (0: trust it)",
    )
    parser.add_argument(
        "--separate-calibration",
        action="store_true",
        help="time every run itself, even runs with the same work per step (the calibration's own noise)",
    )


def calibration_settings(args: argparse.Namespace) -> dict[str, int]:
    """The calibration settings (:func:`~.calibrate.calibrate_runs`) from :func:`add_calibration_args`'
    options."""
    return {
        "rounds": args.calibration_rounds,
        "warmup": args.calibration_warmup,
        "measure": args.calibration_steps,
        "recheck_rounds": args.recheck_rounds,
        "interleaved_rounds": args.interleaved_rounds,
        "steps_per_turn": args.steps_per_turn,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megaformer.experiments.compare",
        description="Train configs at the same device-hour budget; table and plot of validation perplexity.",
    )
    parser.add_argument("configs", nargs="+", help="YAML run configs; the first is the baseline")
    parser.add_argument("--budget-device-hours", type=float, required=True, help="per run, over all ranks")
    parser.add_argument("--output-dir", required=True, help="one sub-directory per run, table and plot")
    parser.add_argument("--name", action="append", default=None, help="run names (default: config stems)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (NPROC_PER_NODE)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override for every run (repeat), e.g. --set data.prefix=...")  # fmt: skip
    add_calibration_args(parser)
    parser.add_argument(
        "--effect",
        type=float,
        default=PAPER_EFFECT,
        help="nats: the effect the seed table sizes the number of seed pairs for (80%% power of a "
        f"paired t-test); default {PAPER_EFFECT:g}, NormFormer's 125M gain over Pre-LN (Shleifer et "
        "al. 2021, Table 2)",
    )
    parser.add_argument(
        "--final-eval",
        choices=["whole", "sample"],
        default="whole",
        help="the runs' final validation: the whole held-out set (default; train.final_eval_batches=0) or "
        "the sample every regular validation reads (train.eval_batches)",
    )
    args = parser.parse_args(argv)
    names = args.name or [Path(c).stem for c in args.configs]
    if len(names) != len(args.configs) or len(set(names)) != len(names):
        print(
            f"error: --name given {len(names)} times for {len(args.configs)} configs, or twice the same",
            file=sys.stderr,
        )
        return 2
    if args.budget_device_hours <= 0:
        print(f"error: --budget-device-hours={args.budget_device_hours}: must be > 0", file=sys.stderr)
        return 2
    existed = Path(args.output_dir).exists()
    try:
        rows = compare(
            args.configs,
            names,
            args.budget_device_hours,
            args.output_dir,
            args.set,
            args.nproc,
            calibration_settings(args),
            args.order,
            args.order_seed,
            not args.separate_calibration,
            args.effect,
            -1 if args.final_eval == "sample" else 0,
        )
    except (RuntimeError, ValueError, ConfigError) as e:
        if not existed:
            remove_if_empty(Path(args.output_dir))  # a refusal leaves nothing behind
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.output_dir) / "comparison.md").read_text())
    print(f"plot: {Path(args.output_dir) / 'valid_ppl_vs_device_hours.png'}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
