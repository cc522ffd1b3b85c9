"""Megatron's ``MMIDIDX`` indexed dataset: a ``.bin`` token stream plus an ``.idx`` index.

The bytes are exactly those Megatron-LM (``megatron/core/datasets/indexed_dataset.py``) and GPT-NeoX
write and read, so a pair made here can be trained on there and the other way round.

``.idx`` layout, all little-endian::

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8         u64 version = 1
    17      1         u8 dtype code (see DTYPE_CODES)
    18      8         u64 N, the number of sequences
    26      8         u64 D, the number of document indices (= documents + 1)
    34      4*N       int32 sequence lengths, in tokens
    34+4N   8*N       int64 sequence pointers, byte offsets into .bin
    34+12N  8*D       int64 document indices: document i is sequences [doc[i], doc[i+1])

``.bin`` is the tokens of every sequence back to back, no header. The writer here puts one sequence
per document (as Megatron's ``preprocess_data.py`` does without ``--split-sentences``); the reader
accepts any number of sequences per document.
"""

from __future__ import annotations

import array
import contextlib
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from data_tools.atomic import stop_signals_blocked
from data_tools.errors import DataFormatError

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "DataFormatError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "open_dataset",
    "opened_once",
    "optimal_dtype",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic (9) + version u64 (8) + dtype code u8 (1) + N u64 (8) + D u64 (8)
HEADER_SIZE = 34
_HEADER = struct.Struct("<9sQBQQ")
assert _HEADER.size == HEADER_SIZE

# Megatron's DType enum. The codes are on disk, so they can never be renumbered.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Validation walks index arrays in blocks of this many entries, so that checking an index of
# 100M sequences needs tens of MB of scratch memory, not GBs.
_CHECK_BLOCK = 1 << 22


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Token dtype Megatron picks for a vocabulary: uint16 if ``vocab_size < 65500``, else int32.

    The 65500 (not 65536) threshold is Megatron's; keeping it means the same vocabulary gives the
    same ``.bin`` bytes here and there.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _dtype_code(dtype: np.dtype | type | str) -> tuple[np.dtype, int]:
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">" or dtype not in _CODE_OF_DTYPE:
        known = ", ".join(f"{c}={d.name}" for c, d in DTYPE_CODES.items())
        raise ValueError(f"dtype {dtype} has no Megatron dtype code; use one of {known}")
    return dtype, _CODE_OF_DTYPE[dtype]


def dataset_prefix(path: str | os.PathLike[str]) -> str:
    """A dataset's prefix from what a user passes: the prefix itself, or its ``.bin`` or ``.idx``
    path (as ``inspect`` and ``merge`` accept)."""
    path = os.fspath(path)
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    prefix = os.fspath(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin`` / ``{prefix}.idx``, one sequence per document.

    Tokens go straight to ``{prefix}.bin.tmp``; only the sequence lengths are kept in memory
    (4 bytes per document). ``finalize()`` writes ``{prefix}.idx.tmp`` and then renames both, so a
    crashed or interrupted run never leaves a finished-looking pair; ``abort()`` (or leaving the
    ``with`` block by an exception) removes the temporaries.

    Args:
        prefix: output path without ``.bin``/``.idx``.
        dtype: token dtype on disk, one of ``DTYPE_CODES`` (usually ``optimal_dtype(vocab_size)``).

    Raises:
        ValueError: for a dtype Megatron has no code for.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type | str) -> None:
        self.dtype, self._code = _dtype_code(dtype)
        self.bin_path, self.idx_path = _paths(prefix)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        # A large buffer because most documents are a few hundred tokens: one write() per document
        # would be a system call per document.
        self._bin = open(self._bin_tmp, "wb", buffering=8 << 20)  # noqa: SIM115 (closed in finalize/abort)
        self._lengths = array.array("i")  # int32, as on disk; compact for 100M+ documents
        # End (exclusive sequence index) of each document once a document has several sequences;
        # None while every document is one sequence (the index is then 0..N, not stored).
        self._doc_ends: array.array | None = None
        self._num_tokens = 0
        self._closed = False

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._lengths) if self._doc_ends is None else len(self._doc_ends)

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return self._num_tokens

    def add_document(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Appends one document (= one sequence) of token ids.

        Args:
            tokens: 1-D token ids, any integer dtype or a list; may be empty (an empty sequence).

        Raises:
            ValueError: if a value does not fit the writer's dtype (it would wrap silently otherwise),
                if ``tokens`` is not 1-D, or the document is longer than int32 allows.
        """
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: add_document() after finalize() or abort()")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D token ids, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and self.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                lo, hi = arr.min(), arr.max()
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"{self.bin_path}: token ids in [{lo}, {hi}] do not fit {self.dtype.name} "
                        f"[{info.min}, {info.max}]; write with a wider dtype"
                    )
            arr = arr.astype(self.dtype)
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {arr.size} tokens does not fit the int32 sequence length")
        self._bin.write(np.ascontiguousarray(arr).tobytes())
        self._lengths.append(arr.size)
        if self._doc_ends is not None:
            self._doc_ends.append(len(self._lengths))
        self._num_tokens += arr.size

    def add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray | None = None
    ) -> None:
        """Appends many documents at once: ``tokens`` is their ids back to back, ``lengths`` their sizes.

        The fast path of preprocessing and of ``merge``/``split``: one ``write()`` per call instead of
        one per document, and no per-document Python work.

        Args:
            tokens: 1-D array already of the writer's dtype (no range check is made here: the
                caller produced it in that dtype), ``sum(lengths)`` entries.
            lengths: 1-D integer array, tokens per sequence, each in ``[0, 2**31)``; a sequence
                is a document unless ``sequences_per_document`` is given.
            sequences_per_document: 1-D integer array, how many of the sequences make each
                document (sentence-level data, ``--split-sentences``); sums to ``lengths.size``.

        Raises:
            ValueError: dtype mismatch, ``lengths`` not summing to ``tokens.size``, or
                ``sequences_per_document`` not summing to ``lengths.size``.
        """
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: add_documents() after finalize() or abort()")
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype or tokens.ndim != 1:
            raise ValueError(
                f"{self.bin_path}: expected 1-D {self.dtype.name} tokens, "
                f"got {tokens.dtype} of shape {tokens.shape}"
            )
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size or (lengths.size and lengths.min() < 0):
            raise ValueError(
                f"{self.bin_path}: lengths sum to {int(lengths.sum())}, but {tokens.size} tokens were given"
            )
        if sequences_per_document is not None:
            per_doc = np.asarray(sequences_per_document, dtype=np.int64)
            if int(per_doc.sum()) != lengths.size:
                raise ValueError(f"{self.bin_path}: sequences_per_document do not sum to {lengths.size}")
            if self._doc_ends is None:  # until now one sequence per document
                self._doc_ends = array.array("q", range(1, len(self._lengths) + 1))
            ends = len(self._lengths) + np.cumsum(per_doc)
            self._doc_ends.frombytes(ends.astype(np.int64).tobytes())
        elif self._doc_ends is not None:
            ends = len(self._lengths) + np.arange(1, lengths.size + 1, dtype=np.int64)
            self._doc_ends.frombytes(ends.tobytes())
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._num_tokens += tokens.size

    def finalize(self, before_index: Callable[[], None] | None = None) -> None:
        """Writes the index, then renames ``.bin.tmp`` and ``.idx.tmp`` to their final names.

        Args:
            before_index: called once ``.bin`` is in place and before ``.idx`` is: files that
                describe the dataset (its statistics sidecar) are written there, so that they
                exist whenever the ``.idx`` does, and a run killed in between leaves no ``.idx``
                (nothing that looks finished). If it raises, the ``.idx`` is not put in place.
        """
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: finalize() after finalize() or abort()")
        bin_moved = False
        try:
            self._bin.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
            num_sequences = lengths.size
            # pointer[i] = bytes before sequence i (an exclusive cumulative sum), in int64 like Megatron
            pointers = np.zeros(num_sequences, dtype=np.int64)
            if num_sequences > 1:
                np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            if self._doc_ends is None:  # one sequence per document: the indices are 0..N
                document_indices = np.arange(num_sequences + 1, dtype=np.int64)
            else:
                ends = np.frombuffer(self._doc_ends, dtype=np.int64)
                document_indices = np.concatenate([np.zeros(1, np.int64), ends])
            with open(self._idx_tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, self._code, num_sequences, document_indices.size))
                f.write(lengths.astype("<i4", copy=False).tobytes())
                f.write(pointers.astype("<i8", copy=False).tobytes())
                f.write(document_indices.astype("<i8", copy=False).tobytes())
            # The .idx is what readers open first, so it appears last, and an older .idx must not
            # sit next to the new .bin in between. SIGTERM / Ctrl-C wait for these few steps: one
            # between the .bin's rename and bin_moved would leave a .bin without its .idx.
            with stop_signals_blocked():
                self.idx_path.unlink(missing_ok=True)
                os.replace(self._bin_tmp, self.bin_path)
                bin_moved = True
                if before_index is not None:
                    before_index()
                os.replace(self._idx_tmp, self.idx_path)
                self._closed = True
        except BaseException:
            if self._closed:  # finished: a stop signal that waited for the block is raised as it ends
                raise
            if bin_moved:  # this run's .bin, without its .idx: not left under the final name
                self.bin_path.unlink(missing_ok=True)
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Closes and deletes the temporaries; finished outputs of an earlier run are left alone."""
        if not self._bin.closed:
            # On a full disk, close() fails flushing its buffer (and still closes the file).
            with contextlib.suppress(OSError):
                self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a ``{prefix}.bin`` / ``{prefix}.idx`` pair, checked on open.

    Both files are memory-mapped: opening costs O(index) validation work and no token is read
    until ``get()`` slices it.

    Attributes:
        dtype: token dtype of ``.bin``.
        sequence_lengths: int32[N], tokens per sequence.
        sequence_pointers: int64[N], byte offset of each sequence in ``.bin``.
        document_indices: int64[D], document i is sequences ``[d[i], d[i+1])``; ``d[0] == 0``,
            ``d[-1] == N``.

    Raises:
        FileNotFoundError: if either file is missing.
        DataFormatError: bad magic, version or dtype code; an ``.idx`` whose size disagrees with its
            header; pointers that are not the running sum of the lengths; a ``.bin`` whose size is
            not ``sum(lengths) * itemsize``; document indices that do not run from 0 up to N.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self._prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file (the dataset prefix is {os.fspath(prefix)!r})")
        self.dtype, num_sequences, num_doc_indices = self._read_header()
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        lengths_end = HEADER_SIZE + 4 * num_sequences
        pointers_end = lengths_end + 8 * num_sequences
        self.sequence_lengths: np.ndarray = idx[HEADER_SIZE:lengths_end].view("<i4")
        self.sequence_pointers: np.ndarray = idx[lengths_end:pointers_end].view("<i8")
        self.document_indices: np.ndarray = idx[pointers_end : pointers_end + 8 * num_doc_indices].view("<i8")
        self._num_tokens = self._check_index()
        self._check_bin_size()
        # np.memmap cannot map an empty file, and an empty .bin is valid (no tokens at all).
        if self._num_tokens:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def _read_header(self) -> tuple[np.dtype, int, int]:
        size = self.idx_path.stat().st_size
        if size < HEADER_SIZE:
            raise DataFormatError(
                f"{self.idx_path}: expected a header of {HEADER_SIZE} bytes, found a file of {size} bytes"
            )
        with open(self.idx_path, "rb") as f:
            magic, version, code, num_sequences, num_doc_indices = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise DataFormatError(
                f"{self.idx_path}: expected magic {MAGIC!r}, found {magic!r}; "
                "not a Megatron MMIDIDX .idx file"
            )
        if version != VERSION:
            raise DataFormatError(f"{self.idx_path}: expected index version {VERSION}, found {version}")
        if code not in DTYPE_CODES:
            raise DataFormatError(
                f"{self.idx_path}: expected a dtype code in {sorted(DTYPE_CODES)}, found {code}"
            )
        expected = HEADER_SIZE + 12 * num_sequences + 8 * num_doc_indices
        if size != expected:
            raise DataFormatError(
                f"{self.idx_path}: expected {expected} bytes for {num_sequences} sequences and "
                f"{num_doc_indices} document indices, found {size} bytes (truncated or not an index)"
            )
        return DTYPE_CODES[code], num_sequences, num_doc_indices

    def _check_index(self) -> int:
        """Checks lengths, pointers and document indices block by block; returns the token count."""
        # Read with pread-style np.fromfile rather than through the memmaps: touching a memmap
        # keeps its pages in this process's RSS, 2 GB for an index of 100M documents.
        n, d = self.sequence_lengths.size, self.document_indices.size
        with open(self.idx_path, "rb") as f:
            return self._check_index_blocks(f, n, d, self.dtype.itemsize)

    @staticmethod
    def _read_block(f, dtype: str, offset: int, count: int) -> np.ndarray:
        f.seek(offset)
        return np.fromfile(f, dtype=dtype, count=count)

    def _check_index_blocks(self, f, n: int, d: int, itemsize: int) -> int:
        lengths_at, pointers_at, docs_at = HEADER_SIZE, HEADER_SIZE + 4 * n, HEADER_SIZE + 12 * n
        total_tokens = 0  # tokens before the current block
        for start in range(0, n, _CHECK_BLOCK):
            count = min(_CHECK_BLOCK, n - start)
            block = self._read_block(f, "<i4", lengths_at + 4 * start, count).astype(np.int64)
            if block.min() < 0:
                bad = start + int(np.argmax(block < 0))
                raise DataFormatError(
                    f"{self.idx_path}: expected sequence lengths >= 0, "
                    f"found {block[bad - start]} at sequence {bad}"
                )
            expected = np.cumsum(block) - block + total_tokens  # exclusive running sum
            expected *= itemsize
            found = self._read_block(f, "<i8", pointers_at + 8 * start, count)
            mismatch = np.flatnonzero(found != expected)
            if mismatch.size:
                i = int(mismatch[0])
                raise DataFormatError(
                    f"{self.idx_path}: sequence {start + i}: expected byte pointer {expected[i]} "
                    f"(the sum of the lengths before it times {itemsize}), found {found[i]}"
                )
            total_tokens += int(block.sum())
        num_sequences = n
        docs = self.document_indices
        if d == 0 or docs[0] != 0 or docs[-1] != num_sequences:
            found = "none" if d == 0 else f"first {docs[0]}, last {docs[-1]}"
            raise DataFormatError(
                f"{self.idx_path}: expected document indices from 0 to {num_sequences} "
                f"(the sequence count), found {found}"
            )
        for start in range(0, d - 1, _CHECK_BLOCK):
            # one element of overlap so that the step between blocks is checked too
            count = min(_CHECK_BLOCK + 1, d - start)
            steps = np.diff(self._read_block(f, "<i8", docs_at + 8 * start, count))
            if steps.size and steps.min() < 0:
                i = start + int(np.argmax(steps < 0))
                raise DataFormatError(
                    f"{self.idx_path}: expected non-decreasing document indices, found "
                    f"{docs[i]} then {docs[i + 1]} at positions {i} and {i + 1}"
                )
        return total_tokens

    def _check_bin_size(self) -> None:
        expected = self._num_tokens * self.dtype.itemsize
        found = self.bin_path.stat().st_size
        if found != expected:
            raise DataFormatError(
                f"{self.bin_path}: expected {expected} bytes ({self._num_tokens} {self.dtype.name} tokens "
                f"as {self.idx_path.name} says), found {found} bytes"
                + ("; the .bin is truncated" if found < expected else "")
            )

    def __getstate__(self) -> dict:
        # Pickling a memmap copies its data: a DataLoader worker started with "spawn" would receive
        # the whole token stream. Pickle the prefix instead and map the files again on arrival.
        return {"prefix": self._prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    @property
    def prefix(self) -> str:
        """The dataset's path without ``.bin``/``.idx``, as given."""
        return self._prefix

    def __len__(self) -> int:
        """Number of sequences N."""
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        """Number of documents (D - 1)."""
        return int(self.document_indices.size) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens in ``.bin`` (= sum of the sequence lengths)."""
        return self._num_tokens

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx``, a read-only view of the memmap.

        Args:
            idx: sequence index in ``[-N, N)``.
            offset: first token within the sequence, ``0 <= offset <= len``.
            length: number of tokens; ``None`` means to the end of the sequence.

        Returns:
            1-D array of ``self.dtype`` (no copy: ``np.array(...)`` it to keep it past the dataset).

        Raises:
            IndexError: for an index out of range or a slice that runs past the sequence.
        """
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences")
        idx = int(idx) % n
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of {seq_len} tokens"
            )
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def document_sequences(self, doc: int) -> range:
        """Sequence indices of document ``doc`` (one sequence per document for files written here)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document index {doc} out of range for {self.num_documents} documents")
        return range(int(self.document_indices[doc]), int(self.document_indices[doc + 1]))

    def document_lengths(self, dtype: np.dtype | type = np.int64) -> np.ndarray:
        """Tokens per document (sums the sequences of each), shape ``[D - 1]``, vectorised.

        Args:
            dtype: result dtype; ``np.int32`` halves the memory at 100M documents (a document
                holds fewer than 2**31 tokens, as its int32 sequence lengths already require
                whenever it is one sequence).

        Reads the index through file reads, not the memmaps, so no index pages stay in RSS. With
        one sequence per document (what every writer here and Megatron's preprocess produce) the
        result is the sequence lengths themselves.
        """
        n, d = len(self), self.num_documents
        docs_at = HEADER_SIZE + 12 * n
        with open(self.idx_path, "rb") as f:
            lengths = self._read_block(f, "<i4", HEADER_SIZE, n)
            # Compared block by block: 100M document indices would be 1.6 GB with their arange.
            one_per_doc = n == d and all(
                np.array_equal(
                    self._read_block(f, "<i8", docs_at + 8 * a, min(_CHECK_BLOCK, d + 1 - a)),
                    np.arange(a, min(a + _CHECK_BLOCK, d + 1), dtype=np.int64),
                )
                for a in range(0, d + 1, _CHECK_BLOCK)
            )
            if one_per_doc:
                return lengths.astype(dtype, copy=False)
            docs = self._read_block(f, "<i8", docs_at, d + 1)
        ends = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, dtype=np.int64, out=ends[1:])
        return (ends[docs[1:]] - ends[docs[:-1]]).astype(dtype, copy=False)


_opened: dict[str, IndexedDataset] | None = None  # the datasets of the innermost opened_once block


@contextlib.contextmanager
def opened_once() -> Iterator[None]:
    """A block (a training run: :func:`megaformer.training.trainer.train`) in which
    :func:`open_dataset` opens and checks each dataset once: the preflight, the data checks, the
    held-out split and the sample indices then share one memory-mapped :class:`IndexedDataset`
    instead of re-reading and re-validating the index each time. Outside any block every call opens
    the files afresh (a file rewritten between two calls is always seen). Nested blocks share the
    outer one's datasets."""
    global _opened
    outer = _opened
    _opened = {} if outer is None else outer
    try:
        yield
    finally:
        _opened = outer


def open_dataset(prefix: str | os.PathLike[str]) -> IndexedDataset:
    """``IndexedDataset(prefix)``, opened once per :func:`opened_once` block (keyed by the prefix's
    real path); the same checks and errors as the constructor on the first open.

    Raises:
        FileNotFoundError, DataFormatError: as :class:`IndexedDataset`.
    """
    if _opened is None:
        return IndexedDataset(prefix)
    key = os.path.realpath(os.fspath(prefix))
    dataset = _opened.get(key)
    if dataset is None:
        dataset = _opened[key] = IndexedDataset(prefix)
    return dataset
