"""Train a SentencePiece BPE tokenizer on a sample of a corpus.

    python -m data_tools.train_tokenizer --input data/*.jsonl.gz --model-prefix tok/spm32k \\
        --vocab-size 32000 --sample-bytes 200000000

reads the inputs with the same reader as ``data_tools.preprocess`` (same formats, same
``--json-keys``), takes up to ``--sample-bytes`` of text, drawing documents from the input files in
turn so that every file is represented, and trains a byte-fallback BPE model. The resulting
``{prefix}.model`` is used with ``--tokenizer-type SentencePieceTokenizer --tokenizer-model``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from data_tools.errors import DataToolsError
from data_tools.preprocess import BadRecord, Document, Record, expand_inputs, iter_records

__all__ = ["TrainTokenizerError", "main", "sample_lines", "train_tokenizer"]

# SentencePiece trains on lines ("sentences") and drops lines longer than this many bytes.
_MAX_LINE_BYTES = 16384


class TrainTokenizerError(DataToolsError):
    """Training could not run on these inputs or settings."""


def _round_robin(
    paths: Sequence[Path], json_keys: Sequence[str], split_blank_lines: bool
) -> Iterator[Record]:
    """Records of all files, one document from each file in turn (files that end drop out)."""
    readers = [iter_records([p], json_keys, split_blank_lines=split_blank_lines) for p in paths]
    while readers:
        alive = []
        for reader in readers:
            record = next(reader, None)
            if record is not None:
                yield record
                alive.append(reader)
        readers = alive


def sample_lines(
    paths: Sequence[Path],
    out_path: Path,
    sample_bytes: int,
    json_keys: Sequence[str] = ("text",),
    *,
    split_blank_lines: bool = False,
) -> tuple[int, Counter]:
    """Writes the non-blank lines of documents to ``out_path`` until ``sample_bytes`` are written.

    Whole lines only, so the sample can pass ``sample_bytes`` by up to one line.

    Returns:
        (bytes written, bad records skipped by reason).
    """
    written = 0
    skipped: Counter = Counter()
    with open(out_path, "w", encoding="utf-8", newline="\n") as out:
        for record in _round_robin(paths, json_keys, split_blank_lines):
            if isinstance(record, BadRecord):
                skipped[record.reason] += 1
                continue
            assert isinstance(record, Document)
            for text in record.texts:
                for line in text.splitlines():
                    if not line.strip():
                        continue
                    out.write(line + "\n")
                    written += len(line.encode("utf-8")) + 1
                    if written >= sample_bytes:
                        return written, skipped
    return written, skipped


def train_tokenizer(
    inputs: Sequence[str],
    model_prefix: str,
    vocab_size: int,
    *,
    sample_bytes: int = 100_000_000,
    json_keys: Sequence[str] = ("text",),
    split_blank_lines: bool = False,
    character_coverage: float = 0.9995,
) -> Path:
    """Trains ``{model_prefix}.model`` / ``.vocab`` (SentencePiece BPE with byte fallback).

    The text is not normalised (``identity``) and whitespace is kept as is, so that decoding gives
    back the original text; characters outside the learnt pieces fall back to their UTF-8 bytes,
    so nothing becomes ``<unk>``. Pieces 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (``</s>`` = EOD).

    Args:
        inputs: files, directories or globs (as ``--input`` of ``data_tools.preprocess``).
        model_prefix: output path without ``.model``.
        vocab_size: pieces in the model, including the 256 byte pieces and the 3 special ones.
        sample_bytes: UTF-8 bytes of text to train on, at most.

    Returns:
        Path of the ``.model`` file.

    Raises:
        TrainTokenizerError: no text in the inputs, or SentencePiece refuses the settings (e.g. a
            vocabulary too large for the sample).
        PreprocessError: unreadable inputs.
    """
    import sentencepiece as spm

    paths = expand_inputs(inputs)
    if vocab_size < 300:
        raise TrainTokenizerError(
            f"--vocab-size {vocab_size} is too small: 256 byte pieces + 3 special come first"
        )
    Path(model_prefix).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spm-sample-") as tmp:
        sample_path = Path(tmp) / "sample.txt"
        written, skipped = sample_lines(
            paths, sample_path, sample_bytes, json_keys, split_blank_lines=split_blank_lines
        )
        if skipped:
            print(f"skipped bad records: {dict(skipped)}", file=sys.stderr)
        if written == 0:
            raise TrainTokenizerError(f"no text found in {len(paths)} input file(s)")
        print(f"training on {written / 1e6:.2f} MB of text from {len(paths)} file(s)", file=sys.stderr)
        try:
            spm.SentencePieceTrainer.train(
                input=str(sample_path),
                model_prefix=model_prefix,
                vocab_size=vocab_size,
                model_type="bpe",
                byte_fallback=True,
                character_coverage=character_coverage,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                max_sentence_length=_MAX_LINE_BYTES,
                input_sentence_size=0,  # 0 = all lines of the sample; the sample is already bounded
                num_threads=os.cpu_count() or 1,
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=-1,
                minloglevel=1,  # warnings and errors only
            )
        except RuntimeError as e:
            raise TrainTokenizerError(f"SentencePiece training failed: {e}") from None
    return Path(model_prefix + ".model")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input)."""
    p = argparse.ArgumentParser(
        prog="python -m data_tools.train_tokenizer",
        description="Train a SentencePiece BPE (byte fallback) model on a sample of a corpus.",
    )
    p.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument(
        "--vocab-size", type=int, required=True, help="pieces, 256 byte pieces and 3 specials included"
    )
    p.add_argument("--sample-bytes", type=int, default=100_000_000, help="bytes of text to train on, at most")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys / Parquet columns of the text")
    p.add_argument("--text-split-blank-lines", action="store_true", help="plain text: documents are blocks")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        model = train_tokenizer(
            args.input,
            args.model_prefix,
            args.vocab_size,
            sample_bytes=args.sample_bytes,
            json_keys=args.json_keys,
            split_blank_lines=args.text_split_blank_lines,
            character_coverage=args.character_coverage,
        )
    except DataToolsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {model} ({args.vocab_size} pieces) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
