"""Training-sample indices over a ``.bin``/``.idx`` dataset, vectorised and cached as ``.npy``.

A sample is ``seq_len + 1`` consecutive tokens of the stream formed by concatenating documents in a
shuffled order (one fresh permutation per epoch); consecutive samples share one token. Three arrays:

* ``doc_idx``     int32[E·D] (int64 past 2**31): the document order over E epochs of D documents;
* ``sample_idx``  int32[S + 1, 2]: where sample i starts, (position in doc_idx, token offset in
  that document); row S is where the stream past the last sample begins;
* ``shuffle_idx`` int32[S]: the order in which samples are served.

The order does not depend on S, the number of samples asked for: samples are shuffled within
chunks of the stream whose bounds depend only on the documents and ``seq_len`` (each epoch, the
samples starting in its tokens, cut into chunks of at most ``ORDER_CHUNK`` samples), each chunk by
its own seeded permutation. The first N samples served are therefore the same for any run length
(a run extended from 20 to 30 steps serves in steps 21-30 samples it has not served), and no sample
is served twice within an epoch. The arrays are built through the end of the last chunk needed
(``sample_idx`` may hold more rows than S + 1; ``shuffle_idx`` holds S entries).

Two builds give the same arrays bit for bit. The reference is numpy (no Python loop over
documents or samples): a keyed pseudorandom permutation computed blockwise
(``random_permutation``; ``rng.permutation`` for small sizes), a blockwise cumulative sum, and
``np.repeat`` of each document's position by the number of sample starts it holds (linear time,
unlike a binary search per sample). For large indices (4M documents + samples and more) the same
steps run as compiled loops (:mod:`data_tools.index_kernels`, numba) that write each array once,
in place, without numpy's temporaries (at 100M documents the arrays take 3 s instead of 8.6 s, and
the whole cold start of ``bench/index_scale.py`` 1.9 GB of peak RSS instead of 2.4 GB); without
numba, numpy builds them (after a one-line note). At 100M documents / 54M samples of 2048 (one
epoch, whose last sample reaches one token into a second epoch, so doc_idx holds two) the arrays
are 0.8 + 0.43 + 0.22 GB. ``load_or_build`` saves each array on a thread while the next is built.

Cache: ``load_or_build`` stores the three arrays under ``{name}_{key}_{doc,sample,shuffle}_idx.npy``
where ``key`` hashes everything that shapes them: the dataset's index content (its sequence lengths,
by SHA-256, not its path or mtime, so a copy on another node hits the same key), the selected
documents, ``seq_len``, ``num_samples``, ``seed`` and ``shuffle``. Files are written under unique
temporary names and renamed with ``os.replace``, so several processes building the same index at
once (one per rank, or nodes without a shared filesystem) never see a half-written file; they
are loaded with ``mmap_mode="r"``.

This module imports numpy and the data tools only (no torch): ``python -m data_tools.build_index``
uses it ahead of a run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import HEADER_SIZE, IndexedDataset

__all__ = [
    "SampleIndex",
    "build_sample_index",
    "compiled_kernels",
    "dataset_digest",
    "load_or_build",
    "split_documents",
]

INDEX_FORMAT = 3  # bump when the arrays' meaning or order changes: old cache entries then miss
_BLOCK = 1 << 23  # documents per block of the sample-start pass (bounds its scratch memory)
_PLAIN_SHUFFLE_MAX = 1 << 20  # up to this many elements, rng.permutation (in cache, fast enough)
_PERM_BLOCK = 1 << 20  # elements per block of random_permutation's arithmetic (in cache)
_PERM_ROUNDS = 8
ORDER_CHUNK = 1 << 22
"""Most samples shuffled together (4,194,304: 8.6B tokens at seq_len 2048); chunks of one epoch
are served one after another, so this bounds the index built for a run shorter than an epoch."""
_HASH_BLOCK = 64 << 20
_KERNELS: dict = {}  # compiled_kernels()'s answer, once per process
_COMPILED_FROM = 4_000_000  # documents + samples from which compiled=None takes the compiled path


def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


def compiled_kernels():
    """The module :mod:`data_tools.index_kernels` (numba), imported on first use, or ``None``
    where numba is not usable (the reason is printed to stderr once per process) or where the
    environment sets ``MEGAFORMER_INDEX_NUMPY=1`` (numpy asked for: no note)."""
    if "kernels" not in _KERNELS:
        _KERNELS["kernels"] = None
        if os.environ.get("MEGAFORMER_INDEX_NUMPY") != "1":
            try:
                _KERNELS["kernels"] = importlib.import_module("data_tools.index_kernels")
            except Exception as e:  # ImportError, or a numba that does not work with this numpy
                print(
                    f"note: numba is not usable here ({type(e).__name__}: {e}); sample indices are built "
                    "with numpy instead: the same indices, about 3x slower and with about 25% more "
                    "memory (scripts/install.sh installs numba)",
                    file=sys.stderr,
                )
    return _KERNELS["kernels"]


def split_documents(num_documents: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits document ids into train and validation sets, whole documents, deterministically by seed.

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
    doc_ids: np.ndarray | None,
    doc_lengths: np.ndarray,
    seq_len: int,
    num_samples: int,
    seed: int,
    shuffle: bool = True,
    *,
    compiled: bool | None = None,
    _sink=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Builds (doc_idx, sample_idx, shuffle_idx) for ``num_samples`` samples of ``seq_len + 1`` tokens.

    Args:
        doc_ids: int[D] ids of the documents to draw from; ``None``: all of them (the same indices
            as ``np.arange(len(doc_lengths))``, without that array).
        doc_lengths: int[total documents], tokens per document of the whole dataset.
        seq_len: tokens per sample input (each sample holds seq_len + 1 tokens).
        num_samples: samples wanted; as many epochs over ``doc_ids`` are made as this needs.
        seed: seeds the per-epoch document permutations and the sample shuffle.
        shuffle: shuffle documents per epoch and samples (False: natural order, for evaluation).
        compiled: build with the compiled kernels of :mod:`data_tools.index_kernels` (numba):
            ``None``: for 4M documents + samples or more, when numba is usable (see
            :func:`compiled_kernels`; smaller indices take numpy well under a second, less than
            importing numba); ``False``: with numpy (the reference: the same arrays, about 3x
            slower at 100M documents and with 25% more memory); ``True``: with the kernels or not
            at all.
        _sink: ``sink(i, array)`` is called with each of the three arrays (i = 0, 1, 2) as soon as
            it is final, by the compiled build (:func:`load_or_build` saves it meanwhile).

    Returns:
        doc_idx [E·D], sample_idx [B + 1, 2] (B >= num_samples: through the last order chunk),
        shuffle_idx [num_samples]; int32 where
        the values fit, else int64.

    Raises:
        DataFormatError: the documents hold no more than ``seq_len`` tokens (not one sample), or
            ``num_samples``/``seq_len`` below 1.
        RuntimeError: ``compiled=True`` and numba is not usable.
    """
    if seq_len < 1 or num_samples < 1:
        raise DataFormatError(f"expected seq_len >= 1 and num_samples >= 1, got {seq_len} and {num_samples}")
    doc_lengths = np.asarray(doc_lengths)
    # Below a few million documents and samples numpy takes well under a second, less than
    # importing numba: the compiled path is for large indices (or asked for).
    large = (doc_lengths.size if doc_ids is None else len(doc_ids)) + num_samples >= _COMPILED_FROM
    kernels = compiled_kernels() if compiled or (compiled is None and large) else None
    if compiled and kernels is None:
        raise RuntimeError("compiled=True, but numba is not usable here (see the note above)")
    if kernels is not None:
        return _build_compiled(kernels, doc_ids, doc_lengths, seq_len, num_samples, seed, shuffle, _sink)
    return _build_numpy(doc_ids, doc_lengths, seq_len, num_samples, seed, shuffle)


def _build_numpy(
    doc_ids: np.ndarray | None,
    doc_lengths: np.ndarray,
    seq_len: int,
    num_samples: int,
    seed: int,
    shuffle: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`build_sample_index` with numpy: the reference the compiled build is tested against
    (same arguments, same arrays, same errors)."""
    if doc_ids is None:
        doc_ids = np.arange(doc_lengths.size, dtype=_index_dtype(doc_lengths.size))
    doc_ids = np.asarray(doc_ids)
    tokens_per_epoch = int(np.sum(doc_lengths[doc_ids], dtype=np.int64))
    if tokens_per_epoch <= seq_len:
        raise DataFormatError(
            f"the selected documents hold {tokens_per_epoch} tokens, fewer than one sample of "
            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter model.seq_len"
        )
    # Sample i covers stream positions [i·seq_len, i·seq_len + seq_len], so the stream must reach
    # num_samples·seq_len + 1 tokens.
    chunks = list(order_chunks(num_samples, tokens_per_epoch, seq_len)) if shuffle else []
    built = chunks[-1][2] if shuffle else num_samples  # through the end of the last chunk needed
    epochs = -(-(built * seq_len + 1) // tokens_per_epoch)
    ids = doc_ids.astype(_index_dtype(int(doc_ids.max(initial=0)) + 1), copy=False)
    rng = np.random.default_rng([seed, 0xD0C])
    # ids = arange(D) (all documents, the usual case): the permutation is doc_idx, no gather needed.
    is_all = (
        ids.size and int(ids[0]) == 0 and int(ids[-1]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))
    )
    if shuffle:
        perms = [random_permutation(ids.size, rng, ids.dtype) for _ in range(epochs)]
        doc_idx = perms[0] if epochs == 1 else np.concatenate(perms)  # no copy for one epoch
        del perms
        if not is_all:
            doc_idx = ids[doc_idx]
    else:
        doc_idx = np.tile(ids, epochs)
    sample_idx = _sample_starts(doc_idx, doc_lengths, seq_len, built)
    order_dtype = _index_dtype(built)
    if shuffle:
        parts = [
            lo + random_permutation(hi - lo, np.random.default_rng([seed, 0x5A3, epoch, lo]), order_dtype)
            for epoch, lo, hi in chunks
        ]
        order = np.concatenate(parts)[:num_samples]
    else:
        order = np.arange(num_samples, dtype=order_dtype)
    return doc_idx, sample_idx, order


def order_chunks(num_samples: int, tokens_per_epoch: int, seq_len: int):
    """``(epoch, first, end)`` of each chunk of samples shuffled together, in serving order, until
    the chunk holding sample ``num_samples - 1``. Epoch e's samples are those starting in its
    tokens, ``[ceil(e·T / L), ceil((e + 1)·T / L))`` (T tokens per epoch, L = ``seq_len``), cut every
    :data:`ORDER_CHUNK` samples: bounds that do not depend on ``num_samples``."""
    epoch = 0
    while True:
        lo, hi = -(-epoch * tokens_per_epoch // seq_len), -(-(epoch + 1) * tokens_per_epoch // seq_len)
        for first in range(lo, hi, ORDER_CHUNK):
            if first >= num_samples:
                return
            yield epoch, first, min(first + ORDER_CHUNK, hi)
        epoch += 1


def random_permutation(n: int, rng: np.random.Generator, dtype: type = np.int64) -> np.ndarray:
    """A pseudorandom permutation of ``range(n)`` keyed by ``rng`` (deterministic by its state).

    Up to ``_PLAIN_SHUFFLE_MAX`` elements: ``rng.permutation``. Above, ``perm[i] = f(i)`` for a
    keyed bijection ``f`` of ``[0, 2**b)`` (b = bits of n - 1) made of rounds of add-a-key,
    multiply-by-an-odd-key and xor-shift, all modulo ``2**b`` and each a bijection, with values
    ``>= n`` mapped again until they fall in range (cycle walking, which keeps ``f`` a bijection of
    ``[0, n)``; under 2 applications on average). Computed blockwise with sequential writes only: a
    Fisher–Yates shuffle of 100M ids takes 4-7 s here, every swap a cache and TLB miss, this about
    1 s. Its 8 rounds x 3 operations with random 32-bit keys mix every input bit into every output
    bit; a different order from ``rng.permutation`` but as good for shuffling training data.
    """
    if n <= _PLAIN_SHUFFLE_MAX:
        return rng.permutation(n).astype(dtype, copy=False)
    keys = _permutation_keys(n, rng)
    out = np.empty(n, dtype=dtype)
    for c0 in range(0, n, _PERM_BLOCK):
        c1 = min(c0 + _PERM_BLOCK, n)
        out[c0:c1] = _bijection(c0, c1, n, keys)
    return out


def _bijection(first: int, stop: int, n: int, keys: tuple) -> np.ndarray:
    """``random_permutation(n, ...)[first:stop]`` for the bijection of ``keys`` (see
    :func:`_permutation_keys`), in its work dtype: numpy, block-wise, the reference."""
    work, mask, shift, adds, muls = keys

    def f(x: np.ndarray) -> np.ndarray:  # in place; unsigned arithmetic wraps, then & mask
        for a, m in zip(adds, muls):
            x += a
            x *= m
            x &= mask
            x ^= x >> shift
        return x

    x = f(np.arange(first, stop, dtype=work))
    walk = np.flatnonzero(x >= n)
    while walk.size:
        y = f(x[walk])
        x[walk] = y
        walk = walk[y >= n]
    return x


def _permutation_keys(n: int, rng: np.random.Generator) -> tuple:
    """``(work dtype, mask, shift, adds, muls)`` of :func:`random_permutation`'s bijection for
    ``n > _PLAIN_SHUFFLE_MAX`` elements, drawn from ``rng`` (both builds draw them here, in the
    same order)."""
    bits = (n - 1).bit_length()
    work = np.uint32 if bits <= 32 else np.uint64
    mask = work((1 << bits) - 1)
    shift = work((bits + 1) // 2)
    adds = rng.integers(0, 1 << bits, _PERM_ROUNDS, dtype=np.uint64).astype(work)
    muls = (rng.integers(0, 1 << bits, _PERM_ROUNDS, dtype=np.uint64) | 1).astype(work)
    return work, mask, shift, adds, muls


def _permute_into(
    kernels, out: np.ndarray, n: int, rng: np.random.Generator, base: int = 0, ids: np.ndarray | None = None
) -> None:
    """Compiled path: ``out[:] = base + random_permutation(n, rng)[:out.size]`` (or ``ids[...]``
    of it), drawing from ``rng`` exactly as :func:`random_permutation` does, and computing only
    the ``out.size`` values needed."""
    if n <= _PLAIN_SHUFFLE_MAX:
        perm = rng.permutation(n)[: out.size]
        out[:] = ids[perm] if ids is not None else base + perm
        return
    _, mask, shift, adds, muls = _permutation_keys(n, rng)
    u64 = np.uint64
    no_ids = np.zeros(0, dtype=out.dtype)
    kernels.permutation(
        out, 0, out.size, u64(n), adds.astype(u64), muls.astype(u64), u64(mask), u64(shift), base,
        no_ids if ids is None else ids,
    )  # fmt: skip


def _build_compiled(
    kernels, doc_ids: np.ndarray | None, doc_lengths: np.ndarray, seq_len: int, num_samples: int, seed: int,
    shuffle: bool, sink=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`build_sample_index` with the compiled kernels: the same arrays, each written once
    in place (no temporaries as large as the index), and no ``arange`` for all documents."""
    if doc_ids is None:
        tokens_per_epoch = int(np.sum(doc_lengths, dtype=np.int64))
        num_ids, dtype, is_all = doc_lengths.size, _index_dtype(doc_lengths.size), True
        ids = None
    else:
        doc_ids = np.asarray(doc_ids)
        tokens_per_epoch = int(kernels.gather_sum(doc_lengths, doc_ids)) if doc_ids.size else 0
        num_ids, dtype = doc_ids.size, _index_dtype(int(doc_ids.max(initial=0)) + 1)
        ids = doc_ids.astype(dtype, copy=False)
        is_all = bool(ids.size) and bool(kernels.is_arange(ids))
    if tokens_per_epoch <= seq_len:
        raise DataFormatError(
            f"the selected documents hold {tokens_per_epoch} tokens, fewer than one sample of "
            f"seq_len + 1 = {seq_len + 1}; use more data or a shorter model.seq_len"
        )
    chunks = list(order_chunks(num_samples, tokens_per_epoch, seq_len)) if shuffle else []
    built = chunks[-1][2] if shuffle else num_samples
    epochs = -(-(built * seq_len + 1) // tokens_per_epoch)
    if shuffle:
        rng = np.random.default_rng([seed, 0xD0C])
        doc_idx = np.empty(epochs * num_ids, dtype=dtype)
        for e in range(epochs):
            part = doc_idx[e * num_ids : (e + 1) * num_ids]
            _permute_into(kernels, part, num_ids, rng, ids=None if is_all else ids)
    else:
        doc_idx = np.tile(np.arange(num_ids, dtype=dtype) if ids is None else ids, epochs)
    if sink is not None:
        sink(0, doc_idx)
    total = built + 1
    sample_idx = np.empty((total, 2), dtype=_index_dtype(max(doc_idx.size, int(doc_lengths.max(initial=0)))))
    filled = kernels.sample_starts(doc_idx, doc_lengths, seq_len, total, sample_idx)
    if filled != total:  # epochs are enough
        raise AssertionError(f"the stream holds {filled} sample starts, expected {total}")
    if sink is not None:
        sink(1, sample_idx)
    order = np.empty(num_samples, dtype=_index_dtype(built))
    if shuffle:
        for epoch, lo, hi in chunks:
            part = order[lo : min(hi, num_samples)]
            _permute_into(kernels, part, hi - lo, np.random.default_rng([seed, 0x5A3, epoch, lo]), base=lo)
    else:
        order[:] = np.arange(num_samples, dtype=order.dtype)
    if sink is not None:
        sink(2, order)
    return doc_idx, sample_idx, order


def _sample_starts(
    doc_idx: np.ndarray, doc_lengths: np.ndarray, seq_len: int, num_samples: int
) -> np.ndarray:
    """sample_idx[S + 1, 2]: for each start k·seq_len, (position in doc_idx, offset in that doc).

    Document j of the stream, spanning tokens [start_j, end_j), holds the sample starts k with
    ceil(start_j / L) <= k < ceil(end_j / L); repeating j that many times lists the documents of
    all starts in order. Blocks of ``_BLOCK`` documents bound the scratch memory.
    """
    total = num_samples + 1
    out = np.empty((total, 2), dtype=_index_dtype(max(doc_idx.size, int(doc_lengths.max(initial=0)))))
    shift = seq_len.bit_length() - 1 if seq_len & (seq_len - 1) == 0 else None
    filled = 0
    carry = 0  # stream tokens before the block
    prev_ceil = 0  # ceil(carry / L)
    for b0 in range(0, doc_idx.size, _BLOCK):
        lens = doc_lengths[doc_idx[b0 : b0 + _BLOCK]]
        ends = np.cumsum(lens, dtype=np.int64)
        ends += carry
        # ceil(end / L) per document; ceil(start / L) is the previous document's ceil(end / L).
        ceil_end = (ends + (seq_len - 1)) >> shift if shift is not None else -(-ends // seq_len)
        counts = np.diff(ceil_end, prepend=prev_ceil)
        local = np.repeat(np.arange(ends.size, dtype=np.int64), counts)
        take = min(local.size, total - filled)
        local = local[:take]
        out[filled : filled + take, 0] = local + b0
        # offset = k·L - start of its document = k·L - end + length
        offsets = np.arange(filled, filled + take, dtype=np.int64) * seq_len
        offsets -= ends[local]
        offsets += lens[local]
        out[filled : filled + take, 1] = offsets
        filled += take
        if ends.size:
            carry, prev_ceil = int(ends[-1]), int(ceil_end[-1])
        if filled == total:
            return out
    raise AssertionError(f"the stream holds {filled} sample starts, expected {total}")  # epochs are enough


def dataset_digest(dataset: IndexedDataset) -> str:
    """SHA-256 of what in the ``.idx`` shapes sample indices: dtype, counts, sequence lengths and
    document indices (not the path or the mtime: a copy on another node has the same digest).

    Reads the index in 64 MB blocks through file reads, each hashed on a second thread while the
    next is read (hashlib and file reads release the GIL): at 100M documents, 1.2 GB in about
    0.7 s instead of 1.2 s here.
    """
    h = hashlib.sha256()
    n, d = len(dataset), dataset.num_documents + 1
    h.update(f"{dataset.dtype.str}:{n}:{d}".encode())
    sections = [(HEADER_SIZE, 4 * n), (HEADER_SIZE + 12 * n, 8 * d)]  # lengths, document indices
    with open(dataset.idx_path, "rb") as f, ThreadPoolExecutor(1, thread_name_prefix="index-hash") as pool:
        hashing = None  # the previous block's update, in flight
        for start, size in sections:
            f.seek(start)
            while size > 0:
                block = f.read(min(_HASH_BLOCK, size))
                if not block:
                    raise DataFormatError(f"{dataset.idx_path}: truncated while hashing")
                if hashing is not None:
                    hashing.result()  # blocks are hashed in order
                hashing = pool.submit(h.update, block)
                size -= len(block)
        if hashing is not None:
            hashing.result()
    return h.hexdigest()


@dataclass(frozen=True)
class SampleIndex:
    """The three arrays (read-only memmaps when loaded from the cache) and where they live.

    Attributes:
        doc_idx, sample_idx, shuffle_idx: see the module docstring.
        paths: the three ``.npy`` files, or ``None`` for an index not cached.
        cache_hit: True when the arrays were loaded, False when built by this call.
    """

    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    paths: tuple[Path, Path, Path] | None
    cache_hit: bool


def cache_key(
    digest: str, doc_ids: np.ndarray | None, seq_len: int, num_samples: int, seed: int, shuffle: bool
) -> str:
    """24 hex digits hashing every parameter that shapes the indices (``doc_ids=None``: all documents)."""
    ids = "all" if doc_ids is None else hashlib.sha256(np.ascontiguousarray(doc_ids, dtype="<i8")).hexdigest()
    spec = {
        "format": INDEX_FORMAT,
        "dataset": digest,
        "documents": ids,
        "seq_len": seq_len,
        "num_samples": num_samples,
        "seed": seed,
        "shuffle": shuffle,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


class _Saver:
    """Saves the three arrays of an index, in order (the shuffle index renamed into place last:
    readers check all three, and a file that another builder replaces meanwhile has the same
    content, the build being deterministic), on a thread of its own: numpy's file writes and the
    compiled kernels release the GIL, so saving overlaps building. The first failure (a read-only
    or full cache directory: ``OSError``) stops the saves; :meth:`finish` waits for them and
    returns it."""

    def __init__(self, paths: tuple[Path, Path, Path]) -> None:
        self._paths = paths
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="index-save")
        self._handed: set[int] = set()
        self._error: OSError | None = None
        self._futures = [self._pool.submit(self._mkdir)]

    def _mkdir(self) -> None:
        try:
            self._paths[0].parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._error = e

    def _write(self, i: int, array: np.ndarray) -> None:
        if self._error is None:
            try:
                _save_atomic(self._paths[i], array)
            except OSError as e:
                self._error = e

    def save(self, i: int, array: np.ndarray) -> None:
        """Queues array ``i`` (once)."""
        if i not in self._handed:
            self._handed.add(i)
            self._futures.append(self._pool.submit(self._write, i, array))

    def finish(self) -> OSError | None:
        """Waits for the saves; the first ``OSError`` among them, or ``None``. Other errors (bugs)
        are raised."""
        self._pool.shutdown(wait=True)
        for f in self._futures:
            f.result()
        return self._error


def _save_atomic(path: Path, array: np.ndarray) -> None:
    # A unique temporary name per writer: two processes building at once never write one file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)  # atomic: a reader sees the old file, the new file, or none
    finally:
        tmp.unlink(missing_ok=True)


def load_or_build(
    dataset: IndexedDataset,
    *,
    seq_len: int,
    num_samples: int,
    seed: int,
    shuffle: bool = True,
    doc_ids: np.ndarray | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    doc_lengths: np.ndarray | None = None,
    digest: str | None = None,
) -> SampleIndex:
    """The sample indices of ``dataset``: loaded from ``cache_dir`` by memory map, or built (and
    saved there). ``cache_dir=None`` builds without caching.

    Args:
        dataset: the opened dataset.
        seq_len, num_samples, seed, shuffle: see ``build_sample_index``.
        doc_ids: the documents to draw from (e.g. a train split); ``None``: all of them.
        cache_dir: directory of the ``.npy`` files (created if missing); one per node is fine.
        doc_lengths: tokens per document if already at hand (else read from the index).
        digest: ``dataset_digest(dataset)`` if already at hand.

    Raises:
        DataFormatError: too little data for one sample (see ``build_sample_index``).
    """
    paths = None
    if cache_dir is not None:
        digest = digest or dataset_digest(dataset)
        key = cache_key(digest, doc_ids, seq_len, num_samples, seed, shuffle)
        name = Path(dataset.idx_path).name.removesuffix(".idx")
        d = Path(cache_dir)
        paths = tuple(d / f"{name}_{key}_{what}_idx.npy" for what in ("doc", "sample", "shuffle"))
        if all(p.is_file() for p in paths):
            arrays = [np.load(p, mmap_mode="r") for p in paths]
            return SampleIndex(*arrays, paths=paths, cache_hit=True)
    if doc_lengths is None:
        doc_lengths = dataset.document_lengths(np.int32)
    if paths is None:
        arrays = build_sample_index(doc_ids, doc_lengths, seq_len, num_samples, seed, shuffle)
        return SampleIndex(*arrays, paths=None, cache_hit=False)
    saver = _Saver(paths)
    try:
        # The compiled build hands each array over as soon as it is final, and it is saved while
        # the next is built (a GB of writes that can take seconds when the disk is busy); the
        # numpy build's arrays are saved after it.
        arrays = build_sample_index(
            doc_ids, doc_lengths, seq_len, num_samples, seed, shuffle, _sink=saver.save
        )
        for i, a in enumerate(arrays):
            saver.save(i, a)  # no-op for an array already handed over
    finally:
        e = saver.finish()
    if e is not None:  # a read-only or full cache directory: the run needs no cache
        print(
            f"warning: cannot save the sample index in the cache directory {cache_dir} "
            f"({e.strerror or e}); using it from memory (it is rebuilt by the next run): point "
            "data.index_cache_dir at a writable directory, or prebuild it there with "
            "python -m data_tools.build_index",
            file=sys.stderr,
        )
        paths = None
    return SampleIndex(*arrays, paths=paths, cache_hit=False)
