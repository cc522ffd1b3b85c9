"""Experiment tracking: where a run came from (code and library versions) and optional Weights & Biases.

:func:`provenance` is written into the run's ``config.json`` under ``provenance`` (read back by nothing;
:func:`megaformer.config.load_config` skips it, so the file still loads as a config): the git commit of
the megaformer checkout (and whether it had uncommitted changes), the versions of megaformer, torch,
deepspeed and Python, the host and the time.

:class:`WandbTracker` mirrors every TensorBoard scalar to a W&B run on global rank 0 when
``output.wandb_project`` is set (the config goes in as the run's config). ``WANDB_MODE=offline`` (W&B's
own variable) writes it under ``<output.dir>/wandb`` without network, for ``wandb sync`` later. W&B is an
optional dependency (``pip install wandb``); a run asking for it without it installed stops before any
process group starts (preflight), naming the fix.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

from megaformer.config.schema import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or a broken install: the record says None
        return None


def provenance() -> dict[str, Any]:
    """``{"git_commit", "git_dirty", "versions": {megaformer, torch, deepspeed, python}, "host",
    "started_utc"}``; ``git_commit`` is None outside a git checkout (an installed wheel)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "versions": {
            "megaformer": _version("megaformer"),
            "torch": _version("torch"),
            "deepspeed": _version("deepspeed"),
            "python": platform.python_version(),
        },
        "host": socket.gethostname(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def check_wandb(project: str) -> None:
    """Refuse ``output.wandb_project`` without the ``wandb`` package (before any process group).

    Raises:
        ConfigError: wandb is not installed.
    """
    if not project:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"output.wandb_project={project!r} but the wandb package is not installed: pip install wandb "
            "(or leave output.wandb_project empty)"
        ) from None


class WandbTracker:
    """A W&B run on the main rank (no-op elsewhere, or without ``output.wandb_project``).

    Args:
        project, entity, name: W&B project, entity (team; empty: the default) and run name (empty: W&B's).
        run_dir: the run's ``output.dir``; W&B's files go under ``<run_dir>/wandb``.
        config: the run's config (with its provenance), stored as the W&B run's config.
        enabled: True on global rank 0.

    The W&B run id is kept in ``<run_dir>/wandb_run_id``: a resumed training continues the same W&B run.
    """

    def __init__(
        self, project: str, entity: str, name: str, run_dir: str, config: dict[str, Any], enabled: bool
    ) -> None:
        self._run = None
        if not (enabled and project):
            return
        import wandb

        id_file = os.path.join(run_dir, "wandb_run_id")
        run_id = Path(id_file).read_text().strip() if os.path.isfile(id_file) else uuid.uuid4().hex[:12]
        self._run = wandb.init(
            project=project,
            entity=entity or None,
            name=name or None,
            dir=run_dir,
            config=config,
            id=run_id,
            resume="allow",
        )
        Path(id_file).write_text(run_id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        """Log finite scalars at ``step`` (the optimizer step, as TensorBoard's)."""
        if self._run is not None and values:
            self._run.log(values, step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
