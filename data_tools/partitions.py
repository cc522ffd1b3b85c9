"""Megatron's ``--partitions P`` document order, written in one pass.

Megatron's ``tools/preprocess_data.py`` with ``--partitions P`` (and without
``--keep-sequential-samples``) deals the input lines out to P partition files in turn (line i to
partition ``i mod P``, counting across input files), tokenizes each partition into its own
dataset and concatenates those in partition order: the output holds documents 0, P, 2P, ...,
then 1, P + 1, ..., and so on. :class:`RoundRobinWriter` gives that order from one pass over the
input: document i goes to partition ``i mod P`` (a temporary ``.bin`` per partition, beside the
output), and :meth:`RoundRobinWriter.finalize` copies the partitions into the output in order.
With ``--skip-bad-records`` the count is of the documents written (Megatron has no such option:
it stops at a bad line).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_tools.indexed_dataset import IndexedDatasetWriter

__all__ = ["RoundRobinWriter", "make_writer"]

_COPY_TOKENS = 1 << 22  # tokens per block when copying a partition into the output


class _Partition:
    """One partition's tokens in a temporary file, with its sequence lengths and document sizes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb", buffering=8 << 20)  # noqa: SIM115 (closed by the owner)
        self.seq_lengths: list[np.ndarray] = []
        self.per_doc: list[np.ndarray] = []


class RoundRobinWriter:
    """An :class:`IndexedDatasetWriter` whose documents come out in Megatron's partitioned order.

    Args:
        prefix: output path without ``.bin``/``.idx``.
        dtype: token dtype on disk.
        partitions: P >= 2.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype, partitions: int) -> None:
        self.final = IndexedDatasetWriter(prefix, dtype)
        self.dtype = self.final.dtype
        base = self.final.bin_path
        self._parts: list[_Partition] = []
        try:
            for k in range(partitions):
                self._parts.append(_Partition(base.with_name(f"{base.name}.partition{k}.tmp")))
        except BaseException:
            self.abort()
            raise
        self._next_doc = 0

    def add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray | None = None
    ) -> None:
        """As :meth:`IndexedDatasetWriter.add_documents`; document i of the run goes to partition i mod P."""
        lengths = np.asarray(lengths, dtype=np.int64)
        per_doc = (
            np.ones(lengths.size, np.int64)
            if sequences_per_document is None
            else np.asarray(sequences_per_document, dtype=np.int64)
        )
        n_docs, p = per_doc.size, len(self._parts)
        seq_doc = np.repeat(np.arange(n_docs), per_doc)  # document of each sequence
        doc_tokens = np.bincount(seq_doc, weights=lengths, minlength=n_docs).astype(np.int64)
        part_of_doc = (self._next_doc + np.arange(n_docs)) % p
        token_part = np.repeat(part_of_doc, doc_tokens)
        for k, part in enumerate(self._parts):
            docs = part_of_doc == k
            if not docs.any():
                continue
            part.file.write(memoryview(np.ascontiguousarray(tokens[token_part == k])).cast("B"))
            part.seq_lengths.append(lengths[docs[seq_doc]])
            part.per_doc.append(per_doc[docs])
        self._next_doc += n_docs

    def finalize(self, before_index: Callable[[], None] | None = None) -> None:
        """Copies the partitions into the output in order, then finalizes it (see
        :meth:`IndexedDatasetWriter.finalize`); the partition files are removed."""
        try:
            for part in self._parts:
                part.file.close()
                self._copy(part)
                part.path.unlink()
            self.final.finalize(before_index)
        except BaseException:
            self.abort()
            raise

    def _copy(self, part: _Partition) -> None:
        seq_lengths = np.concatenate(part.seq_lengths) if part.seq_lengths else np.zeros(0, np.int64)
        per_doc = np.concatenate(part.per_doc) if part.per_doc else np.zeros(0, np.int64)
        seq_end = np.cumsum(per_doc)  # sequences before the end of each document
        tok_end = np.concatenate([[0], np.cumsum(seq_lengths)])
        with open(part.path, "rb") as f:
            doc = 0
            while doc < per_doc.size:
                # whole documents, about _COPY_TOKENS tokens per block
                first_seq = int(seq_end[doc - 1]) if doc else 0
                limit = tok_end[first_seq] + _COPY_TOKENS
                last = max(doc + 1, int(np.searchsorted(tok_end[seq_end], limit, side="right")))
                last = min(last, per_doc.size)
                end_seq = int(seq_end[last - 1])
                count = int(tok_end[end_seq] - tok_end[first_seq])
                tokens = np.fromfile(f, dtype=self.dtype, count=count)
                self.final.add_documents(tokens, seq_lengths[first_seq:end_seq], per_doc[doc:last])
                doc = last

    def abort(self) -> None:
        """Removes the partition files and the output's temporaries."""
        for part in self._parts:
            with contextlib.suppress(OSError):
                part.file.close()
            part.path.unlink(missing_ok=True)
        self.final.abort()


def make_writer(
    prefix: str, dtype, partitions: int = 1, keep_sequential_samples: bool = False
) -> IndexedDatasetWriter | RoundRobinWriter:
    """The writer of one output: in input order, or in Megatron's ``--partitions`` order (a
    :class:`RoundRobinWriter`, used the same way) when ``partitions > 1`` without
    ``keep_sequential_samples``."""
    if partitions > 1 and not keep_sequential_samples:
        return RoundRobinWriter(prefix, dtype, partitions)
    return IndexedDatasetWriter(prefix, dtype)
