"""What a fake-CUDA run of one rank may do, and the verdict on its report.

NCCL refuses CPU tensors; a host sync inside forward or backward stalls the GPU's queue; a host
copy inside the step costs a pageable transfer. Each host sync or host-to-device copy that stays in
the step is listed here with the reason it stays and how often it may happen per optimizer step;
anything else in a report is a defect (:func:`verdict`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Allowed:
    """A host sync or host-to-device copy that stays: where (a regex on ``file:line (function)``),
    in which phases, at most how many per optimizer step (``per_step``; None: bounded by the
    micro-batch count, i.e. once per micro-batch at most), and why."""

    kind: str
    where: str
    phases: tuple[str, ...]
    per_step: int | None
    why: str

    def matches(self, finding: dict) -> bool:
        return (
            finding["kind"] == self.kind
            and finding["phase"] in self.phases
            and re.search(self.where, finding["where"]) is not None
        )


ALLOWED: tuple[Allowed, ...] = (
    Allowed(
        "host_sync", r"megaformer/training/metrics\.py:\d+ \(flush\)", ("step",), 8,
        "the step scalars (loss, gradient and parameter norm, health counters) read once per "
        "train.log_interval, together (DeferredScalars): the one planned read of the device",
    ),
    Allowed(
        "host_sync", r"megaformer/parallel/comm\.py:\d+ \(all_reduce_max\)", ("step",), 3,
        "the stop check (signals, train.exit_duration_mins; a budget run's spend, a third flag): two "
        "or three flags all-reduced and read on the host after each step, so that every rank stops "
        "at the same step boundary",
    ),
    Allowed(
        "h2d_copy", r"megaformer/parallel/comm\.py:\d+ \(all_reduce_max\)", ("step",), 1,
        "the stop check's two or three flags (16 or 24 bytes) built on the host and copied to the device",
    ),
    Allowed(
        "host_sync", r"megaformer/training/trainer\.py:\d+ \(_client_extra\)", ("step",), 1,
        "at a checkpoint save only: the non-finite step count goes into the checkpoint",
    ),
    Allowed(
        "h2d_copy", r"megaformer/training/trainer\.py:\d+ \(to_device\)", ("step", "eval", "data"), None,
        "each micro-batch's tokens and labels (pinned host memory, non_blocking)",
    ),
    Allowed(
        "host_sync", r"deepspeed/runtime/utils\.py:\d+ \(is_invalid_grad_norm\)", ("optimizer", "step"), 6,
        "DeepSpeed 0.19 (bf16 / ZeRO optimizers): reads the global gradient norm to decide whether "
        "to skip the update; DeepSpeed's, once per step",
    ),
    Allowed(
        "host_sync", r"deepspeed/runtime/zero/stage_1_and_2\.py:\d+ \(has_overflow\)", ("optimizer",), 2,
        "DeepSpeed 0.19 ZeRO-1/2: reads the overflow flag (all-reduced) once per step",
    ),
    Allowed(
        "host_sync", r"deepspeed/runtime/(bf16_optimizer\.py|fp16/)", ("optimizer",), 4,
        "DeepSpeed 0.19 fp16 loss scaler / BF16 optimizer: overflow flag and norm, once per step",
    ),
    Allowed(
        "h2d_copy", r"deepspeed/runtime/utils\.py:\d+ \(mask_nan_or_inf_with_val_inplace\)", ("optimizer",),
        4,
        "DeepSpeed 0.19: a 4-byte constant (-1.0) built on the host per norm group",
    ),
    Allowed(
        "host_sync",
        r"deepspeed/runtime/pipe/engine\.py:\d+ \((_exec_(backward|forward)_pass|_recv_tensor_meta)\)",
        ("forward", "backward"), 2,
        "DeepSpeed 0.19 pipeline engine: the shapes of the tensors a stage receives and the "
        "partitioned activation's metadata, read to the host once per run (first micro-batch; cached)",
    ),
    Allowed(
        "host_sync",
        r"deepspeed/runtime/zero/utils\.py:\d+ \((assert_lst_len_same_as_other_ranks|get_lst_from_rank0)\)",
        ("forward", "backward"), 4,
        "DeepSpeed 0.19 ZeRO-3: the parameter-fetch trace is checked to be the same on every rank (a "
        "small all-reduce read on the host) while the prefetcher records it",
    ),
    Allowed(
        "h2d_copy", r"deepspeed/runtime/", ("forward", "backward", "optimizer", "step", "eval"), None,
        "DeepSpeed 0.19: small metadata and constants built on the host (pipeline tensor shapes, "
        "partition tables, loss aggregation)",
    ),
    Allowed(
        "host_sync", r"deepspeed/runtime/pipe/engine\.py", ("step", "eval", "optimizer"), 4,
        "DeepSpeed 0.19 pipeline engine: the loss broadcast from the last stage and its "
        "aggregation, read on the host per train_batch / eval_batch",
    ),
)  # fmt: skip


def allowed_for(finding: dict) -> Allowed | None:
    """The entry of :data:`ALLOWED` that covers ``finding``, or None."""
    for entry in ALLOWED:
        if entry.matches(finding):
            return entry
    return None


def verdict(report: dict, micro_batches: int | None = None) -> dict[str, Any]:
    """Judge a session report: the problems (each a sentence with file:line) and the host syncs
    and host-to-device copies of the last full step, grouped by where, with their reasons.

    A problem is: a CPU tensor handed to a collective (NCCL refuses it); a host sync or copy not in
    :data:`ALLOWED` (or more of one per step than allowed); a data-dependent shape; a CPU tensor
    made by megaformer's code in forward, backward or the optimizer step; a step that did not
    finish; the loss or gradient norm off the device.
    """
    problems: list[str] = []
    if "error" in report:
        return {"ok": False, "problems": [report["error"]], "syncs_per_step": [], "copies_per_step": []}
    findings = report.get("findings", [])
    steps = int(report.get("steps", 2))
    for f in findings:
        if f["kind"] == "cpu_collective":
            problems.append(
                f"a {f['detail']} reached a {f['op']} at {f['where']} (NCCL takes CUDA tensors only)"
            )
        elif f["kind"] == "dynamic_shape":
            problems.append(f"data-dependent shape ({f['op']}, a host sync) at {f['where']} in {f['phase']}")
    steady = [f for f in findings if f.get("step") == steps and f["kind"] in ("host_sync", "h2d_copy")]
    grouped: Counter = Counter((f["kind"], f["phase"], f["where"]) for f in steady)
    rows: dict[str, list[dict]] = {"host_sync": [], "h2d_copy": []}
    for (kind, phase, where), count in sorted(grouped.items()):
        entry = allowed_for({"kind": kind, "phase": phase, "where": where})
        limit = None if entry is None else entry.per_step
        if limit is None and entry is not None:
            limit = micro_batches
        why = entry.why if entry else None
        rows[kind].append({"where": where, "phase": phase, "count": count, "why": why})
        if entry is None:
            problems.append(f"unexpected {kind.replace('_', ' ')} in {phase} at {where} ({count}× per step)")
        elif limit is not None and count > limit:
            problems.append(f"{count} {kind.replace('_', ' ')}s per step at {where} (allowed {limit})")
    for f in findings:  # syncs in forward / backward outside the steady step too
        if f["kind"] == "host_sync" and f["phase"] in ("forward", "backward") and allowed_for(f) is None:
            msg = f"host sync in {f['phase']} at {f['where']}"
            if msg not in problems:
                problems.append(msg)
    for row in report.get("cpu_tensors", []):  # host tensors megaformer makes inside the step
        if row["where"].startswith("megaformer/") and row["phase"] in ("forward", "backward", "optimizer"):
            problems.append(f"{row['count']} CPU tensors made in {row['phase']} at {row['where']}")
    if report.get("steps_done", 0) < steps:
        problems.append(f"only {report.get('steps_done', 0)} of {steps} steps ran")
    for key in ("loss", "grad_norm"):
        value = report.get(key)
        if not value or not str(value.get("device", "")).startswith("cuda"):
            problems.append(f"the step's {key} is not a device tensor ({value})")
    return {"ok": not problems, "problems": problems, "syncs_per_step": rows["host_sync"],
            "copies_per_step": rows["h2d_copy"]}  # fmt: skip
