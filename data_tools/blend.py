"""Blends of datasets with weights, written as Megatron's ``--data-path``: ``"0.7 A 0.3 B"``.

Over N samples dataset d gets ``n_d`` samples with ``|n_d - w_d·N| < 1`` (largest-remainder
apportionment of the normalised weights: floors, then one more to the largest remainders, ties to
the lower dataset index), so the counts match the weights exactly up to rounding. The datasets'
samples are interleaved deterministically: the k-th sample of dataset d is placed at fractional
position (k + 0.5)/n_d and all positions are sorted (stable), which spreads every dataset evenly
over the blend — vectorised, unlike Megatron's per-sample greedy loop. Each dataset's own samples
are already shuffled by seed, so the blend is deterministic by seed.
"""

from __future__ import annotations

import os

import numpy as np

from data_tools.errors import DataFormatError

__all__ = ["apportion", "blend_indices", "parse_blend"]


def parse_blend(spec: str | list, where: str = "data.blend") -> list[tuple[float, str]]:
    """``"0.7 A 0.3 B"`` (or ``[0.7, "A", 0.3, "B"]``) as ``[(0.7, "A"), (0.3, "B")]``, weights
    normalised to sum 1. A single prefix without a weight means weight 1.

    Raises:
        DataFormatError: an odd number of items, a weight that is not a number, negative, or all
            weights zero; the message names ``where`` and the item.
    """
    items = spec.split() if isinstance(spec, str) else [str(x) for x in spec]
    if len(items) == 1:
        return [(1.0, items[0])]
    if not items or len(items) % 2:
        raise DataFormatError(
            f"{where}={spec!r}: expected pairs of weight and prefix, e.g. '0.7 data/a_text_document "
            f"0.3 data/b_text_document', found {len(items)} items"
        )
    pairs = []
    for w, prefix in zip(items[::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataFormatError(
                f"{where}: expected a number before prefix {prefix!r}, found {w!r}"
            ) from None
        if not weight >= 0 or weight == float("inf"):
            raise DataFormatError(
                f"{where}: the weight of {prefix!r} is {w}; weights must be finite and >= 0"
            )
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise DataFormatError(f"{where}={spec!r}: all weights are 0; give at least one positive weight")
    return [(w / total, p) for w, p in pairs]


def check_prefixes(pairs: list[tuple[float, str]], where: str = "data.blend") -> None:
    """Raises DataFormatError naming the first prefix whose ``.bin`` or ``.idx`` is missing."""
    for _, prefix in pairs:
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise DataFormatError(
                f"{where}: prefix {prefix!r}: {', '.join(missing)} not found; build it with "
                "python -m data_tools.preprocess (the prefix ends in _text_document)"
            )


def apportion(weights: np.ndarray | list[float], total: int) -> np.ndarray:
    """int64[K] counts summing to ``total`` with ``|count_d - w_d·total| < 1`` (largest remainder).

    Args:
        weights: K non-negative weights (normalised here).
        total: samples to share out.
    """
    w = np.asarray(weights, dtype=np.float64)
    quota = w / w.sum() * total
    counts = np.floor(quota).astype(np.int64)
    left = total - int(counts.sum())
    # stable sort on the negated remainders: ties go to the lower index, deterministically
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


def blend_indices(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[N], dataset_sample_index int64[N]) interleaving ``counts[d]`` samples of
    each dataset d evenly (see the module docstring), N = ``counts.sum()``."""
    counts = np.asarray(counts, dtype=np.int64)
    which = np.repeat(np.arange(counts.size, dtype=np.int16), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = np.arange(which.size, dtype=np.int64) - starts[which]  # rank of each sample in its dataset
    position = (k + 0.5) / counts[which]
    order = np.argsort(position, kind="stable")  # stable: equal positions keep dataset order
    return which[order], k[order]
