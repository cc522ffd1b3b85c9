"""The dry run's model: what a layout implies for one rank of a GPU job (its planned memory, the
collectives per step, the rank that needs the most memory), set beside what the fake-CUDA run of
that rank measured. The command is :mod:`megaformer.tools.dryrun`."""

from __future__ import annotations

from typing import Any

from megaformer.parallel.state import rank_of
from megaformer.perf.plan import DEVICES, make_plan

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
"""The memory categories the fake allocations are counted in (and the planner's figures beside)."""


def plan_for(cfg: Any, gpu: str, world: int) -> Any:
    """The planner's prediction for ``cfg`` on ``world`` GPUs of kind ``gpu``."""
    return make_plan(cfg, DEVICES[gpu], world)


def busiest_rank(plan: Any, cfg: Any) -> int:
    """The first rank (dp 0, tp 0) of the stage with the largest predicted memory."""
    stage = max(plan.stages, key=lambda s: s.total).stage
    return rank_of(stage, 0, 0, tp=cfg.parallel.tp_size, dp=plan.dp)


def expected_collectives(cfg: Any, plan: Any, stage: int, gas: int) -> list[dict]:
    """What the layout implies per optimizer step on one rank of ``stage``: under TP (Megatron-LM,
    Shoeybi et al. 2019, Sec. 3), two all-reduces of ``b·s·h`` activations per layer in forward and
    two in backward per micro-batch, two more under full recompute (with sequence parallelism,
    all-gathers and reduce-scatters of the same total size instead; Korthikanti et al. 2022); under
    data parallelism, the gradients of the rank's parameters reduced once per step (ZeRO-1/2: reduce
    or reduce-scatter, sized as the gradients in the training precision). The measured TP count is
    higher by what these leave out: the vocabulary-parallel embedding and loss, partitioned
    activation checkpoints (one all-gather per layer per micro-batch) and the pipeline engine's
    partitioned stage outputs."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    lo, hi = plan.stages[stage].layers
    layers = sum(1 for i in range(lo, hi) if 1 <= i <= m.num_layers)
    act_bytes = 2 if t.precision in ("bf16", "fp16") else 4
    rows = []
    if par.tp_size > 1:
        per = t.micro_batch_size * m.seq_len * m.hidden_size * act_bytes
        kind = "all-gather + reduce-scatter" if par.sequence_parallel else "all-reduce"
        # full recompute reruns each block's forward in backward: its two collectives again
        n = 6 if t.recompute_mode == "full" else 4
        what = f"activations ({kind}), {n} per layer per micro-batch" + (
            " (full recompute)" if n == 6 else ""
        )
        rows.append({"group": "tp", "what": what, "calls": n * layers * gas, "bytes": n * layers * gas * per})
    if plan.dp > 1:
        params = plan.stages[stage].params
        rows.append(
            {
                "group": "dp",
                "what": "gradient reduction, once per step",
                "calls": None,
                "bytes": params * act_bytes,
            }
        )
    return rows


def measured_by_group(report: dict, step: str) -> dict[str, dict]:
    """``{group: {"calls", "bytes", "ops"}}`` of one step's collectives in a session report."""
    out: dict[str, dict] = {}
    for c in report.get("collectives", {}).get(step, []):
        g = out.setdefault(c["group"], {"calls": 0, "bytes": 0, "ops": set()})
        g["calls"] += c["calls"]
        g["bytes"] += c["bytes"]
        g["ops"].add(c["op"])
    return out


def memory_rows(report: dict, stage_plan: Any) -> list[dict]:
    """Measured peak bytes by category beside the planner's (activations = activations + logits;
    other = the planner's buffers)."""
    planned = {
        "parameters": stage_plan.weights,
        "gradients": stage_plan.grads,
        "optimizer_state": stage_plan.optimizer,
        "activations": stage_plan.activations + stage_plan.logits,
        "other": stage_plan.buffers,
    }
    got = report.get("peak_by_category", {})
    return [{"category": k, "measured": got.get(k, 0), "planned": planned[k]} for k in CATEGORIES]
