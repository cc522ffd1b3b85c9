"""Can timing noise tilt a comparison at equal compute? The fairness check of the comparisons issue.

    .venv/bin/python bench/budget_fairness.py [--budget 0.04] [--repeats 3] [--load-cores 1]
        [--out bench/results/budget_fairness.json]

Runs ``python -m megaformer.experiments.compare`` (the users' command) on the bundled novels (three
of them, preprocessed here as the tests' fixture is), at the tests' tiny shape (``SHAPE``), while
``--load-cores`` busy-loop processes load the machine (the noise a shared node has):

1. **A/A, ``--repeats`` times**: ``configs/cpu-compare/pre_ln.yaml`` compared with itself. Pass:
   the two runs' step counts within 1% of each other, and each run's device-hours within 2% of
   the budget. By default the pair does the same work, so ``compare`` times it once and both runs
   get one step count; ``--separate-calibration`` times each run itself, which measures the
   calibration's own noise (what separates two *different* configs' step counts).
2. **Pre-LN vs NormFormer** (``configs/cpu-compare/normformer.yaml``): NormFormer's step count
   relative to Pre-LN's against the interleaved calibration's step-time ratio (Pre-LN / NormFormer);
   pass within 1%.

Every comparison calibrates anew (its own output directory). Prints a table and writes JSON. Not
a test: minutes of the machine (about 5 per comparison at the default budget).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.files import atomic_write_json  # noqa: E402

NOVELS = ["pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz"]
SHAPE = [  # the tests' tiny shape: ~0.2 s steps, so a 0.04 device-hour run takes ~300+ steps and 1% is
    # resolvable (at the cpu-compare shape, 66 steps: one step is 1.5%)
    "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=2", "model.seq_len=64",
    "train.micro_batch_size=4", "train.global_batch_size=8",
]  # fmt: skip


def preprocess(out: Path) -> str:
    """The three novels as ``.bin/.idx`` (GPT-2 BPE + EOD, one document per paragraph block)."""
    prefix = out / "novels"
    cmd = [
        sys.executable, "-m", "data_tools.preprocess",
        "--input", *[str(REPO / "data" / "gutenberg-novels" / n) for n in NOVELS],
        "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
        "--merge-file", str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
        "--append-eod", "--text-split-blank-lines", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return f"{prefix}_text_document"


def compare(
    configs: list[str], names: list[str], budget: float, out: Path, prefix: str, seed: int, separate: bool
) -> dict:
    """One ``compare`` call; returns its comparison.json."""
    cmd = [sys.executable, "-m", "megaformer.experiments.compare", *configs]
    if separate:
        cmd.append("--separate-calibration")
    for name in names:
        cmd += ["--name", name]
    for item in SHAPE:
        cmd += ["--set", item]
    cmd += [
        "--budget-device-hours", str(budget), "--output-dir", str(out), "--order-seed", str(seed),
        "--set", f"data.prefix={prefix}", "--set", "data.valid_fraction=0.05",
        "--set", "train.eval_batches=2", "--set", "train.save_interval=0", "--set", "train.eval_interval=100",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compare failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads((out / "comparison.json").read_text())


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=0.04, help="device-hours per run")
    p.add_argument("--repeats", type=int, default=3, help="A/A comparisons")
    p.add_argument("--load-cores", type=int, default=1, help="busy-loop processes beside the runs")
    p.add_argument(
        "--separate-calibration",
        action="store_true",
        help="time the A/A pair's two runs separately (the calibration's own noise) instead of once",
    )
    p.add_argument("--out", default=None, help="default bench/results/budget_fairness[_separate].json")
    return p


def _run_comparisons(args: argparse.Namespace) -> dict:
    """The A/A comparisons and Pre-LN vs NormFormer, with ``--load-cores`` busy loops running beside
    them; returns ``{"aa": [...], "pre_ln_vs_normformer": {...}}``."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load_cores)]
    results = {"aa": [], "pre_ln_vs_normformer": None}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prefix = preprocess(Path(tmp))
            pre_ln = "configs/cpu-compare/pre_ln.yaml"
            for i in range(args.repeats):
                data = compare(
                    [pre_ln, pre_ln],
                    ["a", "b"],
                    args.budget,
                    Path(tmp) / f"aa{i}",
                    prefix,
                    i,
                    args.separate_calibration,
                )
                a, b = data["rows"]
                results["aa"].append(
                    {
                        "steps": [a["steps"], b["steps"]],
                        "budget_steps": [a["budget_steps"], b["budget_steps"]],
                        "step_gap": abs(a["steps"] - b["steps"]) / max(a["steps"], b["steps"]),
                        "spend_deviation": [a["spend_deviation"], b["spend_deviation"]],
                        "calibrated_step_seconds": [
                            a["calibrated_step_seconds"],
                            b["calibrated_step_seconds"],
                        ],
                        "order": data["order"],
                        "stopped_at_budget": [a["budget_stopped_at"], b["budget_stopped_at"]],
                    }
                )
                print(f"A/A {i + 1}: {results['aa'][-1]}", flush=True)
            data = compare(
                [pre_ln, "configs/cpu-compare/normformer.yaml"], ["pre_ln", "normformer"], args.budget,
                Path(tmp) / "nf", prefix, 0, args.separate_calibration,
            )  # fmt: skip
            base, nf = data["rows"]
            time_ratio = nf["calibrated_step_seconds"] / base["calibrated_step_seconds"]
            results["pre_ln_vs_normformer"] = {
                "steps": [base["steps"], nf["steps"]],
                "budget_steps": [base["budget_steps"], nf["budget_steps"]],
                "step_ratio_base_over_nf": base["steps"] / nf["steps"],
                "calibrated_time_ratio_nf_over_base": time_ratio,
                "ratio_gap": abs(base["steps"] / nf["steps"] / time_ratio - 1.0),
                "spend_deviation": [base["spend_deviation"], nf["spend_deviation"]],
                "order": data["order"],
                "final_valid_loss": [base["final_valid_loss"], nf["final_valid_loss"]],
            }
    finally:
        for proc in load:
            proc.kill()
    return results


def _print_table(results: dict, checks: dict) -> None:
    """Prints the Markdown table of the comparisons and the checks."""
    aa = results["aa"]
    print("\n| comparison | steps | step gap | spend vs budget |")
    print("|---|---|---|---|")
    for i, r in enumerate(aa):
        spend = ", ".join(f"{d:+.1%}" for d in r["spend_deviation"])
        print(f"| A/A {i + 1} | {r['steps'][0]} / {r['steps'][1]} | {r['step_gap']:.2%} | {spend} |")
    nf = results["pre_ln_vs_normformer"]
    print(
        f"| Pre-LN / NormFormer | {nf['steps'][0]} / {nf['steps'][1]} | "
        f"step ratio {nf['step_ratio_base_over_nf']:.4f} "
        f"vs time ratio {nf['calibrated_time_ratio_nf_over_base']:.4f} ({nf['ratio_gap']:.2%}) | "
        + ", ".join(f"{d:+.1%}" for d in nf["spend_deviation"])
        + " |"
    )
    print(f"checks: {checks}")


def main() -> int:
    args = _parser().parse_args()
    suffix = "_separate" if args.separate_calibration else ""
    args.out = args.out or str(REPO / "bench" / "results" / f"budget_fairness{suffix}.json")
    results = _run_comparisons(args)
    aa = results["aa"]
    checks = {
        "aa_steps_within_1pct": all(r["step_gap"] <= 0.01 for r in aa),
        "aa_spend_within_2pct": all(abs(d) <= 0.02 for r in aa for d in r["spend_deviation"]),
        "nf_step_ratio_matches_time_ratio_within_1pct": results["pre_ln_vs_normformer"]["ratio_gap"] <= 0.01,
    }
    _print_table(results, checks)
    record = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "budget_device_hours": args.budget,
        "load_cores": args.load_cores,
        "calibration": "separate" if args.separate_calibration else "shared for runs with the same work",
        "results": results,
        "checks": checks,
    }
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
