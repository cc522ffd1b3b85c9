"""Dataset statistics sidecar: ``{prefix}.stats.json`` beside each ``{prefix}.bin``/``.idx`` pair.

Computed once, when the dataset is written (``preprocess``, ``merge``, ``split``), so that nothing at
training time has to read the token stream (220 GB for 110B tokens) to know, e.g., the unigram
entropy of the corpus or its largest token id. For a dataset made before sidecars existed::

    python -m data_tools.stats --data-prefix data/processed/c4_text_document --eod-token 50256 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-bpe/encoder.json \\
        --merge-file gpt2-bpe/vocab.bpe

scans the ``.bin`` once, in chunks (bounded memory), and writes the sidecar. The file is JSON::

    {
      "format_version": 1,
      "num_tokens": 4931316,            # tokens in .bin (EODs included)
      "num_documents": 21,              # documents in .idx
      "min_token_id": 0,                # -1 for an empty dataset
      "max_token_id": 50256,            # -1 for an empty dataset
      "eod_token": 50256,               # the id --append-eod appended; null if none / unknown
      "documents_end_with_eod": true,   # every document's last token is eod_token; null if unknown
      "tokenizer": {"type": "GPT2BPETokenizer", "vocab_size": 50257,
                    "files": {"encoder.json": "<sha256>", "vocab.bpe": "<sha256>"}},
      "unigram_entropy": 6.656,         # nats, for people reading the file; recomputed on load
      "unigram_counts": [..]            # int[max_token_id + 1]: occurrences of each id
    }

A sidecar is checked against its ``.idx`` when read: one whose token or document count disagrees
(the dataset was rewritten after it) is refused as stale, with the command that recomputes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.atomic import sigterm_as_interrupt, write_error
from data_tools.errors import DataFormatError, DataToolsError
from data_tools.files import atomic_write_text
from data_tools.indexed_dataset import DTYPE_CODES, HEADER_SIZE, MAGIC, IndexedDataset

__all__ = [
    "FORMAT_VERSION",
    "UNKNOWN_TOKENIZER",
    "DatasetStats",
    "StatsAccumulator",
    "build_parser",
    "compute_stats",
    "describe_tokenizer",
    "main",
    "merge_stats",
    "mixture_unigram_entropy",
    "read_stats",
    "sparse_counts",
    "stats_command",
    "stats_path",
    "tokenizer_entry",
    "write_stats",
]

FORMAT_VERSION = 1
UNKNOWN_TOKENIZER: dict[str, Any] = {"type": "unknown"}
# Tokens per read of the .bin scan: 8 MB of uint16, and np.bincount's int64 copy of it is 32 MB,
# so the scan's memory is ~40 MB whatever the dataset size.
_SCAN_TOKENS = 1 << 22
# Documents per block of end offsets in the EOD check (8 MB of int64 each, plus their ids).
_DOC_BLOCK = 1 << 20
_HASH_BLOCK = 1 << 20


def stats_path(prefix: str | os.PathLike[str]) -> str:
    """``{prefix}.stats.json``: where the sidecar of dataset ``prefix`` (path without .bin/.idx) lives."""
    return os.fspath(prefix) + ".stats.json"


def stats_command(prefix: str | os.PathLike[str]) -> str:
    """The command that (re)computes the sidecar of ``prefix``, for error messages."""
    return (
        f"python -m data_tools.stats --data-prefix {os.fspath(prefix)} [--eod-token 50256] "
        "[--tokenizer-type GPT2BPETokenizer --vocab-file encoder.json --merge-file vocab.bpe] "
        "(--eod-token: the id --append-eod appended at preprocessing; the tokenizer flags: the files "
        "it was tokenized with)"
    )


def _entropy(p: np.ndarray) -> float:
    """Entropy in nats of a probability vector (zeros skipped)."""
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class DatasetStats:
    """What one pass over a dataset's tokens tells, saved as ``{prefix}.stats.json``.

    Attributes:
        num_tokens: tokens in ``.bin`` (EODs included).
        num_documents: documents in ``.idx`` (``D - 1``).
        max_token_id: largest id present; -1 for an empty dataset.
        min_token_id: smallest id present; -1 for an empty dataset.
        eod_token: the EOD id appended to every document at preprocessing (``--append-eod``);
            ``None`` when none was appended or it is not known.
        documents_end_with_eod: whether every document's last token is ``eod_token`` (an empty
            document does not); ``None`` when ``eod_token`` is ``None``.
        tokenizer: ``{"type", "vocab_size", "files": {file name: sha256 hex}}`` of the tokenizer
            that made the ids, or ``{"type": "unknown"}``.
        unigram_counts: int[max_token_id + 1], occurrences of each id (a tuple: the object is
            immutable; ``counts()`` gives it as an int64 array).
        format_version: version of the sidecar layout, ``FORMAT_VERSION``.

    Raises:
        ValueError: counts that do not add up to ``num_tokens`` or do not match the min/max ids,
            or an ``eod_token`` without ``documents_end_with_eod`` (and the other way round).
    """

    num_tokens: int
    num_documents: int
    max_token_id: int
    min_token_id: int
    eod_token: int | None
    documents_end_with_eod: bool | None
    tokenizer: dict[str, Any]
    unigram_counts: tuple[int, ...] = field(repr=False)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        counts = self.unigram_counts
        if len(counts) != self.max_token_id + 1:
            raise ValueError(
                f"unigram_counts has {len(counts)} entries, expected max_token_id + 1 = "
                f"{self.max_token_id + 1}"
            )
        if sum(counts) != self.num_tokens:
            raise ValueError(f"unigram_counts sum to {sum(counts)}, but num_tokens is {self.num_tokens}")
        if any(c < 0 for c in counts):
            raise ValueError("unigram_counts has a negative count")
        present = [i for i in (self.min_token_id, self.max_token_id) if i >= 0]
        if self.num_tokens and (
            self.min_token_id < 0 or any(counts[i] == 0 for i in present) or any(counts[: self.min_token_id])
        ):
            raise ValueError(
                f"min_token_id {self.min_token_id} / max_token_id {self.max_token_id} disagree with "
                "unigram_counts"
            )
        if not self.num_tokens and (self.min_token_id, self.max_token_id) != (-1, -1):
            raise ValueError("an empty dataset has min_token_id = max_token_id = -1")
        if (self.eod_token is None) != (self.documents_end_with_eod is None):
            raise ValueError(
                f"eod_token {self.eod_token} and documents_end_with_eod {self.documents_end_with_eod}: "
                "both are known or both are None"
            )

    def counts(self) -> np.ndarray:
        """``unigram_counts`` as int64[max_token_id + 1]."""
        return np.asarray(self.unigram_counts, dtype=np.int64)

    @cached_property
    def unigram_entropy(self) -> float:
        """Entropy in nats of the empirical unigram distribution ``counts / num_tokens`` (0.0 if empty).

        The loss of a model that ignores context can do no better, so it is the reference level a
        trained LM's loss must end well below.
        """
        if not self.num_tokens:
            return 0.0
        return _entropy(self.counts() / self.num_tokens)

    def to_json_text(self) -> str:
        """The sidecar's text: the scalar fields indented, the counts on one line at the end."""
        head = {
            "format_version": self.format_version,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "min_token_id": self.min_token_id,
            "max_token_id": self.max_token_id,
            "eod_token": self.eod_token,
            "documents_end_with_eod": self.documents_end_with_eod,
            "tokenizer": self.tokenizer,
            "unigram_entropy": self.unigram_entropy,
        }
        # One line for the counts: 50k of them indented one per line would be 50k lines.
        text = json.dumps(head, indent=2)
        counts = json.dumps(list(self.unigram_counts), separators=(",", ":"))
        return text[:-2] + f',\n  "unigram_counts": {counts}\n}}\n'

    @classmethod
    def from_json(cls, obj: Any) -> DatasetStats:
        """Parses a sidecar's JSON object.

        Raises:
            ValueError: a missing field, a value of the wrong type, another format version, or
                counts that do not add up (see the class).
        """
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"expected format_version {FORMAT_VERSION}, found {version!r}")

        def get(key: str, kinds: tuple[type, ...], nullable: bool = False) -> Any:
            if key not in obj:
                raise ValueError(f"no {key!r} field")
            value = obj[key]
            if value is None and nullable:
                return None
            # bool is an int in Python: refuse true where a count is expected, and the other way round
            if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
                raise ValueError(f"{key!r} is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")
            return value

        counts = get("unigram_counts", (list,))
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
            raise ValueError("'unigram_counts' holds a value that is not an integer")
        tokenizer = get("tokenizer", (dict,))
        if not isinstance(tokenizer.get("type"), str):
            raise ValueError(f"'tokenizer' has no string 'type': {tokenizer!r}")
        return cls(
            num_tokens=get("num_tokens", (int,)),
            num_documents=get("num_documents", (int,)),
            max_token_id=get("max_token_id", (int,)),
            min_token_id=get("min_token_id", (int,)),
            eod_token=get("eod_token", (int,), nullable=True),
            documents_end_with_eod=get("documents_end_with_eod", (bool,), nullable=True),
            tokenizer=tokenizer,
            unigram_counts=tuple(counts),
        )


# ----------------------------------------------------------------------------- tokenizer description


def _sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def describe_tokenizer(
    tokenizer_type: str, vocab_size: int, files: Iterable[str | os.PathLike[str]]
) -> dict[str, Any]:
    """The sidecar's ``tokenizer`` entry: ``{"type", "vocab_size", "files": {name: sha256}}``.

    Args:
        tokenizer_type: Megatron's ``--tokenizer-type`` name, e.g. ``"GPT2BPETokenizer"``.
        vocab_size: entries of the vocabulary (50257 for GPT-2).
        files: the tokenizer's files (vocabulary and merges, or the SentencePiece model); each is
            recorded under its file name (the path it was read from, if two share a name) with the
            sha256 of its bytes, so that two datasets can be told apart by tokenizer, wherever their
            files were.

    Raises:
        FileNotFoundError: a file that does not exist.
    """
    paths = [Path(f) for f in files]
    names = [p.name for p in paths]
    unique = len(set(names)) == len(names)
    return {
        "type": tokenizer_type,
        "vocab_size": int(vocab_size),
        "files": {(p.name if unique else os.fspath(p)): _sha256(p) for p in paths},
    }


# ----------------------------------------------------------------------------- counting


def _bincount(tokens: np.ndarray, where: str) -> np.ndarray:
    """int64 counts of each id in ``tokens`` (length max id + 1).

    Raises:
        DataFormatError: a negative id (possible in an int32 / int64 ``.bin``), naming ``where``.
    """
    if tokens.dtype.kind == "i" and tokens.size:
        low = int(tokens.min())
        if low < 0:
            raise DataFormatError(f"{where}: token id {low} is negative; token ids are >= 0")
    return np.bincount(tokens)


def _add(total: np.ndarray, part: np.ndarray) -> np.ndarray:
    """``total + part`` for count vectors of different lengths (grows ``total`` when needed)."""
    if part.size > total.size:
        total = np.concatenate([total, np.zeros(part.size - total.size, dtype=np.int64)])
    total[: part.size] += part
    return total


def _finish(
    counts: np.ndarray,
    num_documents: int,
    eod_token: int | None,
    ends_with_eod: bool,
    tokenizer: dict[str, Any] | None,
    where: str,
) -> DatasetStats:
    present = np.flatnonzero(counts)
    low, high = (int(present[0]), int(present[-1])) if present.size else (-1, -1)
    tokenizer = dict(tokenizer) if tokenizer else dict(UNKNOWN_TOKENIZER)
    vocab_size = tokenizer.get("vocab_size")
    if isinstance(vocab_size, int) and high >= vocab_size:
        raise DataFormatError(
            f"{where}: token id {high} is outside the tokenizer's vocabulary of {vocab_size} "
            f"({tokenizer.get('type')}); the dataset was made with another tokenizer: pass its files"
        )
    if eod_token is not None and isinstance(vocab_size, int) and not 0 <= eod_token < vocab_size:
        raise DataFormatError(
            f"{where}: --eod-token {eod_token} is outside the tokenizer's vocabulary of {vocab_size}"
        )
    return DatasetStats(
        num_tokens=int(counts.sum()),
        num_documents=int(num_documents),
        max_token_id=high,
        min_token_id=low,
        eod_token=None if eod_token is None else int(eod_token),
        documents_end_with_eod=None if eod_token is None else bool(ends_with_eod),
        tokenizer=tokenizer,
        unigram_counts=tuple(counts[: high + 1].tolist()),
    )


class StatsAccumulator:
    """Builds a dataset's statistics while it is written, from its documents in order.

    The writers (``preprocess``, ``split``) feed it what they append to ``IndexedDatasetWriter``, so
    the statistics cost no extra read of the tokens.

    Args:
        eod_token: the EOD id every document should end with, or ``None`` (no check).
        vocab_size: size the count vector starts at (it grows past it if needed).
        where: names the output in error messages.
    """

    def __init__(self, eod_token: int | None = None, vocab_size: int = 0, where: str = "dataset") -> None:
        self.eod_token = eod_token
        self.where = where
        self.num_documents = 0
        self.ends_with_eod = True
        self._counts = np.zeros(vocab_size, dtype=np.int64)

    def add_documents(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        counts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Adds whole documents, their ids back to back.

        Args:
            tokens: 1-D integer array, ``sum(lengths)`` ids.
            lengths: 1-D integer array, tokens per document.
            counts: ``(ids, occurrences)`` of ``tokens`` when already counted (each id once, as
                ``np.flatnonzero`` of a bincount gives them); counted here when ``None``.

        Raises:
            DataFormatError: a negative token id.
        """
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if counts is None:
            for a in range(0, tokens.size, _SCAN_TOKENS):  # bounded scratch memory
                self._counts = _add(self._counts, _bincount(tokens[a : a + _SCAN_TOKENS], self.where))
        else:
            ids, occurrences = counts
            if ids.size:
                if int(ids.max()) >= self._counts.size:
                    self._counts = _add(self._counts, np.zeros(int(ids.max()) + 1, dtype=np.int64))
                self._counts[ids] += occurrences  # ids are distinct, so fancy += adds each once
        if self.eod_token is not None and self.ends_with_eod and lengths.size:
            ends = np.cumsum(lengths)
            self.ends_with_eod = bool(lengths.min() > 0) and bool(np.all(tokens[ends - 1] == self.eod_token))
        self.num_documents += int(lengths.size)

    def add_stats(self, stats: DatasetStats) -> None:
        """Adds a whole dataset already counted (a merge input with a sidecar)."""
        self._counts = _add(self._counts, stats.counts())
        self.num_documents += stats.num_documents
        if self.eod_token is not None:
            self.ends_with_eod &= stats.eod_token == self.eod_token and bool(stats.documents_end_with_eod)

    def finish(self, tokenizer: dict[str, Any] | None = None) -> DatasetStats:
        """The statistics of everything added.

        Raises:
            DataFormatError: an id outside ``tokenizer["vocab_size"]``.
        """
        return _finish(
            self._counts, self.num_documents, self.eod_token, self.ends_with_eod, tokenizer, self.where
        )


def sparse_counts(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, occurrences)`` of the ids present in ``tokens``, both int32 (int64 occurrences for an
    array of 2**31 tokens or more): compact to send between processes (about 12k pairs, 100 KB, for
    a 1 MB chunk of English text, against 500 KB of its tokens and 400 KB for a dense GPT-2 vector)."""
    dense = np.bincount(tokens) if tokens.size else np.zeros(0, dtype=np.int64)
    ids = np.flatnonzero(dense)
    occurrences = dense[ids]
    return ids.astype(np.int32), occurrences.astype(np.int32) if tokens.size < 2**31 else occurrences


def _document_ends(dataset: IndexedDataset) -> Iterator[np.ndarray]:
    """int64 end offsets (exclusive, in tokens) of every document, in blocks, ascending.

    A document ends where its last sequence ends; one with no sequence ends where the previous
    one does. The sequences are contiguous in ``.bin`` (``IndexedDataset`` checks the pointers).
    """
    bounds = dataset.document_indices
    pointers, lengths = dataset.sequence_pointers, dataset.sequence_lengths
    itemsize = dataset.dtype.itemsize
    previous = 0
    for a in range(1, bounds.size, _DOC_BLOCK):
        last = np.asarray(bounds[a : a + _DOC_BLOCK], dtype=np.int64) - 1  # last sequence of each
        ends = np.empty(last.size, dtype=np.int64)
        has = last >= 0
        seqs = last[has]
        ends[has] = np.asarray(pointers[seqs]) // itemsize + np.asarray(lengths[seqs], dtype=np.int64)
        ends[~has] = 0
        np.maximum.accumulate(ends, out=ends)  # an empty document ends where the one before it did
        np.maximum(ends, previous, out=ends)
        previous = int(ends[-1]) if ends.size else previous
        yield ends


@dataclass
class _EodCheck:
    """Checks, chunk by chunk of the token stream, that every document ends with ``eod``."""

    dataset: IndexedDataset
    eod: int
    first_bad: int | None = None  # first document found not ending in eod
    _blocks: Iterator[np.ndarray] | None = None
    _ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _loaded: int = 0  # documents whose ends were loaded
    _last_end: int = 0
    _exhausted: bool = False

    def _bad(self, doc: int) -> None:
        self.first_bad = doc if self.first_bad is None else min(self.first_bad, doc)

    def chunk(self, tokens: np.ndarray, a: int) -> None:
        """Checks the documents whose last token is in ``tokens`` = stream ``[a, a + len)``."""
        if self._blocks is None:
            self._blocks = _document_ends(self.dataset)
        b = a + tokens.size
        while not self._exhausted and (self._ends.size == 0 or self._ends[-1] <= b):
            ends = next(self._blocks, None)
            if ends is None:
                self._exhausted = True
                break
            starts = np.concatenate([[self._last_end], ends[:-1]])
            ids = np.arange(self._loaded, self._loaded + ends.size, dtype=np.int64)
            empty = ends == starts
            if empty.any():
                self._bad(int(ids[np.argmax(empty)]))
            self._ends = np.concatenate([self._ends, ends[~empty]])
            self._ids = np.concatenate([self._ids, ids[~empty]])
            self._loaded += ends.size
            self._last_end = int(ends[-1]) if ends.size else self._last_end
        k = int(np.searchsorted(self._ends, b, side="right"))
        mine, ids = self._ends[:k], self._ids[:k]
        self._ends, self._ids = self._ends[k:], self._ids[k:]
        wrong = tokens[mine - 1 - a] != self.eod
        if wrong.any():
            self._bad(int(ids[np.argmax(wrong)]))

    def finish(self) -> None:
        """Loads the ends not loaded yet: after the last chunk only empty documents can be left
        (all of them, in a dataset of no tokens, where no chunk was read)."""
        self.chunk(np.zeros(0, dtype=np.int64), self.dataset.num_tokens)


def _scan(dataset: IndexedDataset, eod_token: int | None, progress: bool) -> tuple[np.ndarray, int | None]:
    """One chunked read of ``.bin``: (counts int64[max id + 1], first document not ending in EOD)."""
    from tqdm import tqdm

    where = os.fspath(dataset.bin_path)
    counts = np.zeros(0, dtype=np.int64)
    check = _EodCheck(dataset, eod_token) if eod_token is not None else None
    n = dataset.num_tokens
    with (
        open(dataset.bin_path, "rb") as f,
        tqdm(
            total=n,
            unit=" tok",
            unit_scale=True,
            desc="counting",
            disable=None if progress else True,
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar,
    ):
        # Plain sequential reads, not the memory map: pages of a 220 GB map would pile up in RSS.
        for a in range(0, n, _SCAN_TOKENS):
            chunk = np.fromfile(f, dtype=dataset.dtype, count=min(_SCAN_TOKENS, n - a))
            if chunk.size != min(_SCAN_TOKENS, n - a):
                raise DataFormatError(
                    f"{where}: ended at token {a + chunk.size} of {n} (truncated while it was read)"
                )
            counts = _add(counts, _bincount(chunk, where))
            if check is not None:
                check.chunk(chunk, a)
            bar.update(chunk.size)
    if check is not None:
        check.finish()
        return counts, check.first_bad
    return counts, None


def compute_stats(
    prefix: str | os.PathLike[str],
    *,
    eod_token: int | None = None,
    tokenizer: dict[str, Any] | None = None,
    progress: bool = False,
) -> DatasetStats:
    """Statistics of an existing dataset, from ONE chunked read of its ``.bin`` (~40 MB of memory).

    Args:
        prefix: dataset path without ``.bin``/``.idx``.
        eod_token: the id ``--append-eod`` appended; when given, every document's last token is
            checked against it (vectorised, per chunk) and ``documents_end_with_eod`` says the
            result. ``None``: no check, ``documents_end_with_eod`` is ``None``.
        tokenizer: the ``tokenizer`` entry (see ``describe_tokenizer``); ``None`` records
            ``{"type": "unknown"}``.
        progress: a tqdm bar over the tokens on stderr (when it is a terminal).

    Returns:
        The statistics; nothing is written (see ``write_stats``).

    Raises:
        FileNotFoundError: a missing ``.bin``/``.idx``.
        DataFormatError: a corrupt dataset, a negative id, or an id (or ``eod_token``) outside
            ``tokenizer["vocab_size"]``.
    """
    dataset = IndexedDataset(prefix)
    counts, first_bad = _scan(dataset, eod_token, progress)
    return _finish(counts, dataset.num_documents, eod_token, first_bad is None, tokenizer, os.fspath(prefix))


def merge_stats(parts: Sequence[DatasetStats], tokenizer: dict[str, Any] | None = None) -> DatasetStats:
    """Statistics of datasets concatenated: counts summed; ``eod_token`` and ``tokenizer`` kept when
    every part has the same (else ``None`` / ``{"type": "unknown"}``); ``documents_end_with_eod``
    true only if true of every part.

    Args:
        tokenizer: overrides the parts' tokenizer entry when given.
    """
    eods = {p.eod_token for p in parts}
    eod = eods.pop() if len(eods) == 1 else None
    acc = StatsAccumulator(eod)
    for p in parts:
        acc.add_stats(p)
    if tokenizer is None:
        kinds = {json.dumps(p.tokenizer, sort_keys=True) for p in parts}
        tokenizer = json.loads(kinds.pop()) if len(kinds) == 1 else dict(UNKNOWN_TOKENIZER)
    return acc.finish(tokenizer)


# ----------------------------------------------------------------------------- the sidecar file


def write_stats(prefix: str | os.PathLike[str], stats: DatasetStats) -> str:
    """Writes ``stats`` to ``{prefix}.stats.json`` atomically (a temporary name, then a rename).

    Returns:
        The sidecar's path.
    """
    path = stats_path(prefix)
    atomic_write_text(path, stats.to_json_text())
    return path


def _index_counts(prefix: str) -> tuple[int, int]:
    """(tokens, documents) of a dataset from its ``.idx`` header and ``.bin`` size: O(1), no scan."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataFormatError(f"{path}: no such file (the dataset prefix is {prefix!r})")
    with open(idx, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE or header[:9] != MAGIC or header[17] not in DTYPE_CODES:
        raise DataFormatError(f"{idx}: not a Megatron MMIDIDX index (bad header)")
    num_doc_indices = struct.unpack_from("<Q", header, 26)[0]
    itemsize = DTYPE_CODES[header[17]].itemsize
    return os.path.getsize(bin_) // itemsize, max(int(num_doc_indices) - 1, 0)


def read_stats(prefix: str | os.PathLike[str]) -> DatasetStats:
    """The sidecar of dataset ``prefix``, checked against its ``.idx`` (header only: O(1)).

    Returns:
        The statistics.

    Raises:
        DataFormatError: the dataset's ``.bin``/``.idx`` missing; the sidecar missing (a dataset
            made before sidecars existed), unreadable (not JSON, a field missing or of the wrong
            type, another format version, counts that do not add up) or stale (its ``num_tokens``
            or ``num_documents`` disagree with the dataset: it was rewritten since). The message
            names the file and the command that writes a correct one.
    """
    prefix = os.fspath(prefix)
    tokens, documents = _index_counts(prefix)
    path = stats_path(prefix)
    fix = f"compute it with: {stats_command(prefix)}"
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise DataFormatError(
            f"{path}: missing: the dataset {prefix} has no statistics sidecar (datasets preprocessed "
            f"before sidecars existed have none); {fix}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFormatError(f"{path}: unreadable ({e}); {fix}") from None
    try:
        stats = DatasetStats.from_json(obj)
    except ValueError as e:
        raise DataFormatError(f"{path}: unreadable: {e}; {fix}") from None
    if (stats.num_tokens, stats.num_documents) != (tokens, documents):
        raise DataFormatError(
            f"{path}: stale: it counts {stats.num_tokens} tokens in {stats.num_documents} documents, "
            f"but {prefix}.bin/.idx hold {tokens} tokens in {documents} documents (the dataset was "
            f"rewritten after its statistics); re{fix}"
        )
    return stats


def mixture_unigram_entropy(stats: Sequence[DatasetStats], shares: Sequence[float] | np.ndarray) -> float:
    """Entropy in nats of the blend distribution ``sum_i share_i * p_i``.

    Args:
        stats: per dataset its statistics; ``p_i = counts_i / num_tokens_i``.
        shares: per dataset the fraction of the blend drawn from it, >= 0 (normalised to sum 1).

    Returns:
        The entropy, nats: the best loss a context-free model can reach on the blended stream.

    Raises:
        ValueError: lengths that differ, a negative share, shares summing to 0, or a positive share
            of an empty dataset.
    """
    shares = np.asarray(shares, dtype=np.float64)
    if shares.shape != (len(stats),):
        raise ValueError(f"{len(stats)} datasets but {shares.size} shares")
    if (shares < 0).any() or not shares.sum() > 0:
        raise ValueError(f"shares must be >= 0 and sum to more than 0, got {shares.tolist()}")
    shares = shares / shares.sum()
    size = max((s.max_token_id + 1 for s in stats), default=0)
    mixture = np.zeros(size, dtype=np.float64)
    for share, s in zip(shares, stats):
        if share == 0:
            continue
        if not s.num_tokens:
            raise ValueError(f"a share of {share} of an empty dataset (0 tokens)")
        mixture[: s.max_token_id + 1] += share * s.counts() / s.num_tokens
    return _entropy(mixture)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    from data_tools.tokenizer import TOKENIZER_TYPES

    p = argparse.ArgumentParser(
        prog="python -m data_tools.stats",
        description="Compute and write the statistics sidecar ({prefix}.stats.json) of an existing dataset.",
    )
    p.add_argument("--data-prefix", required=True, help="the dataset: PREFIX.bin / PREFIX.idx")
    p.add_argument(
        "--eod-token",
        type=int,
        default=None,
        help="the EOD id appended at preprocessing (--append-eod; 50256 for GPT-2): checked at the end "
        "of every document and recorded (default: none, not checked)",
    )
    g = p.add_argument_group("tokenizer the dataset was made with (recorded; default: unknown)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT-2 encoder.json / vocab.json")
    g.add_argument("--merge-file", help="GPT-2 vocab.bpe / merges.txt")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file")
    return p


def tokenizer_entry(
    tokenizer_type: str | None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """The sidecar's ``tokenizer`` entry from preprocess-style flags (``{"type": "unknown"}`` without a type).

    Builds the tokenizer (checking its files) when ``vocab_size`` is not given.

    Raises:
        TokenizerError: missing or bad tokenizer files.
    """
    if tokenizer_type is None:
        return dict(UNKNOWN_TOKENIZER)
    if vocab_size is None:
        from data_tools.tokenizer import build_tokenizer

        vocab_size = build_tokenizer(
            tokenizer_type, vocab_file=vocab_file, merge_file=merge_file, tokenizer_model=tokenizer_model
        ).vocab_size
    # Only the files this type reads (Megatron command lines often carry the others along).
    used = (vocab_file, merge_file) if tokenizer_type == "GPT2BPETokenizer" else (tokenizer_model,)
    # A HuggingFaceTokenizer directory: its tokenizer.json stands for it.
    used = [os.path.join(f, "tokenizer.json") if f and os.path.isdir(f) else f for f in used]
    return describe_tokenizer(tokenizer_type, vocab_size, [f for f in used if f])


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; 0 ok, 2 bad input, 130 interrupted."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        sigterm_as_interrupt()
        files = (args.vocab_file, args.merge_file, args.tokenizer_model)
        if args.tokenizer_type is None and any(files):
            raise DataFormatError(
                "tokenizer files given without --tokenizer-type; add it (e.g. GPT2BPETokenizer)"
            )
        tokenizer = tokenizer_entry(args.tokenizer_type, *files)
        dataset = IndexedDataset(args.data_prefix)
        counts, first_bad = _scan(dataset, args.eod_token, progress=True)
        stats = _finish(
            counts, dataset.num_documents, args.eod_token, first_bad is None, tokenizer, args.data_prefix
        )
        try:
            path = write_stats(args.data_prefix, stats)
        except OSError as e:  # a full disk, a read-only directory: the temporary is already gone
            raise write_error(e, stats_path(args.data_prefix)) or e from None
    except (DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no sidecar written", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - start
    ends = {None: "not checked (no --eod-token)", True: f"yes ({args.eod_token})"}.get(
        stats.documents_end_with_eod, f"NO (first: document {first_bad})"
    )
    if stats.documents_end_with_eod is False:
        print(
            f"warning: {args.data_prefix}: not every document ends with EOD {args.eod_token}: document "
            f"{first_bad} is the first that does not (see python -m data_tools.inspect "
            f"{args.data_prefix} --doc {first_bad}); the sidecar records documents_end_with_eod: false",
            file=sys.stderr,
        )
    print(
        f"done: {stats.num_tokens:,} tokens, {stats.num_documents:,} documents, ids "
        f"[{stats.min_token_id}, {stats.max_token_id}], unigram entropy {stats.unigram_entropy:.4f} nats, "
        f"documents end with EOD: {ends}, tokenizer {stats.tokenizer['type']}, {seconds:.1f} s "
        f"({stats.num_tokens / max(seconds, 1e-9) / 1e6:.1f}M tokens/s)"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
