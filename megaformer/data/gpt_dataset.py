"""Training samples from a Megatron ``.bin/.idx`` dataset: packed, shuffled, split by documents.

A sample is ``seq_len + 1`` consecutive tokens of the stream formed by concatenating documents (each
already ended by EOD at preprocessing time) in a shuffled order; ``tokens = x[:-1]``,
``labels = x[1:]``. Consecutive samples share one token, as in Megatron-LM's GPT dataset, so no
token is wasted at sample boundaries.

Three index arrays, all built with vectorised numpy (no Python loop over documents or samples):

* ``doc_idx``   int64[E·D]     document order, one fresh permutation per epoch (E epochs, D documents);
* ``sample_idx`` int64[S+1, 2] for each sample start, (position in doc_idx, token offset in that doc);
* ``shuffle_idx`` int64[S]     the order in which samples are served.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from data_tools.indexed_dataset import DataFormatError, IndexedDataset


def document_lengths(dataset: IndexedDataset) -> np.ndarray:
    """Tokens per document, int64[D-1], summing the sequences of each document (vectorised)."""
    doc_bounds = np.asarray(dataset.document_indices, dtype=np.int64)
    seq_lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(seq_lengths)])
    return cum[doc_bounds[1:]] - cum[doc_bounds[:-1]]


def split_documents(num_documents: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split document ids into train and validation sets, whole documents, deterministically by seed.

    Returns:
        ``(train_ids, valid_ids)``, sorted int64 arrays; at least one document in each.

    Raises:
        DataFormatError: fewer than 2 documents.
    """
    if num_documents < 2:
        raise DataFormatError(
            f"the dataset has {num_documents} document(s); a train/validation split needs at least 2"
        )
    num_valid = min(max(1, round(num_documents * valid_fraction)), num_documents - 1)
    perm = np.random.default_rng([seed, 0x5EED]).permutation(num_documents)
    return np.sort(perm[num_valid:]), np.sort(perm[:num_valid])


def build_sample_index(
    doc_ids: np.ndarray,
    doc_lengths: np.ndarray,
    seq_len: int,
    num_samples: int,
    seed: int,
    shuffle: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Build (doc_idx, sample_idx, shuffle_idx) for ``num_samples`` samples of ``seq_len + 1`` tokens.

    Args:
        doc_ids: int64[D] ids of the documents to draw from.
        doc_lengths: int64[total documents] token count of every document of the dataset.
        seq_len: tokens per sample input (each sample holds seq_len + 1 tokens).
        num_samples: samples wanted; as many epochs over ``doc_ids`` are made as this needs.
        seed: seeds the per-epoch document permutations and the sample shuffle.
        shuffle: shuffle documents per epoch and samples (False: natural order, for evaluation).

    Returns:
        doc_idx int64[E·D], sample_idx int64[num_samples + 1, 2], shuffle_idx int64[num_samples].
    """
    lengths = doc_lengths[doc_ids].astype(np.int64)
    tokens_per_epoch = int(lengths.sum())
    if tokens_per_epoch <= seq_len:
        raise DataFormatError(
            f"the selected documents hold {tokens_per_epoch} tokens, fewer than one sample of "
            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter model.seq_len"
        )
    # Sample i covers stream positions [i·seq_len, i·seq_len + seq_len], so the stream must reach
    # num_samples·seq_len + 1 tokens.
    needed = num_samples * seq_len + 1
    epochs = -(-needed // tokens_per_epoch)
    rng = np.random.default_rng([seed, 0xD0C])
    if shuffle:
        doc_idx = np.concatenate([rng.permutation(doc_ids) for _ in range(epochs)])
    else:
        doc_idx = np.tile(doc_ids, epochs)
    doc_idx = doc_idx.astype(np.int64)
    doc_end = np.cumsum(doc_lengths[doc_idx].astype(np.int64))  # exclusive end of each doc in stream
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    # The document holding stream position p is the first whose end exceeds p.
    pos = np.searchsorted(doc_end, starts, side="right")
    offset = starts - (doc_end[pos] - doc_lengths[doc_idx[pos]])
    sample_idx = np.stack([pos, offset], axis=1)
    if shuffle:
        shuffle_idx = np.random.default_rng([seed, 0x5A3]).permutation(num_samples).astype(np.int64)
    else:
        shuffle_idx = np.arange(num_samples, dtype=np.int64)
    return doc_idx, sample_idx, shuffle_idx


@dataclass
class GPTSamples:
    """Indexable samples of ``seq_len + 1`` tokens (int64 numpy arrays) from a ``.bin/.idx`` pair.

    ``samples[i]`` reads the i-th sample in shuffled order straight from the memory-mapped ``.bin``.
    """

    dataset: IndexedDataset
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    seq_len: int

    def __post_init__(self) -> None:
        bounds = np.asarray(self.dataset.document_indices, dtype=np.int64)
        pointers = np.asarray(self.dataset.sequence_pointers, dtype=np.int64)
        # Token offset of each document's first token in .bin (its sequences are contiguous).
        self._doc_start = pointers[bounds[:-1]] // self.dataset.dtype.itemsize
        self._doc_len = document_lengths(self.dataset)
        self._tokens = np.memmap(self.dataset.bin_path, dtype=self.dataset.dtype, mode="r")

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64[seq_len + 1]."""
        j = int(self.shuffle_idx[i])
        pos, offset = (int(v) for v in self.sample_idx[j])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        # Walk the few documents this sample spans (a handful at most for real document lengths).
        while filled < out.size:
            doc = int(self.doc_idx[pos])
            take = min(int(self._doc_len[doc]) - offset, out.size - filled)
            start = int(self._doc_start[doc]) + offset
            out[filled : filled + take] = self._tokens[start : start + take]
            filled += take
            pos += 1
            offset = 0
        return out


def build_train_valid(
    prefix: str,
    seq_len: int,
    train_samples: int,
    valid_samples: int,
    valid_fraction: float,
    seed: int,
) -> tuple[GPTSamples, GPTSamples, dict[str, int]]:
    """Open ``prefix`` and build the training and validation samples.

    Validation samples come from held-out documents in natural order (the same every evaluation).

    Returns:
        ``(train, valid, info)`` where info holds document and token counts of each split.

    Raises:
        DataFormatError: missing or corrupt dataset files, too little data.
    """
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise DataFormatError(
            f"data.prefix='{prefix}': {', '.join(missing)} not found; build the dataset with "
            "python -m data_tools.preprocess --output-prefix ... (the prefix ends in _text_document)"
        )
    dataset = IndexedDataset(prefix)
    lengths = document_lengths(dataset)
    train_ids, valid_ids = split_documents(len(lengths), valid_fraction, seed)
    valid_tokens = int(lengths[valid_ids].sum())
    max_valid = (valid_tokens - 1) // seq_len
    if max_valid < valid_samples:
        raise DataFormatError(
            f"{prefix}: the held-out documents hold {valid_tokens} tokens = {max_valid} samples of "
            f"{seq_len + 1}, fewer than the {valid_samples} one evaluation reads; raise "
            "data.valid_fraction or lower train.eval_batches"
        )
    train = GPTSamples(
        dataset, *build_sample_index(train_ids, lengths, seq_len, train_samples, seed), seq_len
    )
    valid = GPTSamples(
        dataset,
        *build_sample_index(valid_ids, lengths, seq_len, valid_samples, seed, shuffle=False),
        seq_len,
    )
    info = {
        "train_documents": len(train_ids),
        "valid_documents": len(valid_ids),
        "train_tokens": int(lengths[train_ids].sum()),
        "valid_tokens": valid_tokens,
    }
    return train, valid, info


def unigram_entropy(dataset: IndexedDataset, doc_ids: np.ndarray | None = None) -> float:
    """Entropy in nats of the empirical unigram token distribution (over ``doc_ids`` or all).

    The loss of a model that ignores context can do no better than this, so a trained LM's loss
    should end well below it. Reads the tokens in chunks (bounded memory).
    """
    tokens = np.memmap(dataset.bin_path, dtype=dataset.dtype, mode="r")
    counts = np.zeros(int(tokens.max()) + 1 if tokens.size else 1, dtype=np.int64)
    if doc_ids is None:
        ranges = [(0, tokens.size)]
    else:
        bounds = np.asarray(dataset.document_indices, dtype=np.int64)
        start = np.asarray(dataset.sequence_pointers, dtype=np.int64)[bounds[:-1]] // dataset.dtype.itemsize
        lengths = document_lengths(dataset)
        ranges = [(int(start[d]), int(start[d] + lengths[d])) for d in doc_ids]
    chunk = 1 << 24
    for lo, hi in ranges:
        for a in range(lo, hi, chunk):
            part = np.asarray(tokens[a : min(hi, a + chunk)])
            counts += np.bincount(part, minlength=counts.size)[: counts.size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
