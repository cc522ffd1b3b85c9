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

The checks of ``output.dir`` and the datasets are :mod:`.data_checks`' (torch-free):
``launch/pretrain.sh``'s ``--check-config`` runs them before any worker starts, and the workers run
them again here for a run started without it.
"""

from __future__ import annotations

import glob
import os
import zipfile
from dataclasses import dataclass, field

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
from megaformer.config import ConfigError, RunConfig, validate_layout
from megaformer.training.data_checks import (  # torch-free: the launcher's check runs them too
    check_files_before_launch,
)
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
    if cfg.train.deepspeed_config:
        check_engine_combination(
            cfg, read_engine_json(cfg.train.deepspeed_config), cfg.train.deepspeed_config
        )
    # output.dir, the datasets, the held-out split: what launch/pretrain.sh's --check-config said
    # already, again for a run started without it (torchrun, a direct python -m megaformer.train)
    datasets, stats = check_files_before_launch(cfg)
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
