"""Build the sample indices of a run ahead of time, into a cache directory (e.g. on each node).

    python -m data_tools.build_index --data-prefix data/c4_text_document --seq-len 2048 \\
        --seed 1234 --num-samples 54000000 --output-dir /local/index_cache

writes ``{name}_{key}_{doc,sample,shuffle}_idx.npy`` (see :mod:`data_tools.sample_index`). A training
run whose ``data.index_cache_dir`` points there with the same dataset, seed, ``seq_len`` and sample
count loads them by memory map instead of building them. To match the trainer's split, pass its
``data.valid_fraction`` with ``--valid-fraction`` (and its ``data.split_seed`` with ``--split-seed``
when set; ``--split train``: ``train.steps × global_batch_size`` samples; ``--split valid``: the
evaluation's samples, unshuffled). Without
``--valid-fraction`` the index covers every document. Already cached: nothing is rebuilt.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

from data_tools.errors import DataToolsError
from data_tools.indexed_dataset import IndexedDataset
from data_tools.sample_index import load_or_build, split_documents

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; 0 ok, 2 bad input."""
    p = argparse.ArgumentParser(prog="python -m data_tools.build_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-prefix", required=True, help="dataset PREFIX (PREFIX.bin/.idx)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample input (+1 per sample)")
    p.add_argument("--seed", type=int, required=True, help="the run's train.seed")
    n = p.add_mutually_exclusive_group(required=True)
    n.add_argument("--num-samples", type=int, help="samples to index")
    n.add_argument("--num-epochs", type=int, help="index this many whole epochs of the documents")
    p.add_argument("--output-dir", required=True, help="cache directory (created if missing)")
    p.add_argument("--valid-fraction", type=float, default=None, help="the run's data.valid_fraction")
    p.add_argument("--split", choices=["train", "valid"], default="train", help="with --valid-fraction")
    p.add_argument(
        "--split-seed",
        type=int,
        default=None,
        help="the run's data.split_seed (default, or negative as the config's -1: --seed)",
    )
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        dataset = IndexedDataset(args.data_prefix)
        lengths = dataset.document_lengths(np.int64 if args.valid_fraction is not None else np.int32)
        doc_ids = None
        if args.valid_fraction is not None:
            by = args.seed if args.split_seed is None or args.split_seed < 0 else args.split_seed
            train_ids, valid_ids = split_documents(lengths.size, args.valid_fraction, by)
            doc_ids = train_ids if args.split == "train" else valid_ids
        if args.num_samples is not None:
            num_samples = args.num_samples
        else:
            tokens = int(np.sum(lengths if doc_ids is None else lengths[doc_ids], dtype=np.int64))
            num_samples = (args.num_epochs * tokens - 1) // args.seq_len
        index = load_or_build(
            dataset,
            seq_len=args.seq_len,
            num_samples=num_samples,
            seed=args.seed,
            shuffle=args.split == "train",
            doc_ids=doc_ids,
            cache_dir=args.output_dir,
            doc_lengths=lengths,
        )
    except (DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if index.paths is None:  # load_or_build warned why: the cache directory cannot be written
        print(
            f"error: {args.output_dir}: the index could not be saved there; choose a writable --output-dir",
            file=sys.stderr,
        )
        return 2
    what = "already cached" if index.cache_hit else "built"
    print(
        f"done: {what}: {num_samples:,} samples of {args.seq_len + 1} tokens over "
        f"{index.doc_idx.size:,} document positions in {time.perf_counter() - start:.1f} s"
    )
    for path in index.paths:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
