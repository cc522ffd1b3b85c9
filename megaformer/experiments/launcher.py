"""One training run of an experiment, launched through ``launch/pretrain.sh`` (the users' path).

The experiment commands (:mod:`megaformer.experiments.compare`,
:mod:`megaformer.experiments.lr_stability`) train each of their runs as a separate
``launch/pretrain.sh`` call, so a run is exactly what a user would launch by hand and its failure
cannot take the experiment's own process down.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch_run(config: str, out: Path, args: Sequence[str], nproc: int, tag: str) -> dict:
    """Train ``config`` with the overrides ``args`` on ``nproc`` local processes; return the run's
    ``summary.json`` as a dict.

    Args:
        config: path of the YAML run config.
        out: the run's output directory; its ``train.log`` receives the launcher's stdout and
            stderr. ``args`` should set ``output.dir`` to it.
        args: ``section.key=value`` overrides, passed after the config.
        nproc: processes on this node (``NPROC_PER_NODE``).
        tag: the experiment's name for the console line, e.g. ``"compare"``.

    Raises:
        RuntimeError: the launch exited non-zero or wrote no ``summary.json``; names the config,
            the run's last error line (a bad key, a missing dataset) and the log file.
    """
    out.mkdir(parents=True, exist_ok=True)
    summary_path, log_path = out / "summary.json", out / "train.log"
    print(f"[{tag}] {out.name}: launch/pretrain.sh {config} {' '.join(args)}", flush=True)
    code = _pretrain_sh([config, *args], log_path, {"NPROC_PER_NODE": str(nproc)})
    if code != 0 or not summary_path.is_file():
        raise RuntimeError(f"{config}: training failed (exit {code}){_last_error(log_path)}; log: {log_path}")
    return json.loads(summary_path.read_text())


def launch_module(module: str, spec: Path, log_path: Path, nproc: int) -> None:
    """Run ``module SPEC`` on ``nproc`` local processes through ``launch/pretrain.sh``
    (``MEGAFORMER_MODULE``: the same launcher, thread settings and rendezvous as a training run).

    Raises:
        RuntimeError: the job exited non-zero; names the module, its last error line and the log.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    code = _pretrain_sh([str(spec)], log_path, {"NPROC_PER_NODE": str(nproc), "MEGAFORMER_MODULE": module})
    if code != 0:
        raise RuntimeError(f"{module} {spec}: failed (exit {code}){_last_error(log_path)}; log: {log_path}")


def _pretrain_sh(args: list[str], log_path: Path, env: dict[str, str]) -> int:
    """``launch/pretrain.sh ARGS`` from the repository root, stdout and stderr into ``log_path``."""
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.run(
            ["bash", str(REPO / "launch" / "pretrain.sh"), *args],
            cwd=REPO,
            env=dict(os.environ, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode


def _last_error(log_path: Path) -> str:
    """``": <the log's last line with 'error'>"``, or ``""``: the run's own error line is the useful
    part of a failure (a bad key, a missing dataset), not just the exit code."""
    errors = [ln for ln in log_path.read_text(errors="replace").splitlines() if "error" in ln]
    return f": {errors[-1].strip()}" if errors else ""
