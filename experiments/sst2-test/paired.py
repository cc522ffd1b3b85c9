"""The pre-registered comparisons of experiments/sst2-test on SST-2's 1,821 labelled test sentences:
pretrained − random init for Pre-LN and for NormFormer (the primary pair, Holm over the two), and
NormFormer − Pre-LN (both pretrained, secondary), each paired sentence by sentence
(:func:`megaformer.tools.finetune.paired_difference`: Wald interval for paired proportions,
McNemar's exact p). Usage: python experiments/sst2-test/paired.py OUT (run.sh's OUT)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megaformer.tools.finetune import paired_difference


def _test_doc(path: Path) -> dict:
    """The run's ``test`` entry in the shape :func:`paired_difference` reads (labels and predictions)."""
    doc = json.loads(path.read_text())
    test = doc["test"]
    return {
        "task": doc["task"],
        "data": {"valid_labels": test["labels"]},
        "best": {"predictions": test["predictions"]},
    }


def main(out: str) -> int:
    root = Path(out)
    runs = {
        (m, init): _test_doc(root / m / f"ft-{init}" / "sst-2.json")
        for m in ("pre_ln", "normformer")
        for init in ("pretrained", "random-init")
    }
    rows = [
        ("Pre-LN pretrained − its random init", runs["pre_ln", "pretrained"], runs["pre_ln", "random-init"]),
        (
            "NormFormer pretrained − its random init",
            runs["normformer", "pretrained"],
            runs["normformer", "random-init"],
        ),
        (
            "NormFormer − Pre-LN (both pretrained)",
            runs["normformer", "pretrained"],
            runs["pre_ln", "pretrained"],
        ),
    ]
    results = [(name, paired_difference(a, b)) for name, a, b in rows]
    for name, r in results:
        if r is None:  # paired_difference's answer for other sentences or no predictions
            sys.exit(f"error: {name}: the two runs cannot be paired (other test sentences or no predictions)")
    # Holm over the two primary tests (the first two rows): the smaller p times 2, the larger as is,
    # each at least the one before it
    first, second = sorted(range(2), key=lambda i: results[i][1]["mcnemar_p"])
    holm = {first: min(1.0, 2 * results[first][1]["mcnemar_p"])}
    holm[second] = min(1.0, max(holm[first], results[second][1]["mcnemar_p"]))
    print(
        "| A − B (paired on the test sentences) | accuracy A | accuracy B | points | 95 % interval "
        "| McNemar p | Holm p |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, (name, r) in enumerate(results):
        print(
            f"| {name} | {100 * r['accuracy_a']:.1f} | {100 * r['accuracy_b']:.1f} | "
            f"{100 * r['difference']:+.1f} | [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] | "
            f"{r['mcnemar_p']:.2g} | " + (f"{holm[i]:.2g} |" if i in holm else "(secondary) |")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
