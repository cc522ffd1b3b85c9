"""A learning-rate sweep per scheme at equal compute: the paper's Table 1 search, as one command.

    python -m megaformer.experiments.sweep CONFIG [CONFIG ...] --lr 1e-3 --lr 3e-3 --lr 1e-2 \\
        --budget-device-hours H --output-dir runs/sweep [--warmup 30 ...] [--seed 1234 ...] \\
        [--name NAME ...] [--set section.key=value ...] [--calibration-rounds 4] [--order-seed 0]

Shleifer et al. (2021) compare NormFormer with baselines whose learning rates were searched (Sec. 3:
"we tune the learning rate of the baseline", Table 1's grids): a claim against an untuned baseline
is not the paper's. This command gives every config (scheme) the same grid of learning rates (and
optionally warm-up lengths) and seeds, each cell at the same device-hour budget:

* the configs are calibrated once, together (:mod:`.calibrate`; the learning rate does not change
  the step time, so every cell of a scheme gets the scheme's step count);
* the cells are trained through ``launch/pretrain.sh`` (:func:`.compare.train_one`), interleaved:
  for each (learning rate, warm-up, seed) in a random order drawn from ``--order-seed``, every
  scheme in turn, the schemes' order rotated from one to the next (recorded);
* a finished cell is reused only when its request (resolved config, data, budget, calibrated times,
  code version) is unchanged, so an interrupted sweep resumes where it stopped.

Written to ``OUTPUT_DIR``: ``sweep.md`` and ``sweep.json`` (per scheme and cell: final validation
loss per seed, mean and standard deviation, steps; the best learning rate per scheme: lowest mean
final validation loss, a diverged cell never best), ``final_loss_vs_lr.png`` (one line per scheme,
error bars over seeds), and ``best/<name>.yaml``: the scheme's config at its best learning rate and
warm-up, every override resolved, ready for :mod:`.compare`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megaformer.config import ConfigError
from megaformer.config.load import load_config, to_dict
from megaformer.experiments.calibrate import calibrate_runs
from megaformer.experiments.compare import add_calibration_args, calibration_settings, train_one


def cell_name(lr: float, warmup: int | None, seed: int) -> str:
    """A cell's directory name, e.g. ``lr0.003-seed1234`` or ``lr0.003-wu30-seed1234``."""
    return f"lr{lr:g}" + (f"-wu{warmup}" if warmup is not None else "") + f"-seed{seed}"


def cell_overrides(lr: float, warmup: int | None, seed: int) -> list[str]:
    """The overrides that make a config one cell of the grid."""
    return [f"train.lr={lr:g}", f"train.seed={seed}"] + (
        [] if warmup is None else [f"train.warmup_steps={warmup}"]
    )


def schedule(
    names: Sequence[str], lrs: Sequence[float], warmups: Sequence[int | None], seeds: Sequence[int], seed: int
) -> list[tuple[str, float, int | None, int]]:
    """The training order of the cells ``(scheme, lr, warmup, seed)``: the grid points in a random
    order drawn from ``seed``; at each, every scheme, rotated by one from point to point."""
    points = list(itertools.product(lrs, warmups, seeds))
    random.Random(seed).shuffle(points)
    order = []
    for i, (lr, warmup, s) in enumerate(points):
        k = i % len(names)
        for name in [*names[k:], *names[:k]]:
            order.append((name, lr, warmup, s))
    return order


def _final_loss(summary: dict[str, Any]) -> float:
    """A cell's final validation loss; ``inf`` for a run that diverged or has none."""
    loss = summary.get("final_valid_loss")
    if summary.get("diverged_at_step") or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return math.inf
    return float(loss)


def results_table(cells: list[dict[str, Any]], names: Sequence[str]) -> tuple[list[dict], dict[str, dict]]:
    """Per (scheme, lr, warmup): the seeds' final losses, their mean and std, steps; and per scheme
    the best row (lowest mean; a row with a diverged seed has mean ``inf``)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["scheme"], c["lr"], c["warmup"]), []).append(c)
    rows = []
    for (scheme, lr, warmup), members in groups.items():
        losses = [c["final_valid_loss"] for c in members]
        finite = all(math.isfinite(x) for x in losses)
        rows.append(
            {
                "scheme": scheme,
                "lr": lr,
                "warmup": warmup,
                "seeds": [c["seed"] for c in members],
                "final_valid_losses": [x if math.isfinite(x) else None for x in losses],
                "mean": statistics.fmean(losses) if finite else math.inf,
                "std": statistics.stdev(losses) if finite and len(losses) > 1 else 0.0,
                "steps": [c["steps"] for c in members],
                "budget_steps": [c.get("budget_steps") for c in members],
            }
        )
    rows.sort(key=lambda r: (list(names).index(r["scheme"]), r["lr"], r["warmup"] or 0))
    best = {}
    for name in names:
        mine = [r for r in rows if r["scheme"] == name]
        best[name] = min(mine, key=lambda r: r["mean"])
    return rows, best


def markdown(rows: list[dict], best: dict[str, dict], budget: float) -> str:
    """The sweep as a Markdown table, the best cell of each scheme in bold."""
    lines = [
        f"Budget {budget:g} device-hours per cell. Final validation loss (nats), mean ± std over seeds.",
        "",
        "| scheme | lr | warm-up | final valid loss | seeds | steps |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = "diverged" if math.isinf(r["mean"]) else f"{r['mean']:.4f} ± {r['std']:.4f}"
        if best[r["scheme"]] is r:
            loss = f"**{loss}**"
        warmup = "config" if r["warmup"] is None else str(r["warmup"])
        steps = ", ".join(f"{s:,}" for s in r["steps"])
        lines.append(f"| {r['scheme']} | {r['lr']:g} | {warmup} | {loss} | {len(r['seeds'])} | {steps} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, budget: float) -> None:
    """Final validation loss against learning rate (log axis), one line per scheme (and warm-up),
    error bars over seeds, a star on each line's best rate; diverged cells are left out of the line
    and marked with an x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["scheme"], r["warmup"]) for r in rows}, key=lambda k: (k[0], k[1] or 0))
    for scheme, warmup in keys:
        mine = sorted(
            (r for r in rows if r["scheme"] == scheme and r["warmup"] == warmup), key=lambda r: r["lr"]
        )
        ok = [r for r in mine if math.isfinite(r["mean"])]
        label = scheme if warmup is None else f"{scheme}, warm-up {warmup}"
        line = ax.errorbar(
            [r["lr"] for r in ok],
            [r["mean"] for r in ok],
            yerr=[r["std"] for r in ok],
            marker="o",
            capsize=3,
            label=label,
        )
        if ok:
            best = min(ok, key=lambda r: r["mean"])
            ax.plot([best["lr"]], [best["mean"]], marker="*", markersize=16, color=line[0].get_color())
        bad = [r["lr"] for r in mine if not math.isfinite(r["mean"])]
        if bad and ok:
            ax.plot(
                bad, [max(r["mean"] for r in ok)] * len(bad), "x", color=line[0].get_color(), markersize=10
            )
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title(
        f"learning-rate sweep at equal compute\n{budget:g} device-hours per cell; ★ best rate, x diverged"
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_best_config(config: str, overrides: Sequence[str], row: dict, path: Path) -> None:
    """The scheme's config at its best cell, every override resolved, as YAML that ``compare`` and
    ``launch/pretrain.sh`` take (checked by loading it back)."""
    import yaml

    best = [f"train.lr={row['lr']:g}"] + (
        [] if row["warmup"] is None else [f"train.warmup_steps={row['warmup']}"]
    )
    resolved = to_dict(load_config(config, [*overrides, *best]))
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# {config} at the sweep's best learning rate ({row['lr']:g}); mean final valid loss "
    header += f"{row['mean']:.4f}\n"
    path.write_text(header + yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
    load_config(str(path))  # what was written loads


def sweep(
    configs: Sequence[str],
    names: Sequence[str],
    lrs: Sequence[float],
    seeds: Sequence[int],
    budget: float,
    output_dir: str,
    overrides: Sequence[str] = (),
    nproc: int = 2,
    warmups: Sequence[int] = (),
    calibration: dict[str, int] | None = None,
    order_seed: int = 0,
) -> dict[str, dict]:
    """Run the grid (see the module docstring); return the best row per scheme."""
    root = Path(output_dir)
    by_name = dict(zip(names, configs))
    timings, cal, code = calibrate_runs(by_name, overrides, root, nproc, calibration, "sweep")
    grid_warmups: list[int | None] = list(warmups) or [None]
    order = schedule(list(names), lrs, grid_warmups, seeds, order_seed)
    cells = []
    for i, (name, lr, warmup, seed) in enumerate(order, 1):
        cell = cell_name(lr, warmup, seed)
        print(f"[sweep] cell {i}/{len(order)}: {name} {cell}", flush=True)
        extra = [*overrides, *cell_overrides(lr, warmup, seed)]
        summary = train_one(by_name[name], root / name / cell, budget, extra, nproc, timings[name], code)
        cells.append(
            {
                "scheme": name,
                "lr": lr,
                "warmup": warmup,
                "seed": seed,
                "final_valid_loss": _final_loss(summary),
                "steps": summary["steps"],
                "budget_steps": summary.get("budget_steps"),
            }
        )
    rows, best = results_table(cells, names)
    (root / "sweep.md").write_text(markdown(rows, best, budget), encoding="utf-8")
    for name in names:
        write_best_config(by_name[name], overrides, best[name], root / "best" / f"{name}.yaml")

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    record = {
        "budget_device_hours": budget,
        "order": [list(c) for c in order],
        "order_seed": order_seed,
        "calibration": {**cal, "timings": {n: asdict(t) for n, t in timings.items()}},
        "code_version": code,
        "rows": [{**r, "mean": finite(r["mean"])} for r in rows],
        "best": {
            n: {"lr": b["lr"], "warmup": b["warmup"], "mean": finite(b["mean"])} for n, b in best.items()
        },
    }
    (root / "sweep.json").write_text(json.dumps(record, indent=2, allow_nan=False))
    plot(rows, str(root / "final_loss_vs_lr.png"), budget)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megaformer.experiments.sweep",
        description="Learning-rate sweep per config at equal compute; table, plot, each one's best config.",
    )
    parser.add_argument("configs", nargs="+", help="YAML run configs (one per scheme)")
    parser.add_argument(
        "--lr", type=float, action="append", required=True, help="peak learning rate (repeat)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        action="append",
        default=[],
        help="warm-up steps (repeat; default: the config's)",
    )
    parser.add_argument(
        "--seed", type=int, action="append", default=[], help="train.seed (repeat; default: 1234)"
    )
    parser.add_argument("--budget-device-hours", type=float, required=True, help="per cell, over all ranks")
    parser.add_argument(
        "--output-dir", required=True, help="one sub-directory per scheme and cell, table, plot"
    )
    parser.add_argument("--name", action="append", default=None, help="scheme names (default: config stems)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (NPROC_PER_NODE)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override for every run (repeat)",
    )
    add_calibration_args(parser)
    args = parser.parse_args(argv)
    names = args.name or [Path(c).stem for c in args.configs]
    problems = []
    if len(names) != len(args.configs) or len(set(names)) != len(names):
        problems.append(f"--name given {len(names)} times for {len(args.configs)} configs, or twice the same")
    if args.budget_device_hours <= 0:
        problems.append(f"--budget-device-hours={args.budget_device_hours}: must be > 0")
    if any(lr <= 0 for lr in args.lr) or len(set(args.lr)) != len(args.lr):
        problems.append(f"--lr {args.lr}: each must be > 0 and given once")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        best = sweep(
            args.configs,
            names,
            sorted(args.lr),
            args.seed or [1234],
            args.budget_device_hours,
            args.output_dir,
            args.set,
            args.nproc,
            args.warmup,
            calibration_settings(args),
            args.order_seed,
        )
    except (RuntimeError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(args.output_dir)
    print((root / "sweep.md").read_text())
    for name, row in best.items():
        print(f"best {name}: lr {row['lr']:g} -> {root / 'best' / (name + '.yaml')}")
    print(f"plot: {root / 'final_loss_vs_lr.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
