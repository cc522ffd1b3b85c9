"""Held-out data beyond ``data.valid_fraction``: separate validation / test datasets and Megatron's
``--split`` form.

* ``data.valid_prefix`` / ``data.test_prefix`` (Megatron's ``--valid-data-path`` / ``--test-data-path``):
  validation (test) reads that dataset, all of its documents in their natural order, e.g. the
  ``--holdout-prefix`` output of ``python -m data_tools.split``; training then reads every document of
  ``data.prefix`` / ``data.blend`` (nothing is held out of it).
* ``data.split: "969,30,1"`` (Megatron's ``--split``): the documents of ``data.prefix`` are cut into
  three contiguous ranges, train / validation / test, in these proportions, with Megatron's
  rounding (``get_train_valid_test_split_`` in ``megatron/core/datasets/utils.py``: each boundary
  ``round(share · documents)`` accumulated, the excess taken off every boundary after the first).
  A zero share means no such set.

Validation and test samples are read in order (no shuffle), from the start, so the first
``eval_batches × global_batch_size`` of them are the same every evaluation and at every layout.
``train.final_eval_batches=0`` (:data:`~megaformer.data.gpt_dataset.WHOLE_HELDOUT` samples) builds
every sample a held-out set holds; the regular validations still read its first ones.
"""

from __future__ import annotations

import numpy as np

from data_tools.blend import apportion, blend_indices
from data_tools.indexed_dataset import DataFormatError, IndexedDataset, open_dataset
from data_tools.sample_index import load_or_build
from megaformer.config.load import parse_split
from megaformer.data.gpt_dataset import WHOLE_HELDOUT, BlendedSamples, GPTSamples


def split_ranges(num_documents: int, shares: tuple[float, float, float]) -> list[np.ndarray]:
    """Document ids of the train, validation and test ranges (contiguous, in order), as Megatron.

    ``boundary_{i+1} = boundary_i + round(share_i · n)``, then every boundary after the first is
    lowered by the total's excess over ``n``.
    """
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + round(share * float(num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(3)]


def _samples(dataset: IndexedDataset, index, seq_len: int) -> GPTSamples:
    return GPTSamples(dataset, index.doc_idx, index.sample_idx, index.shuffle_idx, seq_len)


def ordered_samples(
    prefix: str,
    seq_len: int,
    num_samples: int,
    *,
    key: str,
    doc_ids: np.ndarray | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
    counts: dict | None = None,
) -> GPTSamples:
    """The first ``num_samples`` samples of ``seq_len + 1`` tokens of ``prefix``'s documents
    (``doc_ids``, default all) concatenated in order, unshuffled; ``num_samples`` =
    :data:`~megaformer.data.gpt_dataset.WHOLE_HELDOUT`: every sample they hold. ``counts``: an info
    dict whose ``index_cache_hits`` / ``index_cache_builds`` count this index too.

    Raises:
        DataFormatError: fewer tokens than ``num_samples`` samples need (names ``key`` and the fix).
    """
    dataset = open_dataset(prefix)
    lengths = dataset.document_lengths(np.int64)
    ids = np.arange(len(lengths), dtype=np.int64) if doc_ids is None else doc_ids
    tokens = int(lengths[ids].sum())
    available = max(tokens - 1, 0) // seq_len
    if num_samples == WHOLE_HELDOUT:  # train.final_eval_batches=0: the whole set, in order
        num_samples = max(available, 1)
    if available < num_samples:
        raise DataFormatError(
            f"{key}: '{prefix}' ({len(ids)} documents, {tokens} tokens) holds {available} samples of "
            f"{seq_len + 1} tokens, fewer than the {num_samples} one evaluation reads; give more data or "
            "lower train.eval_batches"
        )
    index = load_or_build(
        dataset,
        seq_len=seq_len,
        num_samples=num_samples,
        seed=seed,
        shuffle=False,
        doc_ids=ids,
        cache_dir=cache_dir,
        doc_lengths=lengths,
    )
    if counts is not None:
        _count_index(index, counts)
    return _samples(dataset, index, seq_len)


def _count_index(index, info: dict) -> None:
    """Count a sample index as loaded from the cache or built into it (not counted: no cache)."""
    if index.cache_hit:
        info["index_cache_hits"] += 1
    elif index.paths is not None:
        info["index_cache_builds"] += 1


def _train_samples(
    pairs: list[tuple[float, str]],
    seq_len: int,
    num_samples: int,
    seed: int,
    cache_dir: str | None,
    doc_ids: np.ndarray | None = None,
) -> tuple[GPTSamples | BlendedSamples, dict]:
    """Shuffled training samples over every document (or ``doc_ids``, one dataset) of each dataset of
    ``[(weight, prefix)]`` (a blend gets its weights' shares, as ``build_train_valid``).

    Returns ``(samples, info)``, info with ``train_documents``, ``train_tokens``, ``blend`` and the
    sample indices loaded from / written to the cache (``index_cache_hits`` / ``index_cache_builds``).
    """
    counts = apportion([w for w, _ in pairs], num_samples)
    parts = []
    info = {
        "train_documents": 0,
        "train_tokens": 0,
        "blend": [],
        "index_cache_hits": 0,
        "index_cache_builds": 0,
    }
    for (weight, prefix), n in zip(pairs, counts.tolist()):
        dataset = open_dataset(prefix)
        lengths = dataset.document_lengths(np.int64)
        ids = np.arange(len(lengths), dtype=np.int64) if doc_ids is None else doc_ids
        index = load_or_build(
            dataset,
            seq_len=seq_len,
            num_samples=max(n, 1),
            seed=seed,
            doc_ids=ids,
            cache_dir=cache_dir,
            doc_lengths=lengths,
        )
        parts.append(_samples(dataset, index, seq_len))
        _count_index(index, info)
        info["train_documents"] += len(ids)
        info["train_tokens"] += int(lengths[ids].sum())
        info["blend"].append({"prefix": prefix, "weight": weight, "train_samples": n})
    if len(parts) == 1:
        return parts[0], info
    return BlendedSamples(parts, *blend_indices(counts)), info


def build_heldout_data(
    *,
    pairs: list[tuple[float, str]],
    split: str,
    valid_prefix: str,
    test_prefix: str,
    seq_len: int,
    train_samples: int,
    eval_samples: int,
    seed: int,
    cache_dir: str | None,
) -> tuple[GPTSamples | BlendedSamples, GPTSamples, GPTSamples | None, dict]:
    """Train, validation and test samples under ``data.split`` or ``data.valid_prefix`` (see the
    module docstring); ``test`` is None without a test set. ``info`` has the keys of
    ``build_train_valid``'s (``valid_*`` of the validation set) plus ``test_documents`` /
    ``test_tokens``.

    Raises:
        DataFormatError: ``split`` with a blend, a split leaving no train or validation documents,
            a held-out set too small for one evaluation.
    """
    common = {"seq_len": seq_len, "num_samples": eval_samples, "seed": seed, "cache_dir": cache_dir}
    if split:
        if len(pairs) != 1:
            raise DataFormatError(
                "data.split cuts one dataset; with data.blend give data.valid_prefix instead"
            )
        prefix = pairs[0][1]
        n = len(open_dataset(prefix).document_lengths(np.int64))
        train_ids, valid_ids, test_ids = split_ranges(n, parse_split(split))
        if len(train_ids) == 0 or len(valid_ids) == 0:
            raise DataFormatError(
                f"data.split={split!r} leaves {len(train_ids)} training and {len(valid_ids)} validation "
                f"documents of the {n} in '{prefix}'; give both a larger share"
            )
        train, info = _train_samples(pairs, seq_len, train_samples, seed, cache_dir, train_ids)
        common["counts"] = info
        valid = ordered_samples(prefix, key=f"data.split={split!r} (validation)", doc_ids=valid_ids, **common)
        test = (
            ordered_samples(prefix, key=f"data.split={split!r} (test)", doc_ids=test_ids, **common)
            if len(test_ids)
            else None
        )
        held = {"valid": (prefix, valid_ids), "test": (prefix, test_ids)}
    else:
        train, info = _train_samples(pairs, seq_len, train_samples, seed, cache_dir)
        common["counts"] = info
        valid = ordered_samples(valid_prefix, key="data.valid_prefix", **common)
        test = ordered_samples(test_prefix, key="data.test_prefix", **common) if test_prefix else None
        held = {"valid": (valid_prefix, None), "test": (test_prefix, None)}
    for name, (prefix, ids) in held.items():
        if not prefix or (ids is not None and len(ids) == 0):
            info[f"{name}_documents"], info[f"{name}_tokens"] = 0, 0
            continue
        lengths = open_dataset(prefix).document_lengths(np.int64)
        ids = np.arange(len(lengths)) if ids is None else ids
        info[f"{name}_documents"], info[f"{name}_tokens"] = len(ids), int(lengths[ids].sum())
    return train, valid, test, info
