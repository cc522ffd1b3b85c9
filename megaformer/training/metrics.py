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

    TensorBoard cannot draw an inf or NaN point, so a non-finite value is not written under its
    tag: ``nonfinite/<tag>`` counts, at that step, how many values of ``<tag>`` were non-finite so
    far. The tags of :data:`VS_TOKENS` are written a second time against the tokens consumed
    (``<tag>-vs-tokens``, step = tokens; Megatron's "vs samples" plots). The run's flattened
    config goes to TensorBoard's hparams view (``section.key`` names) and as text.
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
                self._write_hparams(hparams)
        self.nonfinite: dict[str, int] = {}

    def _write_hparams(self, config: dict[str, Any]) -> None:
        """The flattened config in TensorBoard's hparams view, with :data:`HPARAM_METRICS` as its
        metrics (TensorBoard shows their latest values from this run's scalars)."""
        from torch.utils.tensorboard.summary import hparams

        flat = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(config).items()
        }
        for summary in hparams(flat, dict.fromkeys(HPARAM_METRICS, 0.0)):
            self._writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: dict[str, float | None], tokens: float | None = None) -> None:
        """Write each non-None value as a scalar at ``step`` (non-finite ones counted instead, see
        the class docstring); with ``tokens`` (default ``values["train/tokens"]``) also the
        :data:`VS_TOKENS` tags against tokens."""
        if self._writer is None:
            return
        tokens = values.get("train/tokens") if tokens is None else tokens
        finite: dict[str, float] = {}
        for name, value in values.items():
            if value is None:
                continue
            value = float(value)
            if not math.isfinite(value):
                self.nonfinite[name] = self.nonfinite.get(name, 0) + 1
                self._writer.add_scalar(f"nonfinite/{name}", self.nonfinite[name], step)
                continue
            self._writer.add_scalar(name, value, step)
            finite[name] = value
            if tokens is not None and name in VS_TOKENS:
                self._writer.add_scalar(f"{name}-vs-tokens", value, int(tokens))
        if self._tracker is not None:
            self._tracker.log(step, finite)

    def histograms(self, step: int, values: dict[str, Any]) -> None:
        """Write each tensor of ``values`` (host tensors) as a histogram at ``step``."""
        if self._writer is None:
            return
        for name, value in values.items():
            self._writer.add_histogram(name, value.float(), step)

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


VS_TOKENS = ("train/loss", "train/lr", "valid/loss", "valid/ppl")
"""Scalars also written against the tokens consumed (``<tag>-vs-tokens``)."""
HPARAM_METRICS = ("valid/loss", "valid/ppl", "train/loss", "train/nonfinite_steps")
"""The metrics the hparams view lists next to a run's hyperparameters."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


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


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m"``, ``95`` -> ``"1m35s"``, ``7`` -> ``"7s"``."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_step_line(
    step: int, steps: int, values: dict[str, float | None], eta_s: float | None = None
) -> str:
    """One console line: ``2026-11-22 21:10:03 | step 40/300 | loss 6.1234 | lr 1.9e-03 | ... |
    eta 5m12s`` (local time; the ETA counts steps only, not evaluations)."""
    parts = [time.strftime("%Y-%m-%d %H:%M:%S"), f"step {step}/{steps}"]
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
        ("train/peak_memory_gib", "peak mem {:.2f} GiB"),
        ("train/nonfinite_steps", "nonfinite {:.0f}"),
        ("train/skipped_steps", "skipped {:.0f}"),
    ):
        value = values.get(name)
        if value is not None:
            parts.append(fmt.format(value))
    if eta_s is not None and math.isfinite(eta_s):
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def peak_memory_gib(device: Any) -> float:
    """This process's peak memory in GiB: the CUDA caching allocator's maximum allocated bytes on
    a GPU, the peak resident set size (``ru_maxrss``) on the CPU. A host value (no device sync)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
