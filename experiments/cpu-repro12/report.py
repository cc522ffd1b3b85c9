"""Collect the pre-registered runs that have finished and write the (interim) report.

    .venv/bin/python experiments/cpu-repro12/report.py [--runs-dir /work/exp-repro12/runs/cpu-repro12]

1. **Collect**: every run in ``--runs-dir`` with a ``summary.json`` whose run was not ended early
   (``budget_stopped_at``: by the plan's rules it is trained again) is copied compactly into
   ``finished/<run>/``: ``summary.json``, ``request.json``, ``config.json``, ``train.log`` (gzipped,
   ``train.log.gz``) and its scalars as ``scalars.json.gz`` (:mod:`megaformer.experiments.scalars`;
   no event files in git).
   A run already there is left as it is.
2. **Report** (``report.md`` / ``report.json``): the primary endpoint of the plan (EXPERIMENTS.md,
   "Pre-registered"): per seed, the final validation loss on the fixed 32,768-token sample
   (``final_valid_loss`` of the 3 pairs of ``experiments/cpu-final``, ``final_valid_loss_sampled``
   of the new runs), the paired differences NormFormer + ResScale − Pre-LN and NormFormer − Pre-LN
   with :func:`megaformer.experiments.seeds.paired_test` (95 % t interval, paired t, Wilcoxon and
   sign-test p, power for the paper's effect), and the secondary endpoints (the whole held-out
   novel, new pairs only; the validation loss at equal steps, step 1,000, every pair). Until the
   12th pair it is marked **interim, no verdict**.
3. **Plot** (``paired_differences.png``): every seed's paired difference of the primary endpoint,
   their mean with its 95 % interval, zero and the paper's effect.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from megaformer.experiments.scalars import read_scalars, write_compact  # noqa: E402
from megaformer.experiments.seeds import PAPER_EFFECT, paired_test  # noqa: E402

OLD = ROOT / "experiments" / "cpu-final" / "finished"
OLD_SEEDS = (1234, 5678, 4321)
NEW_SEEDS = (1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009)
SCHEMES = ("pre_ln", "normformer_resscale", "normformer")
KEEP = ("summary.json", "request.json", "config.json")
RESSCALE_EFFECT = 0.048  # nats: Shleifer et al. 2021, Table 2, ln(21.09 / 20.11) (seeds.PAPER_EFFECT's note)
EQUAL_STEP = 1000  # the plan's secondary endpoint (3): every run of both schemes validates there


def _summary(path: Path) -> dict:
    """A run's ``summary.json``; a truncated or hand-edited one stops the report naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(
            f"error: {path}: not a readable summary ({e}); train the run again or restore it"
        ) from None


def collect(runs: Path, finished: Path) -> list[str]:
    """Copy every finished, uncut run of ``runs`` into ``finished`` (compactly); return their names."""
    done = []
    for run in sorted(p for p in runs.glob("*_s*") if (p / "summary.json").is_file()):
        summary = _summary(run / "summary.json")
        if summary.get("budget_stopped_at") or summary.get("stopped"):
            print(f"[report] {run.name}: ended early ({summary.get('budget_stopped_at')}): not collected")
            continue
        out = finished / run.name
        if (out / "summary.json").is_file():
            continue
        out.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (run / name).is_file():
                shutil.copy2(run / name, out / name)
        if (run / "train.log").is_file():  # gzipped: the tracked tree is carried to GPU calls
            (out / "train.log.gz").write_bytes(gzip.compress((run / "train.log").read_bytes(), mtime=0))
        write_compact(run)  # checks its read-back against the events
        shutil.copy2(run / "scalars.json.gz", out / "scalars.json.gz")
        done.append(run.name)
        print(f"[report] {run.name}: collected")
    return done


def primary(scheme: str, seed: int, finished: Path) -> tuple[float, float | None] | None:
    """``(primary endpoint, whole-set loss or None)`` of one run, or None while it is not done."""
    if seed in OLD_SEEDS:
        path = OLD / f"{scheme}_s{seed}" / "summary.json"
        if not path.is_file():
            return None
        return _summary(path)["final_valid_loss"], None
    path = finished / f"{scheme}_s{seed}" / "summary.json"
    if not path.is_file():
        return None
    s = _summary(path)
    return s["final_valid_loss_sampled"], s["final_valid_loss"]


def at_equal_steps(scheme: str, seed: int, finished: Path) -> float | None:
    """The validation loss at step ``EQUAL_STEP`` of one run (its 32,768-token sample), or None."""
    run = (OLD if seed in OLD_SEEDS else finished) / f"{scheme}_s{seed}"
    if not (run / "summary.json").is_file():
        return None
    return next((v for step, v in read_scalars(run)["valid/loss"] if step == EQUAL_STEP), None)


def report(finished: Path) -> dict:
    """The report's figures (see the module docstring)."""
    seeds = [*OLD_SEEDS, *NEW_SEEDS]
    losses = {(sc, sd): primary(sc, sd, finished) for sc in SCHEMES for sd in seeds}
    out = {"effect": PAPER_EFFECT, "per_seed": [], "tests": {}}
    for sd in seeds:
        row = {"seed": sd}
        for sc in SCHEMES:
            got = losses[(sc, sd)]
            row[sc] = None if got is None else got[0]
            row[f"{sc}_whole"] = None if got is None else got[1]
            row[f"{sc}_step{EQUAL_STEP}"] = at_equal_steps(sc, sd, finished)
        out["per_seed"].append(row)
    endpoints = (
        ("primary", ""),
        ("whole held-out novel", "_whole"),
        (f"equal steps ({EQUAL_STEP})", f"_step{EQUAL_STEP}"),
    )
    for sc in ("normformer_resscale", "normformer"):
        for endpoint, suffix in endpoints:
            key, base = sc + suffix, "pre_ln" + suffix
            pairs = [r for r in out["per_seed"] if r[key] is not None and r[base] is not None]
            diffs = [r[key] - r[base] for r in pairs]
            test = paired_test(diffs, PAPER_EFFECT)
            out["tests"][f"{sc} - pre_ln, {endpoint}"] = test | {"seeds": [r["seed"] for r in pairs]}
    pairs_done = out["tests"]["normformer_resscale - pre_ln, primary"]["n"]
    out["interim"] = pairs_done < 12
    return out


def markdown(r: dict) -> str:
    """The report as Markdown."""
    head = (
        f"**Interim ({r['tests']['normformer_resscale - pre_ln, primary']['n']} of 12 pairs): no verdict** "
        "(the plan decides at 12 pairs)."
        if r["interim"]
        else "**All 12 pairs: the pre-registered test.**"
    )
    lines = [
        head,
        "",
        "| seed | Pre-LN | NormFormer + ResScale | NormFormer | Pre-LN (whole) | + ResScale (whole) "
        f"| Pre-LN (step {EQUAL_STEP}) | + ResScale (step {EQUAL_STEP}) |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")

    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:.4f}"

    for row in r["per_seed"]:
        lines.append(
            f"| {row['seed']} | {f(row['pre_ln'])} | {f(row['normformer_resscale'])} | "
            f"{f(row['normformer'])} | {f(row['pre_ln_whole'])} | {f(row['normformer_resscale_whole'])} | "
            f"{f(row[f'pre_ln_step{EQUAL_STEP}'])} | {f(row[f'normformer_resscale_step{EQUAL_STEP}'])} |"
        )
    lines += [
        "",
        "| comparison | n | mean difference (95 % CI) | σ of the differences | p (t / Wilcoxon / sign) "
        f"| negative / n | power for {r['effect']} |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for name, t in r["tests"].items():
        if not t["decidable"]:
            lines.append(f"| {name} | {t['n']} | {f(t['mean'])} | — | {t['reason']} | — | — |")
            continue
        lines.append(
            f"| {name} | {t['n']} | {t['mean']:+.4f} ({t['ci_low']:+.4f}, {t['ci_high']:+.4f}) | "
            f"{t['std']:.4f} | "
            f"{t['p_t']:.2g} / {t['p_wilcoxon']:.2g} / {t['p_sign']:.2g} | {t['negative']} / {t['n']} | "
            f"{t['power']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """``paired_differences.png``: each seed's d of the primary endpoint (NormFormer + ResScale −
    Pre-LN, and NormFormer − Pre-LN where it ran), the mean with its 95 % t interval, 0 and the
    paper's gains at 125M (−0.036 nats, −0.048 with ResScale)."""
    import matplotlib  # lazy: plotting only when the report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, (sc, label) in enumerate(
        (("normformer_resscale", "NormFormer + ResScale"), ("normformer", "NormFormer"))
    ):
        t = r["tests"][f"{sc} - pre_ln, primary"]
        rows = [row for row in r["per_seed"] if row[sc] is not None and row["pre_ln"] is not None]
        d = [row[sc] - row["pre_ln"] for row in rows]
        y = [i + 0.25 * (j / max(1, len(d) - 1) - 0.5) for j in range(len(d))]
        ax.scatter(d, y, s=18, color=f"C{i}", label=f"{label} − Pre-LN: {len(d)} seed pairs")
        if t["decidable"]:
            ax.errorbar(
                [t["mean"]], [i + 0.32], xerr=[[t["mean"] - t["ci_low"]], [t["ci_high"] - t["mean"]]],
                fmt="D", color=f"C{i}", capsize=4, label=f"mean, 95 % CI (p = {t['p_t']:.3g})",
            )  # fmt: skip
    ax.axvline(0, color="black", lw=0.8)
    paper = f"the paper's 125M gain, NormFormer (−{r['effect']})"
    ax.axvline(-r["effect"], color="grey", ls="--", lw=0.8, label=paper)
    ax.axvline(
        -RESSCALE_EFFECT, color="grey", ls=":", lw=0.8, label=f"the same, + ResScale (−{RESSCALE_EFFECT})"
    )
    ax.set_yticks([0, 1], ["NormFormer\n+ ResScale", "NormFormer"])
    ax.set_ylim(-0.5, 2.6)  # room above the rows for the legend
    ax.set_xlabel("final validation loss − Pre-LN's, same seed, equal compute (nats)")
    ax.set_title("CPU reproduction (d 128, 4 layers, 0.67 device-hours per run)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", default="/work/exp-repro12/runs/cpu-repro12")
    args = p.parse_args(argv)
    finished = HERE / "finished"
    if Path(args.runs_dir).is_dir():
        collect(Path(args.runs_dir), finished)
    r = report(finished)
    (HERE / "report.json").write_text(json.dumps(r, indent=1))
    (HERE / "report.md").write_text(markdown(r), encoding="utf-8")
    plot(r, HERE / "paired_differences.png")
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
