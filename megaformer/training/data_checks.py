"""The preflight's checks of the files a run reads and writes, torch-free, so that
``python -m megaformer.train --check-config`` (which ``launch/pretrain.sh`` runs before any worker)
says a missing or damaged dataset once, in well under a second: ``output.dir`` and
``data.index_cache_dir`` writable, every dataset's ``.bin/.idx`` pair and statistics sidecar, its
token ids against the model's vocabulary (and its padding), its documents ended by
``data.eod_token``, and the held-out split against one evaluation
(:func:`check_files_before_launch`). The workers' preflight
(:mod:`megaformer.training.preflight`) runs the same checks again, for runs started without the
launcher.

Why the sidecar's ``max_token_id`` alone is not enough: it is checked against the ``.idx`` by
token and document counts only, so a ``.bin`` rewritten in place (same size) after its sidecar
keeps a stale, smaller ``max_token_id``. Such ids are not caught later either: at
``parallel.tp_size > 1`` the vocabulary-parallel embedding masks ids outside each rank's rows
(an id past the embedding trains on a zero vector, exit 0), and an id in the embedding's padding
rows (``model.vocab_size`` .. padded size - 1, e.g. 50257..50303 for GPT-2 at TP = 1) has a
logit of -inf, so its loss is inf. Hence: a ``.bin`` modified after its sidecar is scanned here
(once per run, in chunks), and the refusal names the file, the largest id and the fix.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from data_tools.blend import apportion, parse_blend
from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import open_dataset
from data_tools.sample_index import split_documents
from data_tools.stats import read_stats, stats_path
from megaformer.checkpoint.storage import check_writable
from megaformer.config import ConfigError, RunConfig
from megaformer.config.load import parse_split
from megaformer.data.heldout import split_ranges

__all__ = [
    "check_dataset",
    "check_files_before_launch",
    "check_heldout",
    "check_output_dirs",
    "check_token_ids",
    "data_prefixes",
    "scan_max_token_id",
]

_SCAN_TOKENS = 1 << 24  # tokens per chunk of the scan (32 MiB of uint16)


def scan_max_token_id(prefix: str) -> int:
    """Largest token id in ``prefix.bin`` (-1 when empty), read in chunks through a memory map
    (memory stays at one chunk whatever the dataset size)."""

    ds = open_dataset(prefix)
    if ds.num_tokens == 0:
        return -1
    tokens = np.memmap(ds.bin_path, dtype=ds.dtype, mode="r")
    return max(int(tokens[i : i + _SCAN_TOKENS].max()) for i in range(0, tokens.size, _SCAN_TOKENS))


def _sidecar_older_than_bin(prefix: str) -> bool:

    return os.stat(prefix + ".bin").st_mtime_ns > os.stat(stats_path(prefix)).st_mtime_ns


def check_token_ids(prefix: str, stats, cfg: RunConfig) -> int:
    """Refuse a dataset with a token id the model cannot train on; return the largest id.

    The largest id comes from the sidecar, or from a scan of ``.bin`` when the ``.bin`` was
    modified after its sidecar (a copy can do that too; the scan then only costs time).

    Raises:
        DataFormatError: an id ``>= model.vocab_size`` (naming the file, the id, whether it falls
            in the embedding's padding rows or past them, and the fix), or a sidecar whose
            tokenizer has more entries than ``model.vocab_size``.
    """

    vocab = cfg.model.vocab_size
    tok_size = stats.tokenizer.get("vocab_size")
    if isinstance(tok_size, int) and tok_size > vocab:
        raise DataFormatError(
            f"{prefix}: tokenized with {stats.tokenizer.get('type')} of {tok_size} entries "
            f"({stats_path(prefix)}), but model.vocab_size={vocab}; set model.vocab_size={tok_size} "
            "or retokenize the corpus with the model's tokenizer"
        )
    max_id, source = stats.max_token_id, stats_path(prefix)
    if _sidecar_older_than_bin(prefix):
        print(
            f"note: {prefix}.bin is newer than {stats_path(prefix)}: scanning its token ids "
            f"({os.path.getsize(prefix + '.bin') / 1e9:.2f} GB) instead of trusting the sidecar; "
            f"rewrite the sidecar to skip this (python -m data_tools.stats --data-prefix {prefix} ...)",
            file=sys.stderr,
        )
        max_id, source = scan_max_token_id(prefix), f"a scan of {prefix}.bin, newer than its sidecar"
    if max_id < vocab:
        return max_id
    padded = cfg.model.padded_vocab_size(cfg.parallel.tp_size)
    where = (
        f"inside the embedding's padding rows {vocab}..{padded - 1}, whose logits are -inf: the loss "
        "would be inf"
        if max_id < padded
        else f"past the embedding's {padded} rows (at parallel.tp_size > 1 such ids are masked, "
        "not refused: the run would train on garbage)"
    )
    raise DataFormatError(
        f"{prefix}.bin holds token id {max_id} (from {source}), but model.vocab_size={vocab}: {where}; "
        f"the dataset was tokenized with another vocabulary or damaged: retokenize it (and recompute "
        f"its sidecar with python -m data_tools.stats --data-prefix {prefix}), or set "
        f"model.vocab_size >= {max_id + 1} if that vocabulary is the model's"
    )


def index_seq_len(cfg: RunConfig) -> int:
    """The ``seq_len`` the sample index is built for: ``model.seq_len`` (samples of ``seq_len + 1``
    tokens), or ``model.seq_len - 1`` under ``model.objective`` mlm (a masked-LM block is ``<s>`` plus
    ``seq_len - 1`` stream tokens, cut from samples of ``seq_len`` tokens: :mod:`megaformer.data.mlm`)."""
    return cfg.model.seq_len - 1 if cfg.model.objective == "mlm" else cfg.model.seq_len


def check_heldout(cfg: RunConfig, datasets: list[tuple[float, str]]) -> None:
    """Refuse a held-out split smaller than one evaluation, before any process group starts.

    The same arithmetic as the sample index (:mod:`megaformer.data.gpt_dataset`): each dataset
    gets its share (``data_tools.blend.apportion``) of ``train.eval_batches ×
    train.global_batch_size`` validation samples of ``seq_len + 1`` tokens, packed from the held-out
    documents (``data_tools.sample_index.split_documents`` by ``data.valid_fraction`` and
    ``data.split_seed``, by default ``train.seed``), which hold ``(tokens - 1) // seq_len`` samples.

    Raises:
        DataFormatError: naming the dataset, its held-out documents and tokens, the samples they
            make and the samples one evaluation needs, and the keys that fix it.
    """

    t, seq_len = cfg.train, index_seq_len(cfg)
    needed = t.eval_batches * t.global_batch_size
    if cfg.data.valid_prefix or cfg.data.split:
        _check_separate_heldout(cfg, needed)
        return
    shares = apportion([w for w, _ in datasets], needed).tolist()
    for (_, prefix), n_valid in zip(datasets, shares):
        lengths = open_dataset(prefix).document_lengths(np.int64)
        _, valid_ids = split_documents(len(lengths), cfg.data.valid_fraction, cfg.split_seed)
        tokens = int(lengths[valid_ids].sum())
        have = max(tokens - 1, 0) // seq_len
        if have < n_valid:
            raise DataFormatError(
                f"{prefix}: the held-out split (data.valid_fraction={cfg.data.valid_fraction}: "
                f"{len(valid_ids)} of {len(lengths)} documents, {tokens:,} tokens) makes {have} samples "
                f"of {seq_len + 1} tokens, but one evaluation reads {n_valid} (train.eval_batches="
                f"{t.eval_batches} × train.global_batch_size={t.global_batch_size}"
                + (", this dataset's share of the blend" if len(datasets) > 1 else "")
                + "); raise data.valid_fraction or lower train.eval_batches"
            )


def _check_separate_heldout(cfg: RunConfig, needed: int) -> None:
    """The :func:`check_heldout` of ``data.valid_prefix`` / ``data.test_prefix`` (all of their
    documents) and of ``data.split`` (its validation and test ranges of ``data.prefix``), with the
    arithmetic of :func:`megaformer.data.heldout.ordered_samples`.

    Raises:
        DataFormatError: naming the key, the dataset, its documents and tokens, and the fix.
    """

    seq_len = index_seq_len(cfg)
    checks: list[tuple[str, str, np.ndarray | None]] = []
    for key in ("valid_prefix", "test_prefix"):
        if getattr(cfg.data, key):
            checks.append((f"data.{key}", getattr(cfg.data, key), None))
    if cfg.data.split:
        n_docs = len(open_dataset(cfg.data.prefix).document_lengths(np.int64))
        _, valid_ids, test_ids = split_ranges(n_docs, parse_split(cfg.data.split))
        for name, ids in (("validation", valid_ids), ("test", test_ids)):
            if len(ids):
                checks.append((f"data.split={cfg.data.split!r} ({name} range)", cfg.data.prefix, ids))
    for key, prefix, ids in checks:
        lengths = open_dataset(prefix).document_lengths(np.int64)
        chosen = lengths if ids is None else lengths[ids]
        tokens = int(chosen.sum())
        have = max(tokens - 1, 0) // seq_len
        if have < needed:
            raise DataFormatError(
                f"{key}: '{prefix}' ({len(chosen)} documents, {tokens:,} tokens) makes {have} samples "
                f"of {seq_len + 1} tokens, but one evaluation reads {needed} (train.eval_batches="
                f"{cfg.train.eval_batches} × train.global_batch_size={cfg.train.global_batch_size}); "
                "give a bigger held-out set or lower train.eval_batches"
            )


def check_output_dirs(cfg: RunConfig) -> None:
    """Refuse an ``output.dir`` the run cannot write or create, and a missing
    ``data.index_cache_dir`` it cannot create. An existing cache directory may be read-only (indices
    prebuilt there by ``data_tools.build_index``): it is read, and a missing index is then built in
    memory with a warning.

    Raises:
        ConfigError: naming the key, the path, why (read-only file system, permissions) and the fix.
    """

    check_writable(cfg.output.dir, "output.dir", "checkpoints, TensorBoard events and summary.json")
    cache = cfg.data.index_cache_dir
    if cache and not os.path.isdir(cache):
        check_writable(cache, "data.index_cache_dir", "the sample indices (creating the directory)")


def data_prefixes(cfg: RunConfig) -> list[tuple[float, str]]:
    """``[(weight, prefix)]`` of the run: the parsed ``data.blend``, or ``[(1.0, data.prefix)]``.

    Raises:
        ConfigError: a malformed ``data.blend`` (names the item).
    """

    if cfg.data.blend:
        try:
            return parse_blend(cfg.data.blend)
        except DataFormatError as e:
            raise ConfigError(f"{e}.") from None
    return [(1.0, cfg.data.prefix)]


def check_dataset(prefix: str, cfg: RunConfig, key: str | None = None):
    """Open ``prefix``'s ``.bin/.idx`` (header, index and size checks) and read its sidecar.

    Returns:
        Its :class:`data_tools.stats.DatasetStats`.

    Raises:
        DataFormatError: missing files, a corrupt pair, a missing or stale sidecar, token ids
            ``>= model.vocab_size``, or documents not ended by ``data.eod_token``.
    """

    where = key or ("data.blend" if cfg.data.blend else "data.prefix")
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise DataFormatError(
            f"{where}='{prefix}': {', '.join(missing)} not found; build the dataset with "
            "python -m data_tools.preprocess --output-prefix ... (the prefix ends in _text_document) "
            "or fix the path"
        )
    open_dataset(prefix)  # header, index and .bin size checks (DataFormatError naming the file)
    stats = read_stats(prefix)
    check_token_ids(prefix, stats, cfg)  # the sidecar's largest id, or a scan if it is older
    eod = cfg.data.eod_token
    if stats.eod_token is not None and stats.eod_token != eod:
        raise DataFormatError(
            f"{prefix}: documents end in token {stats.eod_token} ({prefix}.stats.json) but "
            f"data.eod_token={eod}; set data.eod_token={stats.eod_token}"
        )
    if stats.documents_end_with_eod is False or stats.eod_token is None:
        raise DataFormatError(
            f"{prefix}: its documents are not all ended by data.eod_token={eod} ({prefix}.stats.json: "
            f"eod_token={stats.eod_token}, documents_end_with_eod={stats.documents_end_with_eod}); "
            "samples would run documents together: preprocess with --append-eod, or recompute the "
            f"sidecar with python -m data_tools.stats --data-prefix {prefix} --eod-token {eod}"
        )
    return stats


def check_files_before_launch(cfg: RunConfig) -> tuple[list[tuple[float, str]], list]:
    """The preflight's file checks that need neither torch nor the world size, for
    ``python -m megaformer.train --check-config`` (``launch/pretrain.sh`` runs it before the launcher
    starts a worker): ``output.dir`` and ``data.index_cache_dir`` writable, every dataset of
    ``data.prefix`` / ``data.blend`` and the held-out prefixes checked as :func:`check_dataset` does,
    and a held-out split that holds one evaluation. A missing or corrupt dataset is then said once,
    in well under a second, instead of by every rank after its start-up (about 8 s on 2 CPU cores).
    The workers' preflight (:func:`megaformer.training.preflight.run_preflight`) repeats these checks
    for runs started without the launcher, with the rest that needs torch, DeepSpeed or the world size.

    Returns:
        ``(datasets, stats)``: :func:`data_prefixes`, and each training dataset's
        :class:`data_tools.stats.DatasetStats` in that order (the held-out sets are checked, not listed).

    Raises:
        ConfigError: an ``output.dir`` or ``data.index_cache_dir`` the run cannot write, a malformed
            ``data.blend``.
        DataFormatError: as :func:`check_dataset` and :func:`check_heldout`.
    """
    check_output_dirs(cfg)
    datasets = data_prefixes(cfg)
    stats = [check_dataset(prefix, cfg) for _, prefix in datasets]
    for key in ("valid_prefix", "test_prefix"):
        if getattr(cfg.data, key):
            check_dataset(getattr(cfg.data, key), cfg, key=f"data.{key}")
    check_heldout(cfg, datasets)
    return datasets, stats
