"""Rewrite a checkpoint's module weights (any tp, pp) for ``N`` tensor-parallel ranks at pp = 1.

    python -m megaformer.tools.reshard --input CKPT_DIR --output OUT_DIR --tp N [--tag global_step20]

A thin command over :mod:`megaformer.checkpoint.reshard` (which says what is carried and how).
Exit status 0, or 2 for a damaged, refused or unreshardable checkpoint (the message names the file).
"""

from __future__ import annotations

import argparse
import sys

from megaformer.checkpoint.reshard import reshard
from megaformer.checkpoint.safe_load import TRUST_FLAG, CheckpointReadError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megaformer.tools.reshard",
        description="Rewrite a checkpoint's module weights (any tp, pp) for tp ranks at pp = 1.",
    )
    parser.add_argument(
        "--input",
        required=True,
        help="a run directory, its checkpoints/ directory or one global_stepN directory",
    )
    parser.add_argument("--output", required=True, help="directory to write <tag>/mp_rank_XX_model_states.pt")
    parser.add_argument("--tp", type=int, required=True, help="target tensor-parallel degree")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the input's 'latest')")
    parser.add_argument(
        TRUST_FLAG,
        action="store_true",
        help="unpickle the checkpoint in full (it can run code): only for a source you trust",
    )
    args = parser.parse_args(argv)
    if args.tp < 1:
        print(f"error: --tp={args.tp}: must be >= 1", file=sys.stderr)
        return 2
    try:
        out = reshard(args.input, args.output, args.tp, args.tag, args.trust_checkpoint_code)
    except (CheckpointReadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} for tp={args.tp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
