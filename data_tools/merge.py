"""Concatenate ``.bin``/``.idx`` datasets (e.g. the shards of ``preprocess --num-shards``) into one.

    python -m data_tools.merge --input data/c4-*-of-00004_text_document \\
        --output-prefix data/c4_text_document

The result is Megatron-compatible and, for the shards of one sharded preprocessing run given in
shard order, byte-identical to preprocessing all the inputs in one run. Tokens are copied file to
file in blocks (never loaded whole); the index is written one input at a time, so memory is one
input's index arrays. Output goes to ``.tmp`` names, renamed when complete.

The output's statistics sidecar (``{output_prefix}.stats.json``, see :mod:`data_tools.stats`) is
the sum of the inputs' sidecars; an input without a usable one (made before sidecars existed, or
stale) is counted from its tokens first (one read of it), checking document ends against
``--eod-token`` or, by default, the EOD id of the inputs that have sidecars.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_tools.atomic import sigterm_as_interrupt, write_error
from data_tools.errors import DataFormatError, DataToolsError
from data_tools.indexed_dataset import (
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    IndexedDataset,
    dataset_prefix,
)
from data_tools.stats import DatasetStats, compute_stats, merge_stats, read_stats, stats_path, write_stats

__all__ = ["expand_prefixes", "main", "merge"]

_COPY_BLOCK = 16 << 20  # bytes per copy of the token stream


def expand_prefixes(inputs: Sequence[str]) -> list[str]:
    """Dataset prefixes from arguments that are prefixes, ``.bin``/``.idx`` paths or globs of them;
    each glob sorted (zero-padded shard numbers then sort in shard order), duplicates refused.

    Raises:
        DataFormatError: an argument that names no dataset, or a dataset named twice.
    """
    prefixes: list[str] = []
    for arg in inputs:
        base = dataset_prefix(arg)
        if os.path.isfile(base + ".idx"):
            found = [base]
        else:
            found = sorted(p[:-4] for p in glob.glob(base + ".idx")) or sorted(
                p[:-4] for p in glob.glob(base) if p.endswith(".idx")
            )
        if not found:
            raise DataFormatError(f"{arg}: no dataset found ({base}.idx does not exist and no glob matches)")
        prefixes.extend(found)
    if len(set(prefixes)) != len(prefixes):
        dup = next(p for p in prefixes if prefixes.count(p) > 1)
        raise DataFormatError(f"{dup}: named twice; each dataset would be merged twice")
    return prefixes


def input_stats(prefixes: Sequence[str], eod_token: int | None = None) -> list[DatasetStats]:
    """Each input's statistics: its sidecar or, where that is missing, stale or unreadable, counted
    from its tokens (a note on stderr says which).

    Args:
        eod_token: EOD id checked in the inputs counted here; ``None``: the EOD id that the inputs
            with sidecars share, if they share one (else no check).

    Raises:
        DataFormatError: a corrupt input.
    """
    found: dict[str, DatasetStats] = {}
    missing: dict[str, str] = {}
    for prefix in prefixes:
        try:
            found[prefix] = read_stats(prefix)
        except DataFormatError as e:
            missing[prefix] = str(e).split(";")[0]
    if eod_token is None:
        eods = {s.eod_token for s in found.values()}
        eod_token = eods.pop() if len(eods) == 1 else None
    for prefix, why in missing.items():
        print(f"{why}; counting the tokens of {prefix}", file=sys.stderr)
        found[prefix] = compute_stats(prefix, eod_token=eod_token, progress=True)
    return [found[p] for p in prefixes]


def _concatenate_bins(datasets: Sequence[IndexedDataset], bin_tmp: Path) -> None:
    """Copy the inputs' ``.bin`` files one after another into ``bin_tmp`` (a progress bar in bytes)."""
    from tqdm import tqdm

    total_bytes = sum(d.bin_path.stat().st_size for d in datasets)
    with (
        open(bin_tmp, "wb") as out,
        tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="merging", disable=None, file=sys.stderr
        ) as bar,
    ):
        for d in datasets:
            with open(d.bin_path, "rb") as f:
                while block := f.read(_COPY_BLOCK):
                    out.write(block)
                    bar.update(len(block))


def _write_merged_index(
    datasets: Sequence[IndexedDataset], idx_tmp: Path, code: int, n_seq: int, n_docs: int
) -> None:
    """Megatron's ``.idx`` of the concatenation, by sections: the header, all lengths, then all
    pointers (shifted by the bytes before each input), then all document indices (shifted by the
    sequences before each input)."""
    itemsize = datasets[0].dtype.itemsize
    with open(idx_tmp, "wb") as out:
        out.write(struct.pack("<9sQBQQ", MAGIC, VERSION, code, n_seq, n_docs + 1))
        for d in datasets:
            out.write(np.asarray(d.sequence_lengths, dtype="<i4").tobytes())
        byte_offset = 0
        for d in datasets:
            out.write((np.asarray(d.sequence_pointers, dtype="<i8") + byte_offset).tobytes())
            byte_offset += d.num_tokens * itemsize
        seq_offset = 0
        out.write(np.zeros(1, dtype="<i8").tobytes())
        for d in datasets:
            out.write((np.asarray(d.document_indices[1:], dtype="<i8") + seq_offset).tobytes())
            seq_offset += len(d)


def merge(prefixes: Sequence[str], output_prefix: str, eod_token: int | None = None) -> tuple[int, int]:
    """Writes ``output_prefix.bin/.idx`` and its statistics sidecar, the datasets one after another;
    returns (documents, tokens).

    Each input is validated on open (``IndexedDataset``); all must share a token dtype. The sidecar
    is the sum of the inputs' statistics (``input_stats``, given ``eod_token``), written after the
    ``.bin`` and before the ``.idx`` is renamed into place.

    Raises:
        DataFormatError: no inputs, a corrupt input, mixed dtypes, or an output that is an input.
    """
    if not prefixes:
        raise DataFormatError("no datasets to merge")
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {d.dtype for d in datasets}
    if len(dtypes) != 1:
        found = ", ".join(f"{p}: {d.dtype.name}" for p, d in zip(prefixes, datasets))
        raise DataFormatError(f"expected one token dtype for all inputs, found {found}")
    code = next(c for c, d in DTYPE_CODES.items() if d == datasets[0].dtype)
    bin_path, idx_path = Path(output_prefix + ".bin"), Path(output_prefix + ".idx")
    if any(os.path.abspath(p) == os.path.abspath(output_prefix) for p in prefixes):
        raise DataFormatError(f"{output_prefix}: the output is also an input; choose another --output-prefix")
    n_seq = sum(len(d) for d in datasets)
    n_docs = sum(d.num_documents for d in datasets)
    parts = input_stats(prefixes, eod_token)
    stats = merge_stats(parts)
    if stats.tokenizer.get("type") == "unknown" and any(p.tokenizer.get("type") != "unknown" for p in parts):
        print(
            f"note: the inputs' sidecars name different tokenizers (or none); {stats_path(output_prefix)} "
            "records the tokenizer as unknown",
            file=sys.stderr,
        )
    bin_tmp, idx_tmp = Path(f"{bin_path}.tmp"), Path(f"{idx_path}.tmp")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    bin_moved = False
    try:
        _concatenate_bins(datasets, bin_tmp)
        _write_merged_index(datasets, idx_tmp, code, n_seq, n_docs)
        assert idx_tmp.stat().st_size == HEADER_SIZE + 12 * n_seq + 8 * (n_docs + 1)
        idx_path.unlink(missing_ok=True)  # no old .idx next to the new .bin in between
        os.replace(bin_tmp, bin_path)
        bin_moved = True
        write_stats(output_prefix, stats)  # before the .idx: a finished-looking dataset has its sidecar
        os.replace(idx_tmp, idx_path)
    except BaseException as e:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
        if bin_moved:  # a .bin without its .idx is not left under the final name
            bin_path.unlink(missing_ok=True)
        if isinstance(e, OSError) and (err := write_error(e, output_prefix)) is not None:
            raise err from None
        raise
    return n_docs, sum(d.num_tokens for d in datasets)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; 0 ok, 2 bad input, 130 interrupted."""
    p = argparse.ArgumentParser(prog="python -m data_tools.merge", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", nargs="+", required=True, help="dataset prefixes, .idx/.bin paths or globs, in order"
    )
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.stats.json"
    )
    p.add_argument(
        "--eod-token",
        type=int,
        default=None,
        help="EOD id to check in inputs without a statistics sidecar (default: the one the inputs' "
        "sidecars name)",
    )
    args = p.parse_args(argv)
    try:
        sigterm_as_interrupt()  # a scheduler's kill removes the .tmp files like Ctrl-C does
        prefixes = expand_prefixes(args.input)
        docs, tokens = merge(prefixes, args.output_prefix, args.eod_token)
    except (DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    print(f"done: merged {len(prefixes)} datasets, {docs:,} documents, {tokens:,} tokens")
    print(f"wrote {args.output_prefix}.bin, {args.output_prefix}.idx and {stats_path(args.output_prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
