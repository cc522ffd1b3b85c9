"""Summarise a Megatron ``.bin``/``.idx`` pair and print one of its documents.

    python -m data_tools.inspect data/processed/c4_text_document --doc 3 \\
        --vocab-file gpt2-bpe/encoder.json --merge-file gpt2-bpe/vocab.bpe

prints the dtype, sequence/document/token counts, a histogram of document lengths (tokens, log2
buckets) and, with ``--doc``, the decoded text of that document. Decoding needs the tokenizer the
data was made with; no default is assumed, since decoding with the wrong one prints plausible garbage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from data_tools.errors import DataToolsError, TokenizerError
from data_tools.indexed_dataset import IndexedDataset
from data_tools.tokenizer import build_tokenizer

__all__ = ["length_histogram", "main"]

_BAR_WIDTH = 50


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """Counts of lengths in log2 buckets ``[2**k, 2**(k+1))``, plus ``[0, 1)`` for empty documents.

    Args:
        lengths: int[D] document lengths in tokens.

    Returns:
        ``(low, high, count)`` for every bucket from the smallest to the largest occupied one
        (empty buckets in between included, so the chart's rows are evenly spaced).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return []
    # bucket 0 holds length 0; bucket k + 1 holds [2**k, 2**(k+1))
    buckets = np.zeros(lengths.shape, dtype=np.int64)
    positive = lengths > 0
    buckets[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
    counts = np.bincount(buckets)
    occupied = np.flatnonzero(counts)
    rows = []
    for b in range(int(occupied[0]), int(occupied[-1]) + 1):
        low, high = (0, 1) if b == 0 else (1 << (b - 1), 1 << b)
        rows.append((low, high, int(counts[b])))
    return rows


def _print_histogram(rows: list[tuple[int, int, int]]) -> None:
    peak = max((c for _, _, c in rows), default=1)
    for low, high, count in rows:
        bar = "#" * round(_BAR_WIDTH * count / peak) if count else ""
        if count and not bar:
            bar = "."  # a non-empty bucket too small for one '#'
        print(f"  [{low:>9,}, {high:>9,})  {count:>11,}  {bar}")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data_tools.inspect", description="Summarise a Megatron .bin/.idx dataset."
    )
    p.add_argument("prefix", help="dataset path without .bin/.idx (a .bin or .idx path also works)")
    p.add_argument("--doc", type=int, help="print the decoded text of this document (0-based)")
    p.add_argument("--vocab-file", help="GPT-2 encoder.json / vocab.json (to decode)")
    p.add_argument("--merge-file", help="GPT-2 vocab.bpe / merges.txt (to decode)")
    p.add_argument("--tokenizer-model", help="SentencePiece .model (to decode)")
    return p.parse_args(argv)


def _tokenizer_for(args: argparse.Namespace):
    if args.tokenizer_model and (args.vocab_file or args.merge_file):
        raise TokenizerError("give either --tokenizer-model or --vocab-file/--merge-file, not both")
    if args.tokenizer_model:
        return build_tokenizer("SentencePieceTokenizer", tokenizer_model=args.tokenizer_model)
    if args.vocab_file or args.merge_file:
        return build_tokenizer("GPT2BPETokenizer", vocab_file=args.vocab_file, merge_file=args.merge_file)
    raise TokenizerError(
        f"decoding document {args.doc} needs the tokenizer the data was made with: --vocab-file and "
        "--merge-file (GPT-2 BPE) or --tokenizer-model (SentencePiece)"
    )


def inspect(args: argparse.Namespace) -> None:
    """Prints the summary (and document ``args.doc``) of the dataset at ``args.prefix``.

    Raises:
        DataFormatError: the files are not a valid pair.
        TokenizerError: ``--doc`` without usable tokenizer flags.
        IndexError: ``--doc`` out of range.
    """
    prefix = args.prefix
    if prefix.endswith((".bin", ".idx")):
        prefix = prefix[:-4]
    # The tokenizer first: a missing flag should not wait for a large index to be checked.
    tokenizer = _tokenizer_for(args) if args.doc is not None else None
    ds = IndexedDataset(prefix)
    doc_lengths = ds.document_lengths()
    print(f"dataset:   {prefix}")
    print(f"dtype:     {ds.dtype.name}")
    print(f"sequences: {len(ds):,}")
    print(f"documents: {ds.num_documents:,}")
    print(f"tokens:    {ds.num_tokens:,}")
    if doc_lengths.size:
        print(
            f"document length (tokens): min {doc_lengths.min():,}, median {int(np.median(doc_lengths)):,}, "
            f"mean {doc_lengths.mean():,.1f}, max {doc_lengths.max():,}"
        )
        print("document length histogram (tokens, log2 buckets):")
        _print_histogram(length_histogram(doc_lengths))
    if tokenizer is not None:
        seqs = ds.document_sequences(args.doc)
        tokens = np.concatenate([ds.get(i) for i in seqs]) if len(seqs) else np.zeros(0, ds.dtype)
        if tokens.size and int(tokens.max()) >= tokenizer.vocab_size:
            raise TokenizerError(
                f"document {args.doc} has token id {int(tokens.max())}, beyond the tokenizer's vocabulary "
                f"of {tokenizer.vocab_size}; the data was made with another tokenizer"
            )
        print(f"document {args.doc}: sequences {seqs.start}..{seqs.stop - 1}, {tokens.size:,} tokens")
        print("-" * 72)
        print(tokenizer.decode(tokens.tolist()))
        print("-" * 72)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input)."""
    args = _parse_args(argv)
    try:
        inspect(args)
    except (DataToolsError, FileNotFoundError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `... | head`: the reader has gone; stop quietly (and keep Python's exit-time flush quiet)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
