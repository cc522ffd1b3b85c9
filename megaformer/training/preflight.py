"""Checks that need files or the world size, run before any process group starts or model is built.

A bad dataset or checkpoint found after ``deepspeed.initialize`` costs minutes at 1.3B parameters
(and a device-side assert on GPU when a token id is beyond the embedding); found here it costs a
second and an error that names the file and the fix. Every process runs the preflight on its own
(no communication exists yet), reading only headers, indices and the dataset sidecars.

What is checked (each failure a :class:`~megaformer.config.ConfigError` or
:class:`~data_tools.errors.DataFormatError`):

* the layout: world size divisible by tp × pp, global batch by micro batch × dp;
* the DeepSpeed version (:func:`megaformer.training.ds_adapter.check_deepspeed_version`) and the
  engine JSON (``train.deepspeed_config``): readable, no key the YAML owns;
* every dataset of ``data.prefix`` / ``data.blend``: a valid ``.bin/.idx`` pair (header, index,
  ``.bin`` size) with its statistics sidecar (``PREFIX.stats.json``, written at preprocessing); its
  largest token id below ``model.vocab_size`` (scanned when the ``.bin`` is newer than the sidecar,
  see :mod:`.data_checks`); its documents ending in ``data.eod_token``; a held-out split that holds
  one evaluation;
* ``train.resume`` / ``train.init_from``: a checkpoint directory whose ``latest`` tag names a
  directory of complete (readable zip) DeepSpeed files;
* ``output.dir`` (or the directory it would be created in) writable, and so the parent a missing
  ``data.index_cache_dir`` would be created in (:mod:`.storage`): a read-only file system or a
  directory without write permission is named here, not as a traceback and a lost connection
  after the process groups started.
"""

from __future__ import annotations

import glob
import os
import zipfile
from dataclasses import dataclass, field

from data_tools.blend import parse_blend
from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import open_dataset
from data_tools.stats import read_stats
from megaformer.checkpoint.integrity import (
    NEEDS_ALL,
    NEEDS_RESUME,
    NEEDS_WEIGHTS,
    CheckpointError,
    needed,
    resolve_latest,
    verify,
    way_out,
)
from megaformer.checkpoint.safe_load import refuse_untrusted, weight_files
from megaformer.checkpoint.storage import check_writable
from megaformer.config import ConfigError, RunConfig, validate_layout
from megaformer.training.data_checks import check_heldout, check_token_ids
from megaformer.training.deepspeed_config import check_engine_combination, read_engine_json
from megaformer.training.distributed import pick_backend
from megaformer.training.ds_adapter import check_deepspeed_version, check_precision
from megaformer.training.tracking import check_wandb


@dataclass(frozen=True)
class Preflight:
    """What the preflight found: the data-parallel size and each dataset's statistics."""

    dp_size: int
    datasets: list[tuple[float, str]]
    """``[(weight, prefix)]``: ``data.prefix`` with weight 1, or the normalised ``data.blend``."""
    stats: list = field(default_factory=list)
    """One :class:`data_tools.stats.DatasetStats` per dataset, in the order of ``datasets``."""


def run_preflight(cfg: RunConfig, world_size: int) -> Preflight:
    """Check everything a run needs that the config alone cannot tell (see the module docstring).

    Args:
        cfg: the loaded config.
        world_size: processes in the job (``WORLD_SIZE`` of the launcher).

    Raises:
        ConfigError: a layout the world size cannot satisfy, an unusable DeepSpeed or engine JSON,
            a checkpoint that is missing or incomplete, an ``output.dir`` or ``data.index_cache_dir``
            the run cannot write (read-only, no permission).
        UntrustedCheckpointError: a ``train.init_from`` file that refers to a type loading weights
            does not allow, without ``train.trust_checkpoint_code``.
        DataFormatError: a dataset that is missing, corrupt, without statistics sidecar, with token
            ids beyond the vocabulary or documents not ended by ``data.eod_token``.
    """

    dp_size = validate_layout(cfg, world_size)
    check_deepspeed_version()
    check_backend_and_precision(cfg)
    check_output_dirs(cfg)
    if cfg.train.deepspeed_config:
        check_engine_combination(
            cfg, read_engine_json(cfg.train.deepspeed_config), cfg.train.deepspeed_config
        )
    datasets = data_prefixes(cfg)
    stats = [check_dataset(prefix, cfg) for _, prefix in datasets]
    for key in ("valid_prefix", "test_prefix"):  # held-out sets: the same checks, not in the stats
        if getattr(cfg.data, key):
            check_dataset(getattr(cfg.data, key), cfg, key=f"data.{key}")
    check_heldout(cfg, datasets)
    check_wandb(cfg.output.wandb_project)
    if cfg.train.resume not in ("none", "auto"):
        check_checkpoint(cfg.train.resume, "train.resume", NEEDS_RESUME)
    elif cfg.train.resume == "auto":
        ckpt_dir = os.path.join(cfg.output.dir, "checkpoints")
        if os.path.isfile(os.path.join(ckpt_dir, "latest")):
            check_checkpoint(ckpt_dir, "train.resume=auto", NEEDS_RESUME)
    if cfg.train.init_from:
        tag_dir = check_checkpoint(cfg.train.init_from, "train.init_from", NEEDS_WEIGHTS)
        # Someone else's weights, often: refused here, before any process group, if a file would
        # need the full unpickler (nothing of it runs: the scan reads opcodes only).
        refuse_untrusted(weight_files(tag_dir), cfg.train.trust_checkpoint_code)
    return Preflight(dp_size=dp_size, datasets=datasets, stats=stats)


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


def check_backend_and_precision(cfg: RunConfig) -> str:
    """The backend the run will use; refuse NCCL without CUDA and fp16 where DeepSpeed has none.

    Raises:
        ConfigError: naming ``parallel.backend`` or ``train.precision`` and the fix.
    """
    import torch

    backend = pick_backend(cfg.parallel.backend)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.backend=nccl: this machine has no CUDA device (NCCL runs on GPUs only); "
            "use parallel.backend=auto (gloo on CPU) or run on GPUs"
        )
    check_precision(cfg.train.precision, backend)
    return backend


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


def _latest_tag_dir(ckpt: str, key: str) -> str:
    """The ``global_stepN`` directory a checkpoint path means (itself, or what ``latest`` names)."""
    if glob.glob(os.path.join(ckpt, "*model_states.pt")):
        return ckpt
    latest = os.path.join(ckpt, "latest")
    if not os.path.isdir(ckpt):
        raise ConfigError(f"{key}='{ckpt}': no such directory; pass a run's checkpoints/ directory")
    if not os.path.isfile(latest):
        raise ConfigError(
            f"{key}='{ckpt}': no DeepSpeed checkpoint there (no 'latest' file and no model-state "
            "files); pass a run's checkpoints/ directory or one global_stepN directory"
        )

    return resolve_latest(ckpt)  # an empty or dangling tag: named, with the newest intact one


def check_checkpoint(ckpt: str, key: str, needs: str = NEEDS_ALL) -> str:
    """Check that the checkpoint files a run reads are complete; return its tag directory.

    Every ``*.pt`` of the tag directory it reads must be a complete zip archive (``torch.save``'s
    format keeps its directory at the end, so a truncated file is refused without reading it whole).

    Args:
        needs: what the run reads (:data:`~megaformer.checkpoint.integrity.NEEDS_WEIGHTS` for
            ``init_from``, :data:`~megaformer.checkpoint.integrity.NEEDS_RESUME` for a resume): a
            damaged file it does not read passes here; the ranks' check
            (``checkpointer.verify_collectively``) warns about it.

    Raises:
        ConfigError: no checkpoint there, a dangling ``latest``, or a truncated / damaged file it
            reads; the message names the file and an earlier ``global_stepN`` to use instead.
    """

    tag_dir = _latest_tag_dir(ckpt, key)
    # Presence and sizes against the manifest here, on every process (cheap, no warning: every
    # process would print it); the digests are checked once the ranks can share the reading.
    try:
        verify(tag_dir, hash_share=None, needs=needs, quiet=True)
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e}") from None
    files = sorted(glob.glob(os.path.join(tag_dir, "*.pt")) + glob.glob(os.path.join(tag_dir, "*", "*.pt")))
    if not files:
        raise ConfigError(f"{key}: {tag_dir} holds no checkpoint files (*.pt)")
    for path in files:
        if needed(os.path.relpath(path, tag_dir), needs) and not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{key}: {path} is truncated or damaged (not a complete torch checkpoint file)"
                + way_out(tag_dir)
            )
    return tag_dir
