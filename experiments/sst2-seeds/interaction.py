"""After the result, not part of the verdict (EXPERIMENTS.md "Found after the result"): how much the
pre-registered standard error of ``seeds.py`` overstates, by counting the seed × sentence
interaction twice, and what an unbiased two-way estimate gives.

For the per-seed, per-sentence differences ``x[s, i]`` (A's correctness minus B's), the two-way
mean squares without replication are ``MS_seed = n·var(row means)``, ``MS_sentence =
k·var(column means)`` and ``MS_interaction`` (the residual's). ``seeds.py``'s SE² is
``(MS_seed + MS_sentence) / (k·n)``; the unbiased variance of the grand mean is ``(MS_seed +
MS_sentence − MS_interaction) / (k·n)``, with three-term Satterthwaite degrees of freedom.

Usage: python experiments/sst2-seeds/interaction.py [OUT] (default: the committed record);
prints a Markdown table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("sst2_seeds", HERE / "seeds.py")
seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seeds)


def unbiased(x: np.ndarray) -> dict:
    """``x``: (seeds, sentences) float differences. Returns the interaction's share of the
    pre-registered variance, the SE ratio, and the unbiased estimate's df, p and 95 % interval
    (fractions, not points)."""
    k, n = x.shape
    rows, cols, grand = x.mean(axis=1), x.mean(axis=0), x.mean()
    ms_seed, ms_sentence = n * rows.var(ddof=1), k * cols.var(ddof=1)
    residual = x - rows[:, None] - cols[None, :] + grand
    ms_interaction = float((residual**2).sum() / ((k - 1) * (n - 1)))
    used = (ms_seed + ms_sentence) / (k * n)
    var = used - ms_interaction / (k * n)
    terms = [
        (ms_seed / (k * n), k - 1),
        (ms_sentence / (k * n), n - 1),
        (-ms_interaction / (k * n), (k - 1) * (n - 1)),
    ]
    df = var**2 / sum(t**2 / d for t, d in terms)
    se = np.sqrt(var)
    half = stats.t.ppf(0.975, df) * se
    return {
        "interaction_share": ms_interaction / (k * n) / used,
        "se_ratio": float(np.sqrt(used / var)),
        "df": float(df),
        "p": float(2 * stats.t.sf(abs(grand) / se, df)),
        "ci95": [float(grand - half), float(grand + half)],
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else HERE
    right = seeds.load(root)
    print(
        "| A − B | interaction's share of SE² | pre-registered SE / unbiased SE "
        "| unbiased: df, p, 95 % CI (points) |"
    )
    print("|---|---:|---:|---:|")
    for name, a, b in seeds.ROWS:
        r = unbiased(right[a].astype(float) - right[b].astype(float))
        low, high = (f"{100 * v:+.1f}" for v in r["ci95"])
        print(
            f"| {name} | {100 * r['interaction_share']:.0f} % | {r['se_ratio']:.3f} "
            f"| {r['df']:.0f}, {r['p']:.2g}, [{low}, {high}] |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
