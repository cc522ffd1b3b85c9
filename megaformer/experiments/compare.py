"""Compare configs at equal compute: the paper's Fig. 2 and its blue stars, as one command.

    python -m megaformer.experiments.compare CONFIG [CONFIG ...] --budget-device-hours H \\
        --output-dir runs/compare [--name NAME ...] [--nproc 2] [-- section.key=value ...]

Every config is trained through ``launch/pretrain.sh`` with the same ``train.budget_device_hours``
(each run measures its own step time and fixes its own number of steps, see
:mod:`megaformer.training.budget`), the same overrides (give ``data.prefix`` / ``data.blend`` and
``train.seed`` there, so every run reads the same data and the same held-out set), one after the
other, into ``OUTPUT_DIR/<name>``. A run that finished before (its ``summary.json`` exists and
names the same budget) is not trained again.

Written to ``OUTPUT_DIR``:

* ``comparison.md`` and ``comparison.json``: per run the final validation loss and perplexity,
  steps, tokens, device-hours, and the device-hours at which its validation perplexity first
  reached the baseline's best (the first config is the baseline; Shleifer et al. 2021, Fig. 2's
  stars: "compute needed to match the baseline's final perplexity");
* ``valid_ppl_vs_device_hours.png``: validation perplexity against device-hours, one curve per run
  (the paper's Fig. 2, on this run's scale).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from megaformer.experiments.launcher import launch_run


def valid_curve(tb_dir: str) -> list[tuple[int, float, float]]:
    """``[(step, device_hours, valid_loss)]`` of a run, from its TensorBoard events.

    The device-hours of an evaluation are those logged for its step (``train/device_hours``).

    Raises:
        ValueError: the directory holds no ``valid/loss`` or no ``train/device_hours`` scalars.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("valid/loss", "train/device_hours"):
        if tag not in tags:
            raise ValueError(f"{tb_dir}: no '{tag}' scalars; was it written by megaformer.train?")
    hours = {e.step: e.value for e in acc.Scalars("train/device_hours")}
    return [(e.step, hours[e.step], e.value) for e in acc.Scalars("valid/loss") if e.step in hours]


def hours_to_reach(curve: list[tuple[int, float, float]], target_loss: float) -> float | None:
    """Device-hours of the first evaluation whose loss is at most ``target_loss`` (None: never)."""
    for _, hours, loss in curve:
        if loss <= target_loss:
            return hours
    return None


def comparison_rows(runs: dict[str, dict]) -> list[dict]:
    """One row per run (``runs``: name -> {"summary": ..., "curve": ...}, baseline first)."""
    names = list(runs)
    baseline_best = min(loss for _, _, loss in runs[names[0]]["curve"])
    rows = []
    for name in names:
        s, curve = runs[name]["summary"], runs[name]["curve"]
        reach = hours_to_reach(curve, baseline_best)
        rows.append(
            {
                "run": name,
                "final_valid_loss": s["final_valid_loss"],
                "final_valid_ppl": s["final_valid_ppl"],
                "steps": s["steps"],
                "tokens": s["tokens"],
                "device_hours": s["device_hours"],
                "hours_to_baseline_best_ppl": reach,
                "share_of_baseline_compute": None
                if reach is None
                else reach / runs[names[0]]["summary"]["device_hours"],
            }
        )
    return rows


def markdown_table(rows: list[dict], baseline_best_ppl: float) -> str:
    """The rows as a Markdown table."""
    lines = [
        f"Baseline ({rows[0]['run']}) best validation perplexity: {baseline_best_ppl:.2f}",
        "",
        "| run | final valid loss | final valid ppl | steps | tokens | device-hours | device-hours to the "
        "baseline's best ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reach, share = r["hours_to_baseline_best_ppl"], r["share_of_baseline_compute"]
        reach = "never" if reach is None else f"{reach:.4g} ({share:.0%} of the baseline's)"
        lines.append(
            f"| {r['run']} | {r['final_valid_loss']:.4f} | {r['final_valid_ppl']:.2f} | {r['steps']:,} | "
            f"{r['tokens']:,} | {r['device_hours']:.4g} | {reach} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], path: str, budget: float) -> None:
    """Validation perplexity against device-hours, one line per run, the baseline-best crossings
    starred (the paper's Fig. 2)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = list(runs)
    best = min(loss for _, _, loss in runs[names[0]]["curve"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        curve = runs[name]["curve"]
        ax.plot([h for _, h, _ in curve], [math.exp(v) for _, _, v in curve], marker=".", label=name)
        reach = hours_to_reach(curve, best)
        if reach is not None:
            ax.plot([reach], [math.exp(best)], marker="*", markersize=14, color=ax.lines[-1].get_color())
    ax.axhline(math.exp(best), color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("device-hours")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title(f"validation perplexity at equal compute (budget {budget:g} device-hours)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_one(config: str, out: Path, budget: float, overrides: Sequence[str], nproc: int) -> dict:
    """Train ``config`` with the budget into ``out`` (skipped when already done); return its summary.

    Raises:
        RuntimeError: the launch failed (names the config and the log file).
    """
    summary_path = out / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary.get("budget_device_hours") == budget:
            print(f"[compare] {out.name}: done before, {summary['steps']} steps", flush=True)
            return summary
    # an unfinished run is started again from scratch (its summary decides what is reused)
    args = [f"train.budget_device_hours={budget}", "output.overwrite=true", *overrides, f"output.dir={out}"]
    summary = launch_run(config, out, args, nproc, "compare")
    print(
        f"[compare] {out.name}: {summary['steps']} steps, valid loss {summary['final_valid_loss']:.4f}",
        flush=True,
    )
    return summary


def compare(
    configs: Sequence[str],
    names: Sequence[str],
    budget: float,
    output_dir: str,
    overrides: Sequence[str] = (),
    nproc: int = 2,
) -> list[dict]:
    """Train every config at ``budget`` device-hours, then write the table and the plot.

    Returns:
        The table's rows (baseline first).
    """
    root = Path(output_dir)
    runs = {}
    for config, name in zip(configs, names):
        summary = train_one(config, root / name, budget, overrides, nproc)
        runs[name] = {"summary": summary, "curve": valid_curve(summary["tensorboard_dir"])}
    rows = comparison_rows(runs)
    best_ppl = math.exp(min(loss for _, _, loss in runs[names[0]]["curve"]))
    (root / "comparison.md").write_text(markdown_table(rows, best_ppl), encoding="utf-8")
    (root / "comparison.json").write_text(json.dumps({"budget_device_hours": budget, "rows": rows}, indent=2))
    plot(runs, str(root / "valid_ppl_vs_device_hours.png"), budget)
    return rows


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
    try:
        rows = compare(args.configs, names, args.budget_device_hours, args.output_dir, args.set, args.nproc)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.output_dir) / "comparison.md").read_text())
    print(f"plot: {Path(args.output_dir) / 'valid_ppl_vs_device_hours.png'}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
