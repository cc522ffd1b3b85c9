"""Mean-pooled minus first-token head, for each of the four models of the SST-2 low-data record.

    .venv/bin/python experiments/sst2-lowdata/pooling.py RUN_DIR > OUT.md

``RUN_DIR`` is run.sh's ``OUT`` (``runs/sst2-lowdata``): ``<model>/ft-<pooling>-<init>/sst-2.json``
for model ``pre_ln``/``normformer``, pooling ``mean``/``first``, init ``pretrained``/``random-init``.
Each pair is the same model fine-tuned with the two heads, compared on the same 872 dev sentences
(:func:`megaformer.tools.finetune.paired_difference`: paired Wald interval, McNemar's exact p).
A secondary comparison of EXPERIMENTS.md's plan, not a test of issue 37 item 5.

Exit status: 0 written; 2 a missing or unpairable result (named).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megaformer.tools.finetune import paired_difference


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    lines = [
        "| model | init | mean − first (points) | 95 % interval (paired Wald) | right only with mean / "
        "only with first | McNemar exact p |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model in ("pre_ln", "normformer"):
        for init in ("pretrained", "random-init"):
            docs = {}
            for pooling in ("mean", "first"):
                path = root / model / f"ft-{pooling}-{init}" / "sst-2.json"
                if not path.is_file():
                    print(f"error: {path} is missing (run experiments/sst2-lowdata/run.sh)", file=sys.stderr)
                    return 2
                docs[pooling] = json.loads(path.read_text())
            d = paired_difference(docs["mean"], docs["first"])
            if d is None:
                print(f"error: {model} {init}: the two results cannot be paired", file=sys.stderr)
                return 2
            lines.append(
                f"| {model} | {init} | {100 * d['difference']:+.1f} | "
                f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] | {d['only_a']} / {d['only_b']} | "
                f"{d['mcnemar_p']:.3g} |"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
