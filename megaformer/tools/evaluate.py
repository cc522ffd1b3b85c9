"""Perplexity of a checkpoint on any dataset.

    python -m megaformer.tools.evaluate --checkpoint RUN/checkpoints --data-prefix data/x_text_document
        [--data-prefix ...] [--tag global_step450] [--max-samples N] [--batch-size 8] [--device cpu]
        [--json out.json]
    python -m megaformer.tools.evaluate --heldout RUN [--checkpoint RUN/checkpoints/global_stepN]

``--heldout RUN`` evaluates exactly the held-out documents the run was validated on: its
``config.json`` names the dataset (``data.prefix`` or ``data.blend``), ``data.valid_fraction`` and
the split seed (``data.split_seed``, or ``train.seed`` when that is -1), and every sample they hold
is read, in the trainer's order (:data:`~megaformer.data.gpt_dataset.WHOLE_HELDOUT`): the figure of
``train.final_eval_batches=0``, up to the last global batch's remainder, which the trainer leaves
out and this reads. The checkpoint defaults to the run's ``latest``.

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
import os
import sys
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from data_tools.errors import DataToolsError
from data_tools.indexed_dataset import dataset_prefix, open_dataset
from megaformer.checkpoint.safe_load import TRUST_FLAG, CheckpointReadError
from megaformer.config import load_config
from megaformer.data.gpt_dataset import WHOLE_HELDOUT, build_train_valid
from megaformer.data.heldout import ordered_samples
from megaformer.tools.generate import load_for_generation


def available_samples(prefix: str, seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens the dataset's tokens make (consecutive samples share one)."""

    tokens = int(open_dataset(prefix).document_lengths(np.int64).sum())
    return max(tokens - 1, 0) // seq_len


def samples_loss(
    model: torch.nn.Module, samples, n: int, batch_size: int, device: str, label: str = "evaluate"
) -> tuple[float, int]:
    """``(mean next-token loss in nats, predicted tokens)`` of ``model`` over ``samples[0..n-1]``
    (each ``int64[seq_len + 1]``), accumulated in fp64; a progress bar (stderr, in tokens) named
    ``label``."""
    from tqdm import tqdm

    total, count = 0.0, 0
    seq_len = len(samples[0]) - 1 if n else 0
    bar = tqdm(total=n * seq_len, unit="tok", unit_scale=True, desc=label, file=sys.stderr, leave=False)
    with torch.no_grad(), bar:
        for start in range(0, n, batch_size):
            bar.update(min(batch_size, n - start) * seq_len)
            rows = [np.asarray(samples[i], dtype=np.int64) for i in range(start, min(start + batch_size, n))]
            batch = torch.from_numpy(np.stack(rows)).to(device)
            logits = model(batch[:, :-1]).float()  # (B, T, V_pad), padding at -inf
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += float(loss.double())
            count += batch[:, 1:].numel()
    return total / count, count


def heldout_loss(
    model: torch.nn.Module,
    run_dir: str,
    seq_len: int,
    *,
    max_samples: int = 0,
    batch_size: int = 8,
    device: str = "cpu",
) -> dict:
    """Mean next-token loss of ``model`` on the held-out documents of the run in ``run_dir`` (see
    the module docstring); ``max_samples`` > 0 reads only the first that many (the first
    ``train.eval_batches × global_batch_size`` are what every regular validation read).

    Returns:
        ``{"heldout_of", "data_prefix", "split_seed", "samples", "tokens", "loss", "ppl"}``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.json`` (names it).
        ValueError: the run held out ``data.split`` or ``data.valid_prefix`` documents (the way out
            named: ``--data-prefix`` with that prefix).
        DataFormatError: its dataset is missing or corrupt (the path is relative to where the run
            was launched: run from there).
    """

    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; --heldout takes a run directory (a run's output.dir)")
    cfg = load_config(path)
    if cfg.data.split or cfg.data.valid_prefix:
        raise ValueError(
            f"{path}: the run held out data.split / data.valid_prefix documents, not data.valid_fraction's; "
            "evaluate them with --data-prefix (data.valid_prefix, or the split's dataset)"
        )
    _, valid, _ = build_train_valid(
        cfg.data.prefix,
        seq_len,
        train_samples=1,
        valid_samples=WHOLE_HELDOUT,
        valid_fraction=cfg.data.valid_fraction,
        seed=cfg.train.seed,
        split_seed=cfg.split_seed,
        blend=cfg.data.blend,
    )
    n = min(len(valid), max_samples) if max_samples else len(valid)
    loss, count = samples_loss(model, valid, n, batch_size, device)
    prefix = cfg.data.blend or cfg.data.prefix
    return {
        "heldout_of": run_dir,
        "data_prefix": prefix,
        "split_seed": cfg.split_seed,
        "samples": n,
        "tokens": count,
        "loss": loss,
        "ppl": math.exp(loss),
    }


def dataset_loss(
    model: torch.nn.Module,
    prefix: str,
    seq_len: int,
    *,
    max_samples: int = 0,
    batch_size: int = 8,
    device: str = "cpu",
    label: str = "evaluate",
) -> dict:
    """Mean next-token loss of ``model`` (a TP = 1 :class:`~megaformer.model.NormFormerLM`) on ``prefix``.

    Returns:
        ``{"data_prefix", "samples", "tokens", "loss" (nats/token), "ppl"}``.

    Raises:
        DataFormatError: a missing or corrupt dataset, or fewer tokens than one sample.
    """

    n = available_samples(prefix, seq_len)
    if max_samples:
        n = min(n, max_samples)
    samples = ordered_samples(prefix, seq_len, n, key="--data-prefix")
    loss, count = samples_loss(model, samples, n, batch_size, device, label)
    return {"data_prefix": prefix, "samples": n, "tokens": count, "loss": loss, "ppl": math.exp(loss)}


def _parser(trust_flag: str) -> argparse.ArgumentParser:
    """``evaluate``'s command line."""
    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.evaluate",
        description="Loss and perplexity of a checkpoint on .bin/.idx datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a run directory, its checkpoints/ directory or one global_stepN (with --heldout: that run's)",
    )
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument("--data-prefix", action="append", default=[], help="dataset PREFIX(.bin/.idx); repeatable")
    p.add_argument(
        "--heldout",
        default=None,
        metavar="RUN",
        help="also evaluate every held-out document the run in this directory was validated on",
    )
    p.add_argument("--max-samples", type=int, default=0, help="read at most this many samples (0: all)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        trust_flag,
        action="store_true",
        help="unpickle the checkpoint in full (it can run code): only for a source you trust",
    )
    return p


def _bad_args(args: argparse.Namespace) -> str:
    """What is wrong with the flags ('' if nothing), said before the checkpoint is read (seconds),
    in the run directory's terms; fills ``args.checkpoint`` from ``--heldout``."""
    if args.max_samples < 0 or args.batch_size < 1:
        return "--max-samples must be >= 0 and --batch-size >= 1"
    if not args.data_prefix and not args.heldout:
        return "give --data-prefix PREFIX (repeatable) or --heldout RUN"
    if args.heldout and not os.path.isfile(os.path.join(args.heldout, "config.json")):
        return (
            f"{os.path.join(args.heldout, 'config.json')}: no such file; --heldout takes a run directory "
            "(a run's output.dir)"
        )
    args.checkpoint = args.checkpoint or args.heldout
    if not args.checkpoint:
        return "--checkpoint is required with --data-prefix alone"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad checkpoint, dataset or flag."""

    args = _parser(TRUST_FLAG).parse_args(argv)
    said = _bad_args(args)
    if said:
        print(f"error: {said}", file=sys.stderr)
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
        if args.heldout:
            results.append(
                heldout_loss(
                    model,
                    args.heldout,
                    config.seq_len,
                    max_samples=args.max_samples,
                    batch_size=args.batch_size,
                    device=args.device,
                )
            )
    except (DataToolsError, CheckpointReadError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {args.checkpoint}, step {step}, seq_len {config.seq_len}")
    for r in results:
        # --heldout's row says whose held-out split it is: the prefix alone reads like the whole file
        name = (
            f"held-out split of {r['heldout_of']} ({r['data_prefix']})"
            if "heldout_of" in r
            else r["data_prefix"]
        )
        print(
            f"{name}: loss {r['loss']:.4f} nats/token | ppl {r['ppl']:.2f} | "
            f"{r['samples']} samples, {r['tokens']:,} tokens"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"checkpoint": args.checkpoint, "step": step, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
