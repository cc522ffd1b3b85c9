"""The final comparison's table, seed table and plot from the runs that have finished so far.

``compare`` writes ``comparison.md``/``.json`` and the plot only after its last run; the final CPU
comparison spans sessions, so this script makes the same outputs, with ``compare``'s own functions
and the comparison's saved calibration, from the finished runs committed under ``finished/``
(each run directory holds ``summary.json``, ``config.json`` and its scalars, ``scalars.json.gz``,
which ``compare`` reads as it reads TensorBoard events; docs/compare.md, committed runs)::

    python experiments/cpu-final/partial_report.py experiments/cpu-final/finished

Writes ``comparison-partial.md``, ``comparison-partial.json`` and
``valid_ppl_vs_device_hours-partial.png`` into that directory; the runs missing from the
comparison's 11 are listed in the Markdown. The baseline is the first finished run of
``ORDER`` (the command's config order).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from megaformer.config import load_config
from megaformer.experiments.calibrate import Timing
from megaformer.experiments.compare import (
    _ppl,
    calibrated_curve,
    comparison_rows,
    costed_curve,
    markdown_table,
    plot,
    seed_rows,
)
from megaformer.experiments.seeds import seed_table

ORDER = [
    f"{scheme}_s{seed}"
    for scheme in ("pre_ln", "normformer", "normformer_resscale")
    for seed in (1234, 5678, 4321)
] + ["post_ln_s1234", "deepnorm_s1234"]
BUDGET = 0.67


STEPS = (300, 500, 700, 900)


def equal_steps_table(runs: dict[str, dict], timings: dict[str, Timing]) -> str:
    """Validation loss at equal steps, with each run's decided and trained steps: the view that the
    machine's speed during a run cannot move (a run cut by the spend limit, because the machine ran
    slower than calibrated, loses its last steps, not these); a step's cost relative to the
    baseline's is the calibration's ratio."""
    lines = [
        "Validation loss at equal steps (nats; step cost: a step's calibrated cost relative to the first "
        "run's):",
        "",
        "| run | step cost | " + " | ".join(f"step {k}" for k in STEPS) + " | trained (decided) | final |",
        "|---|---|" + "---|" * len(STEPS) + "---|---|",
    ]
    base = timings[next(iter(runs))].step_seconds
    for name, run in runs.items():
        at = {step: loss for step, _, loss in run["curve"]}
        s = run["summary"]
        cells = " | ".join(f"{at[k]:.4f}" if k in at else "—" for k in STEPS)
        cut = (s["steps"] / s["budget_steps"] - 1) if s.get("budget_stopped_at") else 0.0
        trained = f"{s['steps']:,} ({s['budget_steps']:,}{f', {cut:+.1%}' if cut else ''})"
        lines.append(
            f"| {name} | {timings[name].step_seconds / base:.3f} | {cells} | {trained} | "
            f"{s['final_valid_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(root: Path) -> None:
    """Write the partial report into ``root`` (the committed ``finished/`` directory)."""
    cal = json.loads((root / "calibration.json").read_text())
    done = [n for n in ORDER if (root / n / "summary.json").is_file()]
    runs, timings, loaded = {}, {}, {}
    for name in done:
        summary = json.loads((root / name / "summary.json").read_text())
        # the committed copy: no events there, so valid_curve reads the run's scalars.json.gz
        summary["tensorboard_dir"] = str(root / name / "tensorboard")
        t = cal["timings"][name]
        timings[name] = Timing(**t)
        loaded[name] = load_config(str(root / name / "config.json"))
        curve = calibrated_curve(summary)
        every = loaded[name].train.eval_interval
        costed = costed_curve(curve, timings[name], summary["world_size"], every)
        runs[name] = {"summary": summary, "curve": curve, "costed": costed}
    rows = comparison_rows(runs, BUDGET, timings)
    groups, over_seeds = seed_rows(rows, loaded)
    best_ppl = _ppl(min(loss for _, _, loss in runs[done[0]]["curve"]))
    missing = [n for n in ORDER if n not in done]
    text = markdown_table(rows, best_ppl, BUDGET) + "\n" + seed_table(over_seeds)
    text += "\n" + equal_steps_table(runs, timings)
    text += f"\nNot trained yet: {', '.join(missing) or 'none'}.\n"
    (root / "comparison-partial.md").write_text(text, encoding="utf-8")
    record = {
        "budget_device_hours": BUDGET,
        "runs": done,
        "missing": missing,
        "timings": {n: asdict(t) for n, t in timings.items()},
        "rows": rows,
        "seed_groups": over_seeds,
    }
    (root / "comparison-partial.json").write_text(json.dumps(record, indent=2))
    # x: calibrated device-hours, as compare's own plot (the wall-clock share is in the JSON)
    shown = {n: {**r, "curve": r["costed"]} for n, r in runs.items()}
    plot(shown, str(root / "valid_ppl_vs_device_hours-partial.png"), BUDGET, groups)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
