"""Training samples from Megatron ``.bin/.idx`` datasets: packed, shuffled, split by documents, blended.

A sample is ``seq_len + 1`` consecutive tokens of the stream formed by concatenating documents (each
already ended by EOD at preprocessing time) in a shuffled order; ``tokens = x[:-1]``,
``labels = x[1:]``. Consecutive samples share one token, as in Megatron-LM's GPT dataset, so no
token is wasted at sample boundaries.

The index arrays (``doc_idx``, ``sample_idx``, ``shuffle_idx``) are built and cached by
:mod:`data_tools.sample_index` (vectorised numpy, ``.npy`` files under a key that hashes every
parameter, loaded by memory map); blends of several datasets by :mod:`data_tools.blend`. This module
re-exports their functions under the names the trainer and tests have always used.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from data_tools.blend import apportion, blend_indices, check_prefixes, parse_blend
from data_tools.indexed_dataset import DataFormatError, IndexedDataset, open_dataset
from data_tools.sample_index import build_sample_index, load_or_build, split_documents
from data_tools.stats import mixture_unigram_entropy, read_stats

__all__ = [
    "WHOLE_HELDOUT",
    "BlendedSamples",
    "GPTSamples",
    "build_sample_index",
    "build_train_valid",
    "document_lengths",
    "samples_unigram_entropy",
    "split_documents",
    "unigram_entropy",
]


def document_lengths(dataset: IndexedDataset) -> np.ndarray:
    """Tokens per document, int64[D-1], summing the sequences of each document (vectorised)."""
    return dataset.document_lengths(np.int64)


def _advise_random(array: np.ndarray) -> None:
    """madvise(MADV_RANDOM) on the memory map under ``array``, if there is one."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "_mmap", None) or getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_RANDOM"):
        base.madvise(mmap.MADV_RANDOM)


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
        # Per-sample lookups go through the index memmaps (a few entries per sample) instead of
        # per-document arrays built up front: those would be 1.6 GB at 100M documents.
        self._doc_bounds = self.dataset.document_indices
        self._seq_pointers = self.dataset.sequence_pointers
        self._seq_lengths = self.dataset.sequence_lengths
        self._itemsize = self.dataset.dtype.itemsize
        self._tokens = np.memmap(self.dataset.bin_path, dtype=self.dataset.dtype, mode="r")
        # Samples are read in shuffled order: without this hint every page fault of a memmap reads
        # ahead (up to MBs), which multiplies the I/O and fills RSS with pages never used.
        for array in (self._tokens, self._doc_bounds, self.doc_idx, self.sample_idx, self.shuffle_idx):
            _advise_random(array)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def _document(self, doc: int) -> tuple[int, int]:
        """(first token in .bin, length) of document ``doc``; its sequences are contiguous."""
        first, last = int(self._doc_bounds[doc]), int(self._doc_bounds[doc + 1])
        length = (
            int(self._seq_lengths[first]) if last == first + 1 else int(self._seq_lengths[first:last].sum())
        )
        start = int(self._seq_pointers[first]) // self._itemsize if last > first else 0
        return start, length

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64[seq_len + 1]."""
        j = int(self.shuffle_idx[i])
        pos, offset = (int(v) for v in self.sample_idx[j])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        # Walk the few documents this sample spans (a handful at most for real document lengths).
        while filled < out.size:
            start, length = self._document(int(self.doc_idx[pos]))
            take = min(length - offset, out.size - filled)
            out[filled : filled + take] = self._tokens[start + offset : start + offset + take]
            filled += take
            pos += 1
            offset = 0
        return out


@dataclass
class BlendedSamples:
    """Samples of several ``GPTSamples`` interleaved by weight (see :mod:`data_tools.blend`).

    ``samples[i]`` is sample ``dataset_sample_index[i]`` of part ``dataset_index[i]``;
    ``dataset`` is the first part's dataset.
    """

    parts: list[GPTSamples]
    dataset_index: np.ndarray
    dataset_sample_index: np.ndarray

    @property
    def dataset(self) -> IndexedDataset:
        return self.parts[0].dataset

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64[seq_len + 1]."""
        return self.parts[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _datasets_of(prefix: str, blend: str) -> list[tuple[float, str]]:
    """``[(weight, prefix)]`` of a blend (checked), or ``[(1.0, prefix)]``.

    Raises:
        DataFormatError: a bad blend, or a missing ``.bin`` / ``.idx`` (named, with the command that
            builds it).
    """
    if blend:
        pairs = parse_blend(blend)
        check_prefixes(pairs)
        return pairs
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise DataFormatError(
            f"data.prefix='{prefix}': {', '.join(missing)} not found; build the dataset with "
            "python -m data_tools.preprocess --output-prefix ... (the prefix ends in _text_document)"
        )
    return [(1.0, prefix)]


WHOLE_HELDOUT = -1
"""``valid_samples`` of :func:`build_train_valid` meaning every sample the held-out documents hold
(a comparison's final validation: ``train.final_eval_batches = 0``)."""


def _split_one(
    path: str,
    weight: float,
    n_train: int,
    n_valid: int,
    seq_len: int,
    valid_fraction: float,
    split_seed: int,
    seed: int,
    cache_dir: str | None,
    info: dict,
) -> tuple[GPTSamples, GPTSamples]:
    """One dataset's training and validation samples (``n_train`` / ``n_valid`` of them;
    ``n_valid`` = :data:`WHOLE_HELDOUT`: all its held-out samples), its counts added to ``info``
    (see :func:`build_train_valid`).

    Raises:
        DataFormatError: its held-out documents hold fewer than ``n_valid`` samples.
    """
    dataset = open_dataset(path)
    lengths = dataset.document_lengths(np.int64)
    train_ids, valid_ids = split_documents(len(lengths), valid_fraction, split_seed)
    valid_tokens = int(lengths[valid_ids].sum())
    max_valid = (valid_tokens - 1) // seq_len
    if n_valid == WHOLE_HELDOUT:  # every sample the held-out documents hold, in order
        n_valid = max_valid
    if max_valid < n_valid:
        raise DataFormatError(
            f"{path}: the held-out documents hold {valid_tokens} tokens = {max_valid} samples of "
            f"{seq_len + 1}, fewer than the {n_valid} one evaluation reads; raise "
            "data.valid_fraction or lower train.eval_batches"
        )
    common = {"seq_len": seq_len, "seed": seed, "cache_dir": cache_dir, "doc_lengths": lengths}
    # A dataset whose share rounds to 0 samples still gets a 1-sample index: simpler than
    # special cases, and the blend index never points at it.
    tr = load_or_build(dataset, num_samples=max(n_train, 1), doc_ids=train_ids, **common)
    va = load_or_build(dataset, num_samples=max(n_valid, 1), doc_ids=valid_ids, shuffle=False, **common)
    for index in (tr, va):
        if index.cache_hit:
            info["index_cache_hits"] += 1
        elif index.paths is not None:
            info["index_cache_builds"] += 1
    info["train_documents"] += len(train_ids)
    info["valid_documents"] += len(valid_ids)
    info["train_tokens"] += int(lengths[train_ids].sum())
    info["valid_tokens"] += valid_tokens
    info["blend"].append(
        {
            "prefix": path,
            "weight": weight,
            "train_samples": n_train,
            "valid_samples": n_valid,
            "index_cache_hit": tr.cache_hit,
        }
    )
    return (
        GPTSamples(dataset, tr.doc_idx, tr.sample_idx, tr.shuffle_idx, seq_len),
        GPTSamples(dataset, va.doc_idx, va.sample_idx, va.shuffle_idx, seq_len),
    )


def build_train_valid(
    prefix: str,
    seq_len: int,
    train_samples: int,
    valid_samples: int,
    valid_fraction: float,
    seed: int,
    *,
    split_seed: int | None = None,
    blend: str = "",
    cache_dir: str | None = None,
) -> tuple[GPTSamples | BlendedSamples, GPTSamples | BlendedSamples, dict]:
    """Open the dataset(s) and build the training and validation samples.

    Validation samples come from held-out documents of each dataset in natural order (the same every
    evaluation). With ``blend`` (Megatron's ``--data-path`` form, ``"0.7 A 0.3 B"``) ``prefix`` is
    ignored and each dataset gets its weight's share of the train and of the validation samples.
    ``valid_samples`` = :data:`WHOLE_HELDOUT` (-1) takes every sample the held-out documents hold
    (of a blend: each dataset's, blended in proportion to them): the whole held-out set, in order,
    whose first ``n`` samples are those a build of ``n`` gives (the order does not depend on the
    count), so a run's regular validations read the same samples either way.

    Args:
        seed: seeds the training samples' order.
        split_seed: seeds the choice of held-out documents (``None``: ``seed``), so that runs of
            several seeds can be evaluated on the same documents.
        cache_dir: where the sample indices are cached (``None``: built every time, not saved).

    Returns:
        ``(train, valid, info)`` where info holds document and token counts of each split (summed
        over a blend), ``index_cache_hits``/``index_cache_builds``: sample indices loaded from /
        built into ``cache_dir``, and, for a blend, ``"blend"``: per dataset its prefix, weight and
        sample counts.

    Raises:
        DataFormatError: missing or corrupt dataset files, a bad blend, too little data.
    """
    pairs = _datasets_of(prefix, blend)
    weights = [w for w, _ in pairs]
    train_counts = apportion(weights, train_samples)
    whole = valid_samples == WHOLE_HELDOUT
    valid_counts = np.full(len(pairs), WHOLE_HELDOUT) if whole else apportion(weights, valid_samples)
    info = {"train_documents": 0, "valid_documents": 0, "train_tokens": 0, "valid_tokens": 0, "blend": []}
    info |= {"index_cache_hits": 0, "index_cache_builds": 0}  # sample indices loaded / built (cached)
    split_by = seed if split_seed is None else split_seed  # resolved once, for every dataset
    trains, valids = [], []
    for (weight, path), n_train, n_valid in zip(pairs, train_counts.tolist(), valid_counts.tolist()):
        tr, va = _split_one(
            path, weight, n_train, n_valid, seq_len, valid_fraction, split_by, seed, cache_dir, info
        )
        trains.append(tr)
        valids.append(va)
    if len(pairs) == 1:
        return trains[0], valids[0], info
    train = BlendedSamples(trains, *blend_indices(train_counts))
    if whole:  # the counts are known only now
        valid_counts = np.array([len(v) for v in valids], dtype=np.int64)
    valid = BlendedSamples(valids, *blend_indices(valid_counts))
    return train, valid, info


def _unigram_counts(dataset: IndexedDataset, doc_ids: np.ndarray | None = None) -> np.ndarray:
    """int64[max_id + 1]: how often each token id occurs (in ``doc_ids`` or all documents).

    Reads the tokens (in chunks): for tools and tests only, never on the training path.
    """
    tokens = np.memmap(dataset.bin_path, dtype=dataset.dtype, mode="r") if dataset.num_tokens else np.zeros(0)
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
    return counts


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def unigram_entropy(dataset: IndexedDataset, doc_ids: np.ndarray | None = None) -> float:
    """Entropy in nats of the empirical unigram token distribution (over ``doc_ids`` or all).

    SCANS the token stream (in chunks, bounded memory): for tools and tests. The training path uses
    :func:`samples_unigram_entropy`, which reads the datasets' statistics sidecars instead.
    """
    counts = _unigram_counts(dataset, doc_ids)
    return _entropy(counts / max(int(counts.sum()), 1))


def samples_unigram_entropy(samples: GPTSamples | BlendedSamples) -> float:
    """Unigram entropy in nats of the data a run trains on: of one dataset, or of a blend's mixture.

    Read from each dataset's statistics sidecar (``{prefix}.stats.json``, written at preprocessing):
    no token is read. Counts cover each dataset whole, its held-out documents included (a few
    percent of it): a reference level for the loss, not a figure of the training split alone.

    For a blend the distribution is ``sum_i f_i * p_i``, with ``p_i`` the unigram distribution of
    part i and ``f_i`` the fraction of the blend's samples drawn from it (the weights, to within
    one sample): the best loss a context-free model can reach on the blended stream.

    Raises:
        DataFormatError: a dataset's sidecar is missing, unreadable or stale (the message names the
            file and the ``python -m data_tools.stats`` command that writes it).
    """
    if isinstance(samples, GPTSamples):
        return read_stats(samples.dataset.prefix).unigram_entropy
    shares = np.bincount(np.asarray(samples.dataset_index), minlength=len(samples.parts)) / len(samples)
    return mixture_unigram_entropy([read_stats(part.dataset.prefix) for part in samples.parts], shares)
