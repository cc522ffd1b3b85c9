"""The pre-registered test of experiments/sst2-preln-seeds (EXPERIMENTS.md "SST-2, Pre-LN over
thirty new fine-tuning seeds"): Pre-LN pretrained − its random-initialisation control on SST-2's
1,821 labelled test sentences, over fine-tuning seeds 11..40 only (the sixth try's seeds 1..10 are
not pooled: they were seen before this plan).

The test is the sixth try's (``experiments/sst2-seeds/seeds.py``, ``compare``: both the seeds and
the sentences counted as samples, Welch-Satterthwaite degrees of freedom, two-sided), one primary
row, so no multiplicity correction. Beside it, not part of the verdict: the unbiased two-way
estimate of ``experiments/sst2-seeds/interaction.py``.

Usage: python experiments/sst2-preln-seeds/analyse.py OUT [--plot PNG] (run.sh's OUT, or the
committed experiments/sst2-preln-seeds). Writes OUT/seeds.json and prints a Markdown table; exits
with a message naming a missing run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

SEEDS = range(11, 41)
SIXTH = Path(__file__).resolve().parent.parent / "sst2-seeds"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"sst2_{name}", SIXTH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


seeds = _module("seeds")
interaction = _module("interaction")


def load(root: Path) -> dict[str, np.ndarray]:
    """``{init: (seeds, sentences) bool correctness}`` of the two Pre-LN arms under ``root``."""
    return {
        init: np.stack([seeds.correct(root / "pre_ln" / f"ft-{init}-s{s}" / "sst-2.json") for s in SEEDS])
        for init in ("pretrained", "random-init")
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="run.sh's OUT")
    p.add_argument("--plot", default=None, help="also write the per-seed test accuracies as this PNG")
    args = p.parse_args(argv)
    root = Path(args.out)
    right = load(root)
    r = seeds.compare(right["pretrained"], right["random-init"])
    u = interaction.unbiased(right["pretrained"].astype(float) - right["random-init"].astype(float))
    doc = {
        "seeds": list(SEEDS),
        "sentences": int(right["pretrained"].shape[1]),
        "accuracy_per_seed": {f"pre_ln/{i}": right[i].mean(axis=1).tolist() for i in right},
        "primary": r,
        "unbiased_two_way": u,
    }
    (root / "seeds.json").write_text(json.dumps(doc, indent=1) + "\n")
    pts = lambda x: f"{100 * x:+.1f}"  # noqa: E731
    ci = lambda pair: f"[{pts(pair[0])}, {pts(pair[1])}]"  # noqa: E731
    print(
        "| A − B | accuracy A (%) | accuracy B (%) | points | 95 % CI (seeds and sentences) | df | p "
        "| seeds A > B | over seeds only: CI, p | over sentences only: CI | unbiased two-way: CI, p |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| Pre-LN pretrained − its random init | {100 * r['accuracy_a']:.1f} | {100 * r['accuracy_b']:.1f} "
        f"| {pts(r['difference'])} | {ci(r['ci95'])} | {r['df']:.0f} | {r['p']:.2g} "
        f"| {r['seeds_better']}/{len(SEEDS)} | {ci(r['seeds_ci95'])}, {r['seeds_t_p']:.2g} "
        f"| {ci(r['sentences_ci95'])} | {ci(u['ci95'])}, {u['p']:.2g} |"
    )
    if args.plot:
        seeds._plot(doc, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
