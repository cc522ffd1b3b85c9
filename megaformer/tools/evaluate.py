"""Perplexity of a checkpoint on any dataset.

    python -m megaformer.tools.evaluate --checkpoint RUN/checkpoints --data-prefix data/x_text_document
        [--data-prefix ...] [--tag global_step450] [--max-samples N] [--batch-size 8] [--device cpu]
        [--json out.json]

The checkpoint (any (tp, pp, dp) layout) is consolidated into one process at TP = 1 in fp32
(:func:`megaformer.tools.generate.load_for_generation`). Each dataset's documents are concatenated in
their natural order and cut into samples of ``seq_len + 1`` tokens sharing one token with the next (the
trainer's validation samples: :func:`megaformer.data.heldout.ordered_samples`); the loss is the mean
next-token cross-entropy in nats over every predicted token (``seq_len`` per sample), accumulated in
fp64; perplexity is ``exp(loss)``. With ``--max-samples`` equal to the run's
``train.eval_batches × train.global_batch_size`` on its ``data.valid_prefix`` this is the run's own
validation loss (test: tests/distributed/test_export_hf_launch.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def available_samples(prefix: str, seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens the dataset's tokens make (consecutive samples share one)."""
    from data_tools.indexed_dataset import IndexedDataset

    tokens = int(IndexedDataset(prefix).document_lengths(np.int64).sum())
    return max(tokens - 1, 0) // seq_len


def dataset_loss(
    model: torch.nn.Module,
    prefix: str,
    seq_len: int,
    *,
    max_samples: int = 0,
    batch_size: int = 8,
    device: str = "cpu",
) -> dict:
    """Mean next-token loss of ``model`` (a TP = 1 :class:`~megaformer.model.NormFormerLM`) on ``prefix``.

    Returns:
        ``{"data_prefix", "samples", "tokens", "loss" (nats/token), "ppl"}``.

    Raises:
        DataFormatError: a missing or corrupt dataset, or fewer tokens than one sample.
    """
    from megaformer.data.heldout import ordered_samples

    n = available_samples(prefix, seq_len)
    if max_samples:
        n = min(n, max_samples)
    samples = ordered_samples(prefix, seq_len, n, key="--data-prefix")
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            batch = torch.from_numpy(np.stack([samples[i] for i in range(start, min(start + batch_size, n))]))
            batch = batch.to(device)
            logits = model(batch[:, :-1]).float()  # (B, T, V_pad), padding at -inf
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += float(loss.double())
            count += batch[:, 1:].numel()
    loss = total / count
    return {"data_prefix": prefix, "samples": n, "tokens": count, "loss": loss, "ppl": math.exp(loss)}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad checkpoint, dataset or flag."""
    from data_tools.errors import DataToolsError
    from data_tools.indexed_dataset import dataset_prefix
    from megaformer.tools.generate import load_for_generation
    from megaformer.training.safe_load import TRUST_FLAG, CheckpointReadError

    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.evaluate",
        description="Loss and perplexity of a checkpoint on .bin/.idx datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="a run's checkpoints/ directory or one global_stepN")
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument(
        "--data-prefix", required=True, action="append", help="dataset PREFIX(.bin/.idx); repeatable"
    )
    p.add_argument("--max-samples", type=int, default=0, help="read at most this many samples (0: all)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        TRUST_FLAG,
        action="store_true",
        help="unpickle the checkpoint in full (it can run code): only for a source you trust",
    )
    args = p.parse_args(argv)
    if args.max_samples < 0 or args.batch_size < 1:
        print("error: --max-samples must be >= 0 and --batch-size >= 1", file=sys.stderr)
        return 2
    try:
        model, config, step = load_for_generation(args.checkpoint, args.tag, args.trust_checkpoint_code)
        model.to(args.device)
        results = [
            dataset_loss(
                model,
                prefix,
                config.seq_len,
                max_samples=args.max_samples,
                batch_size=args.batch_size,
                device=args.device,
            )
            for prefix in [dataset_prefix(p) for p in args.data_prefix]
        ]
    except (DataToolsError, CheckpointReadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {args.checkpoint}, step {step}, seq_len {config.seq_len}")
    for r in results:
        print(
            f"{r['data_prefix']}: loss {r['loss']:.4f} nats/token | ppl {r['ppl']:.2f} | "
            f"{r['samples']} samples, {r['tokens']:,} tokens"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"checkpoint": args.checkpoint, "step": step, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
