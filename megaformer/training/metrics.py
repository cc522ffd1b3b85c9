"""Run metrics: TensorBoard scalars from one writer (global rank 0) and a one-line console log."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any


class MetricsWriter:
    """Writes scalars to ``<run dir>/tensorboard`` on rank 0; other ranks hold a no-op writer.

    Scalar names follow ``train/*`` and ``valid/*`` (``train/loss`` in nats per token,
    ``train/tokens_per_s`` for the whole job, ``train/step_time_s`` in seconds).
    """

    def __init__(
        self,
        log_dir: str,
        enabled: bool,
        hparams: dict[str, Any] | None = None,
        purge_step: int | None = None,
    ) -> None:
        self.log_dir = log_dir
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            # purge_step: on resume, TensorBoard hides events a killed run wrote past the checkpoint.
            self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
            if hparams is not None:
                self._writer.add_text("config", "```\n" + json.dumps(hparams, indent=2) + "\n```", 0)

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Write each non-None value as a scalar at ``step``."""
        if self._writer is None:
            return
        for name, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self._writer.add_scalar(name, float(value), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class StepTimer:
    """Wall-clock seconds per optimizer step (synchronises CUDA so GPU time is counted)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or construction)."""
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except ImportError:  # pragma: no cover
            pass
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        return elapsed


def format_step_line(step: int, steps: int, values: dict[str, float | None]) -> str:
    """One console line: ``step 40/300 | loss 6.1234 | lr 1.9e-03 | ...``."""
    parts = [f"step {step}/{steps}"]
    for name, fmt in (
        ("train/loss", "loss {:.4f}"),
        ("train/lr", "lr {:.3e}"),
        ("train/grad_norm", "grad_norm {:.3f}"),
        ("train/loss_scale", "loss_scale {:.0f}"),
        ("train/tokens_per_s", "tokens/s {:,.0f}"),
        ("train/step_time_s", "step {:.3f}s"),
    ):
        value = values.get(name)
        if value is not None:
            parts.append(fmt.format(value))
    return " | ".join(parts)
