"""Run metrics: TensorBoard scalars from one writer (global rank 0) and a one-line console log.

Values produced on the device (losses, gradient norms) are kept as tensors by
:class:`DeferredScalars` and read to the host together, once per log interval: the step itself
never waits for the device.
"""

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
        tracker: Any = None,
    ) -> None:
        self.log_dir = log_dir
        self._writer = None
        self._tracker = tracker  # e.g. tracking.WandbTracker: gets the same scalars; None: TensorBoard only
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
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        for name, value in finite.items():
            self._writer.add_scalar(name, value, step)
        if self._tracker is not None:
            self._tracker.log(step, finite)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tracker is not None:
            self._tracker.finish()
            self._tracker = None


class DeferredScalars:
    """Scalars of several steps, kept as given (device tensors or numbers) until :meth:`flush`.

    ``flush`` reads every tensor to the host in one transfer (a single synchronisation with the
    device) and writes the values to a :class:`MetricsWriter`; call it when a line is logged.
    """

    def __init__(self, writer: MetricsWriter) -> None:
        self.writer = writer
        self._pending: list[tuple[int, dict[str, Any]]] = []

    def add(self, step: int, values: dict[str, Any]) -> None:
        """Hold ``values`` (name -> 0-dim tensor, number or None) of ``step``."""
        self._pending.append((step, dict(values)))

    def flush(self) -> dict[str, float | None]:
        """Write every held step to TensorBoard; return the last step's values as floats."""
        import torch

        tensors = [v for _, vals in self._pending for v in vals.values() if isinstance(v, torch.Tensor)]
        values: list[float] = []
        if tensors:
            # Stacked where they live, then one copy to the host: one synchronisation in all.
            device = tensors[0].device
            values = torch.stack([t.detach().double().reshape(()).to(device) for t in tensors]).tolist()
        host = iter(values)
        last: dict[str, float | None] = {}
        for step, vals in self._pending:
            last = {
                k: (next(host) if isinstance(v, torch.Tensor) else (None if v is None else float(v)))
                for k, v in vals.items()
            }
            self.writer.scalars(step, last)
        self._pending.clear()
        return last


class StepTimer:
    """Host wall-clock seconds per optimizer step.

    No device synchronisation: on GPU a step's time is the host's, which runs ahead of the device
    by at most the queue the next read-back (a log line, a loss-scale check) drains; averaged over
    a log interval it is the device's.
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or construction)."""
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
        ("train/tflops_per_device", "TFLOP/s/dev {:.3g}"),
        ("train/mfu", "MFU {:.1%}"),
        ("train/tokens", "tokens {:.4g}"),
        ("train/device_hours", "device-h {:.3g}"),
    ):
        value = values.get(name)
        if value is not None:
            parts.append(fmt.format(value))
    return " | ".join(parts)
