"""Hold out a number of tokens, whole documents chosen by seed, into their own ``.bin``/``.idx``.

    python -m data_tools.split --data-prefix data/c4_text_document --holdout-tokens 40000000 \\
        --seed 1234 --holdout-prefix data/c4_valid_text_document \\
        --train-prefix data/c4_train_text_document

The held-out documents are the shortest prefix of a seeded permutation of all documents that holds
at least ``--holdout-tokens`` tokens (40M by default, the NormFormer paper's validation size); the
rest is the training set. Both outputs keep the input's document order and are written one
document per sequence (the layout ``preprocess`` writes, so for its outputs the bytes of a
document are unchanged). Tokens are copied in blocks from the memory-mapped input, never loaded
whole; outputs are written under ``.tmp`` names and renamed when complete.

Both outputs get their statistics sidecar (``{prefix}.stats.json``, see :mod:`data_tools.stats`),
counted from the blocks as they are copied (no extra read). The EOD id and tokenizer are taken from
the input's sidecar; an input without one gives outputs whose sidecars record neither (a note says
so: run ``python -m data_tools.stats`` on the input first to keep them).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import numpy as np

from data_tools.atomic import sigterm_as_interrupt, write_error
from data_tools.errors import DataFormatError, DataToolsError
from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data_tools.stats import UNKNOWN_TOKENIZER, StatsAccumulator, read_stats, write_stats

__all__ = ["choose_holdout", "main", "split_dataset"]

DEFAULT_HOLDOUT_TOKENS = 40_000_000
_COPY_TOKENS = 8 << 20  # tokens per copy from the input memmap (16 MB of uint16)


def choose_holdout(doc_lengths: np.ndarray, holdout_tokens: int, seed: int) -> np.ndarray:
    """Boolean mask[D]: the held-out documents (vectorised: one permutation, one cumsum, one search).

    Args:
        doc_lengths: tokens per document, integer array of shape [D].
        holdout_tokens: tokens wanted in the held-out set (it gets at least that, by whole documents).
        seed: seeds the permutation.

    Raises:
        DataFormatError: ``holdout_tokens`` not positive, or not less than the dataset's tokens
            (nothing would be left to train on).
    """
    total = int(np.sum(doc_lengths, dtype=np.int64))
    if holdout_tokens <= 0 or holdout_tokens >= total:
        raise DataFormatError(
            f"--holdout-tokens {holdout_tokens}: expected between 1 and {total - 1} "
            f"(the dataset holds {total} tokens); lower it"
        )
    perm = np.random.default_rng([seed, 0x401D]).permutation(doc_lengths.size)
    cum = np.cumsum(doc_lengths[perm], dtype=np.int64)
    k = int(np.searchsorted(cum, holdout_tokens, side="left")) + 1  # fewest documents reaching N
    mask = np.zeros(doc_lengths.size, dtype=bool)
    mask[perm[:k]] = True
    return mask


def _copy(
    writer: IndexedDatasetWriter,
    acc: StatsAccumulator,
    tokens: np.ndarray,
    ends: np.ndarray,
    lengths: np.ndarray,
    a: int,
    b: int,
):
    """Appends documents [a, b) to ``writer`` (and counts them in ``acc``) in blocks of about
    ``_COPY_TOKENS`` tokens."""
    while a < b:
        first = int(ends[a] - lengths[a])
        # last document ending within the block (at least one, however long)
        j = a + max(1, int(np.searchsorted(ends[a:b], first + _COPY_TOKENS, side="right")))
        block = np.asarray(tokens[first : int(ends[j - 1])])
        writer.add_documents(block, lengths[a:j])
        acc.add_documents(block, lengths[a:j])
        a = j


def split_dataset(
    prefix: str, holdout_tokens: int, seed: int, holdout_prefix: str, train_prefix: str
) -> dict[str, int]:
    """Writes the held-out and the training datasets; returns their document and token counts.

    Raises:
        DataFormatError: a missing or corrupt input (named), or a holdout size it cannot give.
    """
    from tqdm import tqdm

    dataset = IndexedDataset(prefix)
    try:
        source = read_stats(prefix)
        eod, tokenizer = source.eod_token, source.tokenizer
    except DataFormatError as e:
        print(
            f"note: {str(e).split(';')[0]}: the outputs' sidecars record no EOD id and an unknown "
            f"tokenizer (first run python -m data_tools.stats --data-prefix {prefix} --eod-token ... "
            "--tokenizer-type ... to keep them)",
            file=sys.stderr,
        )
        eod, tokenizer = None, dict(UNKNOWN_TOKENIZER)
    lengths = dataset.document_lengths(np.int32 if len(dataset) < 2**31 else np.int64)
    mask = choose_holdout(lengths, holdout_tokens, seed)
    ends = np.cumsum(lengths, dtype=np.int64)  # sequences are contiguous: document d is [end-len, end)
    tokens = np.memmap(dataset.bin_path, dtype=dataset.dtype, mode="r")
    # Runs of consecutive documents on the same side: about 2 per held-out document, so the Python
    # loop below is over runs, and each run is copied in large blocks.
    cuts = np.flatnonzero(np.diff(mask)) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [mask.size]])
    writers = {
        True: IndexedDatasetWriter(holdout_prefix, dataset.dtype),
        False: IndexedDatasetWriter(train_prefix, dataset.dtype),
    }
    out_prefixes = {True: holdout_prefix, False: train_prefix}
    accs = {side: StatsAccumulator(eod, where=out) for side, out in out_prefixes.items()}
    try:
        with tqdm(
            total=int(ends[-1]), unit=" tok", unit_scale=True, desc="splitting", disable=None, file=sys.stderr
        ) as bar:
            for a, b in zip(starts.tolist(), stops.tolist()):
                side = bool(mask[a])
                _copy(writers[side], accs[side], tokens, ends, lengths, a, b)
                bar.update(int(ends[b - 1] - ends[a] + lengths[a]))
        for side, w in writers.items():
            stats = accs[side].finish(tokenizer)
            # the sidecar before the .idx: an output that looks finished has its statistics
            w.finalize(before_index=functools.partial(write_stats, out_prefixes[side], stats))
    except BaseException as e:
        for w in writers.values():
            w.abort()
        if isinstance(e, OSError) and (err := write_error(e, f"{holdout_prefix} / {train_prefix}")):
            raise err from None
        raise
    return {
        "holdout_documents": int(mask.sum()),
        "holdout_tokens": int(lengths[mask].sum(dtype=np.int64)),
        "train_documents": int((~mask).sum()),
        "train_tokens": int(lengths[~mask].sum(dtype=np.int64)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; 0 ok, 2 bad input, 130 interrupted."""
    p = argparse.ArgumentParser(prog="python -m data_tools.split", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-prefix", required=True, help="input dataset (PREFIX.bin/.idx)")
    p.add_argument(
        "--holdout-tokens", type=int, default=DEFAULT_HOLDOUT_TOKENS, help="tokens to hold out (default 40M)"
    )
    p.add_argument("--seed", type=int, default=1234, help="seeds the choice of documents")
    p.add_argument("--holdout-prefix", required=True, help="writes the held-out documents here")
    p.add_argument("--train-prefix", required=True, help="writes the other documents here")
    args = p.parse_args(argv)
    try:
        sigterm_as_interrupt()  # a scheduler's kill removes the .tmp files like Ctrl-C does
        counts = split_dataset(
            args.data_prefix, args.holdout_tokens, args.seed, args.holdout_prefix, args.train_prefix
        )
    except (DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    print(
        f"done: held out {counts['holdout_documents']:,} documents / {counts['holdout_tokens']:,} tokens, "
        f"kept {counts['train_documents']:,} documents / {counts['train_tokens']:,} tokens"
    )
    print(f"wrote {args.holdout_prefix}.bin/.idx/.stats.json and {args.train_prefix}.bin/.idx/.stats.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
