"""The learning-rate stability test (Shleifer et al. 2021, Sec. 4 and Fig. 5), as one command.

    python -m megaformer.experiments.lr_stability CONFIG [CONFIG ...] --output-dir runs/stability \\
        [--name NAME ...] [--seeds 1 2 3] [--lr-ramp 5e-5] [--divergence-factor 2] \\
        [--max-steps 2000] [--nproc 2] [--set section.key=value ...]

Every config (a scheme) is trained once per seed through ``launch/pretrain.sh`` with a learning rate
that starts at 0 and rises by ``--lr-ramp`` every step (``train.lr_decay=ramp``; the paper: 5e-5),
until the run diverges: its training loss is not finite, or above ``--divergence-factor`` times its
running minimum (``train.divergence_factor``). The run then stops, saves and writes
``diverged_at_step`` / ``diverged_at_lr`` to its ``summary.json``. A run that reaches
``--max-steps`` without diverging has no divergence learning rate (reported as such, never as a
number). Runs found finished with the same settings are not trained again.

Written to ``OUTPUT_DIR``: ``stability.json`` and ``stability.md`` (per scheme the learning rate at
divergence of every seed and their median) and ``lr_at_divergence.png`` (the median per scheme, each
seed as a dot; the paper's Fig. 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from megaformer.experiments.launcher import launch_run


def ramp_overrides(lr_ramp: float, factor: float, max_steps: int, seed: int) -> list[str]:
    """The config overrides of one stability run (the ramp, the stop rule, the seed, the length).

    ``train.warmup_steps=0`` (the ramp has none); ``train.lr`` is set to the ramp's last value so
    ``min_lr <= lr`` holds for any config (the ramp ignores both).
    """
    return [
        "train.lr_decay=ramp",
        f"train.lr_ramp={lr_ramp}",
        f"train.lr={lr_ramp * max_steps}",
        "train.min_lr=0",
        "train.warmup_steps=0",
        f"train.divergence_factor={factor}",
        f"train.steps={max_steps}",
        f"train.seed={seed}",
    ]


def run_one(config: str, out: Path, overrides: Sequence[str], nproc: int) -> dict:
    """Train one stability run into ``out`` (reused when its summary was written with the same
    overrides); return its summary.

    Raises:
        RuntimeError: the launch failed (names the config, the run's error line and the log).
    """
    summary_path, settings = out / "summary.json", out / "stability_overrides.json"
    if summary_path.is_file() and settings.is_file() and json.loads(settings.read_text()) == list(overrides):
        return json.loads(summary_path.read_text())
    summary = launch_run(config, out, [*overrides, f"output.dir={out}"], nproc, "stability")
    settings.write_text(json.dumps(list(overrides)))
    return summary


def summarize(results: dict[str, dict[int, float | None]]) -> dict[str, dict]:
    """Per scheme: the divergence lr by seed (None: did not diverge), the median over the seeds that
    diverged, and how many did not."""
    table = {}
    for name, by_seed in results.items():
        lrs = [lr for lr in by_seed.values() if lr is not None]
        table[name] = {
            "lr_by_seed": by_seed,
            "median_lr": statistics.median(lrs) if lrs else None,
            "not_diverged": sum(lr is None for lr in by_seed.values()),
        }
    return table


def markdown(table: dict[str, dict], lr_ramp: float, factor: float, max_steps: int) -> str:
    lines = [
        f"Learning rate at divergence (ramp {lr_ramp:g} per step from 0; divergence: non-finite loss or "
        f"loss > {factor:g} × running minimum; at most {max_steps} steps)",
        "",
        "| scheme | median lr | per seed | not diverged |",
        "|---|---|---|---|",
    ]
    for name, row in table.items():
        seeds = ", ".join(f"{s}: {'—' if v is None else f'{v:.4g}'}" for s, v in row["lr_by_seed"].items())
        median = "—" if row["median_lr"] is None else f"{row['median_lr']:.4g}"
        lines.append(f"| {name} | {median} | {seeds} | {row['not_diverged']} |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, dict], path: str) -> None:
    """Median lr at divergence per scheme (bars), each seed a dot (the paper's Fig. 5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 4.5))
    medians = [table[n]["median_lr"] or 0.0 for n in names]
    ax.bar(range(len(names)), medians, color=[f"C{i}" for i in range(len(names))], alpha=0.6)
    for i, n in enumerate(names):
        lrs = [lr for lr in table[n]["lr_by_seed"].values() if lr is not None]
        ax.plot([i] * len(lrs), lrs, "ko", ms=4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("learning rate at divergence")
    ax.set_title("LR stability test: median over seeds (dots: seeds)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stability(
    configs: Sequence[str],
    names: Sequence[str],
    seeds: Sequence[int],
    output_dir: str,
    *,
    lr_ramp: float = 5e-5,
    factor: float = 2.0,
    max_steps: int = 2000,
    overrides: Sequence[str] = (),
    nproc: int = 2,
) -> dict[str, dict]:
    """Run every config × seed, then write the table and the plot; return the table."""
    root = Path(output_dir)
    results: dict[str, dict[int, float | None]] = {}
    for config, name in zip(configs, names, strict=True):
        results[name] = {}
        for seed in seeds:
            extra = [*overrides, *ramp_overrides(lr_ramp, factor, max_steps, seed)]
            summary = run_one(config, root / name / f"seed{seed}", extra, nproc)
            results[name][seed] = summary.get("diverged_at_lr")
            print(f"[stability] {name} seed {seed}: diverged at lr {results[name][seed]}", flush=True)
    table = summarize(results)
    root.mkdir(parents=True, exist_ok=True)
    (root / "stability.json").write_text(json.dumps(table, indent=2))
    (root / "stability.md").write_text(markdown(table, lr_ramp, factor, max_steps))
    plot(table, str(root / "lr_at_divergence.png"))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megaformer.experiments.lr_stability", description=__doc__.split("\n")[0]
    )
    parser.add_argument("configs", nargs="+", help="YAML run configs, one per scheme")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--name", action="append", default=None, help="scheme names (default: config stems)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--lr-ramp", type=float, default=5e-5, help="lr rise per step (paper: 5e-5)")
    parser.add_argument("--divergence-factor", type=float, default=2.0, help="loss > this × running min")
    parser.add_argument("--max-steps", type=int, default=2000, help="give up (no divergence) after this")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override for every run"
    )
    args = parser.parse_args(argv)
    names = args.name or [Path(c).stem for c in args.configs]
    if len(names) != len(args.configs) or len(set(names)) != len(names):
        print(
            f"error: --name given {len(names)} times for {len(args.configs)} configs, or twice the same",
            file=sys.stderr,
        )
        return 2
    if args.lr_ramp <= 0 or args.divergence_factor <= 1 or args.max_steps < 1:
        print("error: --lr-ramp must be > 0, --divergence-factor > 1, --max-steps >= 1", file=sys.stderr)
        return 2
    try:
        stability(
            args.configs, names, args.seeds, args.output_dir, lr_ramp=args.lr_ramp,
            factor=args.divergence_factor, max_steps=args.max_steps, overrides=args.set, nproc=args.nproc,
        )  # fmt: skip
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.output_dir) / "stability.md").read_text())
    print(f"plot: {Path(args.output_dir) / 'lr_at_divergence.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
