"""The compiled path of :mod:`data_tools.sample_index`: its loops in numba, the same arrays bit for bit.

numpy builds the indices in passes over whole arrays: each round of the keyed permutation is a
pass over a block, the sample starts need a cumulative sum, a ``diff``, a ``repeat`` and their
temporaries (GBs at 100M documents). Here each is one loop over the data, written straight into
the output, compiled by numba (``cache=True``: compiled on first use, a few seconds, and cached
in ``__pycache__`` beside this file, or in numba's per-user cache where that is not writable).

Importing this module imports numba (about 0.3 s): :func:`data_tools.sample_index.kernels` does
it lazily, only to build an index, and falls back to the numpy code (the reference, which
``tests/unit/test_index_kernels.py`` compares with these bitwise) when numba is not usable.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["gather_sum", "is_arange", "permutation", "sample_starts"]

_BLOCK = 2048  # elements per block (16 KB of uint64: in L1)
_jit = numba.njit(cache=True, nogil=True)


@_jit
def permutation(out, first, count, n, adds, muls, mask, shift, base, ids):
    """``out[k] = base + g(first + k)`` for ``k < count``, where ``g`` is
    :func:`data_tools.sample_index.random_permutation`'s keyed bijection of ``[0, n)`` (rounds of
    add, multiply and xor-shift modulo ``mask + 1``, cycle-walking values ``>= n``); with ``ids``
    non-empty, ``out[k] = ids[g(first + k)]`` instead.

    All arithmetic is in uint64: the numpy reference works in uint32 when ``n <= 2**32``, which
    agrees because every value is reduced modulo ``mask + 1``, a power of two dividing ``2**32``.
    Blocks of ``_BLOCK`` values go through each round in a simple loop (SIMD); the values still
    out of range are gathered and go through the rounds again together (as numpy does), not one
    by one in a branchy scalar loop, which was 10x slower than the rounds themselves.
    """
    block = np.empty(_BLOCK, dtype=np.uint64)
    walk = np.empty(_BLOCK, dtype=np.int64)  # positions in block still >= n
    values = np.empty(_BLOCK, dtype=np.uint64)
    gather = ids.size > 0
    for b0 in range(0, count, _BLOCK):
        m = min(_BLOCK, count - b0)
        for j in range(m):
            block[j] = np.uint64(first + b0 + j)
        _rounds(block, m, adds, muls, mask, shift)
        left = 0
        for j in range(m):  # branch-free compaction
            walk[left] = j
            left += block[j] >= n
        while left:
            for t in range(left):
                values[t] = block[walk[t]]
            _rounds(values, left, adds, muls, mask, shift)
            still = 0
            for t in range(left):
                block[walk[t]] = values[t]
                walk[still] = walk[t]
                still += values[t] >= n
            left = still
        if gather:
            for j in range(m):
                out[b0 + j] = ids[np.int64(block[j])]
        else:
            for j in range(m):
                out[b0 + j] = base + np.int64(block[j])


@_jit
def _rounds(x, m, adds, muls, mask, shift):
    """The bijection's rounds on ``x[:m]`` in place, one simple loop per round (vectorised)."""
    for r in range(adds.size):
        a, mul = adds[r], muls[r]
        for j in range(m):
            y = ((x[j] + a) * mul) & mask
            x[j] = y ^ (y >> shift)


@_jit
def sample_starts(doc_idx, doc_lengths, seq_len, total, out):
    """``out[k] = (position in doc_idx, token offset)`` of the document holding stream token
    ``k * seq_len``, for ``k < total``; returns how many rows were filled (``total`` unless the
    documents run out). Document j of the stream, tokens ``[start, end)``, holds the starts
    ``k * seq_len`` in that range.

    The lengths of a block of documents are gathered first, in a loop without branches, so that
    the processor has many of these random reads (a cache miss each past a few million documents)
    in flight at once; the scan's unpredictable branches would cancel them otherwise.
    """
    lengths = np.empty(_BLOCK, dtype=np.int64)
    filled = 0
    start = 0  # stream tokens before the document
    k_tokens = 0  # filled * seq_len: the next sample start
    if total == 0:
        return 0
    for b0 in range(0, doc_idx.size, _BLOCK):
        m = min(_BLOCK, doc_idx.size - b0)
        for j in range(m):
            lengths[j] = doc_lengths[doc_idx[b0 + j]]
        for j in range(m):
            end = start + lengths[j]
            while k_tokens < end:
                out[filled, 0] = b0 + j
                out[filled, 1] = k_tokens - start
                filled += 1
                if filled == total:
                    return filled
                k_tokens += seq_len
            start = end
    return filled


@_jit
def gather_sum(values, ids):
    """``sum(values[ids])`` in int64, without the gathered copy."""
    total = 0
    for i in range(ids.size):
        total += np.int64(values[ids[i]])
    return total


@_jit
def is_arange(ids):
    """Whether ``ids`` is ``0, 1, ..., ids.size - 1``."""
    for i in range(ids.size):  # noqa: SIM110 (numba compiles no generator expression)
        if ids[i] != i:
            return False
    return True
