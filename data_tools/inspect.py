"""Summarise a Megatron ``.bin``/``.idx`` pair and print one of its documents.

    python -m data_tools.inspect data/processed/c4_text_document --doc 3 \\
        --vocab-file gpt2-bpe/encoder.json --merge-file gpt2-bpe/vocab.bpe

prints the dtype, sequence/document/token counts, a histogram of document lengths (tokens, log2
buckets) and, with ``--doc``, the decoded text of that document: its first ``--max-tokens`` tokens
(default 512; ``--full`` prints all of it). Without tokenizer flags it decodes with GPT-2 BPE from
``data/gpt2-bpe`` (as ``megaformer.tools.generate`` does), unless the dataset's statistics sidecar
says it was made with another tokenizer type: then it asks for that tokenizer's files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_tools.errors import DataToolsError, TokenizerError
from data_tools.indexed_dataset import IndexedDataset, dataset_prefix
from data_tools.tokenizer import build_tokenizer

__all__ = ["length_histogram", "main"]

_BAR_WIDTH = 50
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_VOCAB = str(_REPO / "data" / "gpt2-bpe" / "encoder.json")
DEFAULT_MERGES = str(_REPO / "data" / "gpt2-bpe" / "vocab.bpe")


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
    p.add_argument("--vocab-file", help=f"GPT-2 encoder.json / vocab.json (default: {DEFAULT_VOCAB})")
    p.add_argument("--merge-file", help=f"GPT-2 vocab.bpe / merges.txt (default: {DEFAULT_MERGES})")
    p.add_argument("--tokenizer-model", help="SentencePiece .model (to decode)")
    p.add_argument(
        "--max-tokens", type=int, default=512, help="decode at most this many tokens of --doc (default 512)"
    )
    p.add_argument("--full", action="store_true", help="decode the whole document")
    return p.parse_args(argv)


def _tokenizer_for(args: argparse.Namespace, prefix: str):
    if args.tokenizer_model and (args.vocab_file or args.merge_file):
        raise TokenizerError("give either --tokenizer-model or --vocab-file/--merge-file, not both")
    if args.tokenizer_model:
        return build_tokenizer("SentencePieceTokenizer", tokenizer_model=args.tokenizer_model)
    if not (args.vocab_file or args.merge_file):
        made_with = _sidecar_tokenizer_type(prefix)
        if made_with not in (None, "unknown", "GPT2BPETokenizer"):
            raise TokenizerError(
                f"{prefix}: made with {made_with} ({prefix}.stats.json), so the default GPT-2 files "
                "would decode garbage: pass --tokenizer-model (SentencePiece) or --vocab-file and "
                "--merge-file"
            )
    vocab = args.vocab_file or DEFAULT_VOCAB
    merges = args.merge_file or DEFAULT_MERGES
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


def _sidecar_tokenizer_type(prefix: str) -> str | None:
    """The tokenizer type the statistics sidecar records, or None without a readable sidecar."""
    try:
        with open(f"{prefix}.stats.json", encoding="utf-8") as f:
            return json.load(f).get("tokenizer", {}).get("type")
    except (OSError, ValueError, AttributeError):
        return None


def inspect(args: argparse.Namespace) -> None:
    """Prints the summary (and document ``args.doc``) of the dataset at ``args.prefix``.

    Raises:
        DataFormatError: the files are not a valid pair.
        TokenizerError: ``--doc`` without usable tokenizer flags.
        IndexError: ``--doc`` out of range.
    """
    prefix = dataset_prefix(args.prefix)
    # The tokenizer first: a missing flag should not wait for a large index to be checked.
    tokenizer = _tokenizer_for(args, prefix) if args.doc is not None else None
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
        shown = tokens if args.full else tokens[: max(args.max_tokens, 0)]
        print(tokenizer.decode(shown.tolist()))
        print("-" * 72)
        if shown.size < tokens.size:
            print(
                f"[truncated: the first {shown.size:,} of {tokens.size:,} tokens; --full prints all of them]"
            )


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
