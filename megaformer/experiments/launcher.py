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
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            ["bash", str(REPO / "launch" / "pretrain.sh"), config, *args],
            cwd=REPO,
            env=dict(os.environ, NPROC_PER_NODE=str(nproc)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0 or not summary_path.is_file():
        # The run's own error line is the useful part of a failure: show it, not just the exit code.
        errors = [ln for ln in log_path.read_text(errors="replace").splitlines() if "error" in ln]
        why = f": {errors[-1].strip()}" if errors else ""
        raise RuntimeError(f"{config}: training failed (exit {proc.returncode}){why}; log: {log_path}")
    return json.loads(summary_path.read_text())


def launch_module(module: str, spec: Path, log_path: Path, nproc: int) -> None:
    """Run ``module SPEC`` on ``nproc`` local processes through ``launch/pretrain.sh``
    (``MEGAFORMER_MODULE``: the same launcher, thread settings and rendezvous as a training run).

    Raises:
        RuntimeError: the job exited non-zero; names the module, its last error line and the log.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            ["bash", str(REPO / "launch" / "pretrain.sh"), str(spec)],
            cwd=REPO,
            env=dict(os.environ, NPROC_PER_NODE=str(nproc), MEGAFORMER_MODULE=module),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        errors = [ln for ln in log_path.read_text(errors="replace").splitlines() if "error" in ln]
        why = f": {errors[-1].strip()}" if errors else ""
        raise RuntimeError(f"{module} {spec}: failed (exit {proc.returncode}){why}; log: {log_path}")
