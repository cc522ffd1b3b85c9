"""The A/A check of the calibration, with grouping switched off: one config timed as two separate
configs by the step-interleaved job (:func:`megaformer.experiments.calibrate.interleaved_step_times`,
what ``compare --interleaved-rounds N --separate-calibration`` runs), and the step counts a budget
run of each would decide.

    .venv/bin/python bench/aa_calibration.py [--config experiments/cpu-final/configs/pre_ln_s1234.yaml]
        [--rounds 120] [--budget 0.67] [--out bench/results/aa_calibration.json]

``compare`` would time an A/A pair once (same work, one measurement) and give both runs one step
count by construction; here each name is stepped and timed on its own turns, so the two counts
differ by exactly the calibration's noise. Pass: the counts within 1 %. The ratio's standard error
(paired rounds) is printed beside it: on a loaded machine 1 % needs more rounds (the error falls
as 1/sqrt(rounds)). Prints a table and writes JSON (machine, date, commit, load average). Not a
test: minutes of the machine (about 2 × rounds × one step).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.files import atomic_write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from megaformer.config import load_config
    from megaformer.experiments.calibrate import interleaved_step_times
    from megaformer.training.budget import steps_for_budget

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/cpu-final/configs/pre_ln_s1234.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--budget", type=float, default=0.67, help="device-hours of the step counts shown")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "aa_calibration.json"))
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)  # a bad config or override fails here, before any launch
    runs = {"a": args.config, "b": args.config}
    load0, start = os.getloadavg()[0], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = interleaved_step_times(
            runs, args.set, Path(tmp) / "job", args.nproc, warmup=5, rounds=args.rounds
        )
    wall, load1 = time.time() - start, os.getloadavg()[0]
    seconds = args.budget * 3600.0 / args.nproc
    steps = {
        n: steps_for_budget(
            seconds_left=seconds,
            done=0,
            step_seconds=o["step_seconds"],
            eval_seconds=0.0,
            eval_interval=cfg.train.eval_interval,
            max_steps=10**7,
        )
        for n, o in out.items()
    }
    apart = steps["a"] / steps["b"] - 1
    record = {
        "config": args.config,
        "overrides": args.set,
        "rounds": args.rounds,
        "rounds_kept": out["b"]["rounds_kept"],
        "step_seconds": {n: o["step_seconds"] for n, o in out.items()},
        "ratio_b_to_a": out["b"]["ratio"],
        "ratio_sem": out["b"]["ratio_sem"],
        "budget_device_hours": args.budget,
        "steps": steps,
        "steps_apart": apart,
        "pass_within_1pct": abs(apart) < 0.01,
        "wall_seconds": wall,
        "load_average_1min": [load0, load1],
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
    }
    print("| name | mean step (s) | ratio to a | s.e. of the ratio | steps at the budget |")
    print("|---|---|---|---|---|")
    for n, o in out.items():
        sem = "–" if n == "a" else f"{o['ratio_sem']:.2%}"
        print(f"| {n} | {o['step_seconds']:.4f} | {o['ratio']:.4f} | {sem} | {steps[n]:,} |")
    verdict = "within" if record["pass_within_1pct"] else "NOT within"
    print(
        f"A/A step counts {apart:+.2%} apart: {verdict} 1 % ({out['b']['rounds_kept']} rounds kept, "
        f"{wall:.0f} s)"
    )
    atomic_write_json(Path(args.out), record)
    print(f"wrote {args.out}")
    return 0 if record["pass_within_1pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
