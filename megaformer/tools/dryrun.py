"""Dry-run one rank of a GPU job on this machine, before the job is queued.

``python -m megaformer.tools.dryrun CONFIG [overrides] --nodes N --gpus-per-node G --gpu a100-80gb
[--rank R]``

The command over :mod:`megaformer.perf.dryrun` (what the layout implies) and
:mod:`megaformer.perf.fakecuda` (the rank's run). For a login node without GPUs. The chosen rank
(default: the first rank of the pipeline stage the planner predicts to need the most memory) runs
its first two optimizer steps at full size on fake CUDA (:mod:`megaformer.perf.fakecuda`): the
trainer's builders, the DeepSpeed engine of the config's ZeRO stage and precision, the pipeline
engine, TP and sequence parallelism as configured, the training loop and one evaluation; FakeTensors
carry shapes, dtypes and devices, not values. It prints

* the peak device memory of the fake allocations by category (parameters, gradients, optimizer
  state, activations, other) beside the planner's figure for each (:mod:`megaformer.perf.plan`);
* the collectives per step (operation, group, calls, bytes) beside what the layout implies
  (Megatron's counts: under TP, 2 all-reduces of ``b·s·h`` per layer in forward and 2 in backward;
  the data-parallel gradient reduction of ZeRO);
* the host syncs and host-to-device copies per step, each with the reason it stays;
* a verdict: the run would start and step (exit 0), or what stops it (exit 1): a CPU tensor in a
  collective, an unexpected host sync, memory over the device's.

A config DeepSpeed would crash on is refused with the key and the fix before anything runs
(exit 2), as are a layout that does not divide the world, an unknown ``--gpu`` and a rank outside
the world. The JSON report goes to ``--output`` (default ``runs/dryrun/<config>-rank<R>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

from megaformer.config import ConfigError, load_config
from megaformer.perf.dryrun import (
    busiest_rank,
    expected_collectives,
    measured_by_group,
    memory_rows,
    plan_for,
)
from megaformer.perf.fakecuda.gpus import gpu_name

GIB = 1024**3


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megaformer.tools.dryrun", description=__doc__.split("\n")[0]
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for the launcher")
    parser.add_argument(
        "--nodes", type=int, default=None, help="default: the recipe header's layout, else 1 (said)"
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, help="default: the recipe header's layout, else 8 (said)"
    )
    parser.add_argument("--gpu", type=gpu_name, default="a100-80gb", help="a100-80gb, h100-80gb, ...")
    parser.add_argument("--rank", type=int, default=None, help="default: the busiest stage's rank 0")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--max-micro-batches",
        type=int,
        default=None,
        help="run at most this many micro-batches per step (each at full size; default: the config's)",
    )
    parser.add_argument("--output", default=None, help="JSON report path")
    return parser.parse_args(argv)


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def describe(result: dict) -> str:
    """The console report of :func:`run`'s result."""
    r, lines = result["report"], []
    lines.append(
        f"\n== dry run: {result['config']} | rank {result['rank']} of {result['world']} "
        f"({result['layout']}) on fake {result['gpu']} =="
    )
    if r.get("micro_batches_capped"):
        c = r["micro_batches_capped"]
        lines.append(f"   (ran {c['run']} of the step's {c['recipe']} micro-batches, each at full size)")
    e, d = r["engine"], r["dtypes"]
    lines.append(f"engine: {e['class']} / {e['optimizer']}, {e['gas']} micro-batches per step")
    lines.append(
        f"dtypes: parameters {d['parameters']}, gradients {d['gradients']}, optimizer state "
        f"{d['optimizer_state']} | attention kernels: {r.get('attention_kernels')}"
    )
    lines.append("\npeak device memory (GiB), fake allocations vs the planner:")
    lines.append(f"  {'category':16s} {'measured':>8s} {'planned':>8s}")
    for row in result["memory"]:
        lines.append(f"  {row['category']:16s} {_gib(row['measured'])} {_gib(row['planned'])}")
    total_planned = sum(row["planned"] for row in result["memory"])
    lines.append(
        f"  {'total (peak)':16s} {_gib(r['peak_bytes'])} {_gib(total_planned)}   "
        f"device {result['gpu_memory_gib']:.0f} GiB, at step {r['peak_at']['step']} "
        f"({r['peak_at']['phase']})"
    )
    lines.append("\ncollectives in step 2 (measured) and what the layout implies:")
    for group, g in sorted(result["collectives"].items()):
        ops = ", ".join(sorted(g["ops"]))
        lines.append(f"  {group:12s} {g['calls']:6d} calls {g['bytes'] / 2**20:12.1f} MiB  ({ops})")
    for e in result["expected_collectives"]:
        calls = "" if e["calls"] is None else f"{e['calls']:6d} calls"
        lines.append(f"  expected {e['group']:3s} {calls:>12s} {e['bytes'] / 2**20:12.1f} MiB  {e['what']}")
    v = result["verdict"]
    lines.append("\nhost syncs per step (each stays for the reason given):")
    for row in v["syncs_per_step"]:
        lines.append(f"  {row['count']:3d}× {row['phase']:9s} {row['where']}: {row['why'] or 'NOT EXPECTED'}")
    lines.append("host-to-device copies per step:")
    for row in v["copies_per_step"]:
        lines.append(f"  {row['count']:3d}× {row['phase']:9s} {row['where']}: {row['why'] or 'NOT EXPECTED'}")
    lines.append("")
    if result["ok"]:
        lines.append(
            f"verdict: OK: rank {result['rank']} starts, steps and evaluates; peak "
            f"{r['peak_bytes'] / GIB:.1f} GiB of {result['gpu_memory_gib']:.0f} GiB"
        )
    else:
        lines.append("verdict: NOT OK:")
        lines.extend(f"  - {p}" for p in result["problems"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Validate, run the rank on fake CUDA, judge; return the result (see :func:`describe`).

    Raises:
        ConfigError: a config, layout, rank or engine JSON that cannot run (before anything starts).
        ShimUnavailableError: no compiler or torch headers to build the fake-CUDA shim.
    """
    from megaformer.parallel.state import coords_of  # lazy: torch loads after the flags are checked
    from megaformer.perf.fakecuda.expectations import verdict
    from megaformer.perf.fakecuda.gpus import GPUS
    from megaformer.perf.fakecuda.launch import run_rank_of_job
    from megaformer.training.deepspeed_config import check_engine_combination, read_engine_json
    from megaformer.training.preflight import validate_layout

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: both must be ≥ 1")
    world = args.nodes * args.gpus_per_node
    cfg = load_config(args.config, args.overrides)
    validate_layout(cfg, world)
    if cfg.train.deepspeed_config:
        check_engine_combination(
            cfg, read_engine_json(cfg.train.deepspeed_config), cfg.train.deepspeed_config
        )
    if cfg.train.precision == "bf16" and GPUS[args.gpu].capability < (8, 0):
        raise ConfigError(
            f"train.precision=bf16 on {args.gpu}: bf16 needs compute capability 8.0 (A100) or newer; "
            "use train.precision=fp16 (the recipes' '# V100 overrides:' line)"
        )
    plan = plan_for(cfg, args.gpu, world)
    rank = busiest_rank(plan, cfg) if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise ConfigError(
            f"--rank {rank} is outside the world of {world} ({args.nodes} × {args.gpus_per_node}); "
            f"use 0..{world - 1}"
        )
    tp = cfg.parallel.tp_size
    stage, dp_rank, tp_rank = coords_of(rank, tp=tp, dp=plan.dp)
    layout = f"tp {tp} × pp {cfg.parallel.pp_size} × dp {plan.dp}; stage {stage}, dp {dp_rank}, tp {tp_rank}"
    print(
        f"[dryrun] {args.config}: rank {rank} of {world} ({layout}) on fake {args.gpu}: {args.steps} "
        f"step(s) at full size (the recipes at their headers' layouts: 16 s to 3 min, quiet 2 cores)...",
        flush=True,
    )
    started = time.perf_counter()
    extra = {"max_micro_batches": args.max_micro_batches} if args.max_micro_batches else {}
    report = run_rank_of_job(
        args.config, args.overrides, world_size=world, rank=rank, gpu=args.gpu, steps=args.steps, **extra
    )
    print(f"[dryrun] ran in {time.perf_counter() - started:.0f} s", flush=True)
    result: dict[str, Any] = {
        "config": args.config,
        "overrides": args.overrides,
        "rank": rank,
        "world": world,
        "gpu": args.gpu,
        "layout": layout,
        "gpu_memory_gib": GPUS[args.gpu].memory_bytes / GIB,
        "report": report,
    }
    if "error" in report:
        result |= {"ok": False, "problems": [report["error"]]}
        return result
    gas = report["engine"]["gas"]
    judged = verdict(report, gas)
    problems = list(judged["problems"])
    if report["peak_bytes"] > GPUS[args.gpu].memory_bytes:
        problems.append(
            f"peak device memory {report['peak_bytes'] / GIB:.1f} GiB exceeds the {args.gpu}'s "
            f"{GPUS[args.gpu].memory_bytes / GIB:.0f} GiB (python -m megaformer.tools.plan suggests a layout)"
        )
    steps = str(report.get("steps", 2))
    result |= {
        "ok": not problems,
        "problems": problems,
        "verdict": judged,
        "memory": memory_rows(report, plan.stages[stage]),
        "collectives": measured_by_group(report, steps),
        "expected_collectives": expected_collectives(cfg, plan, stage, gas),
    }
    return result


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, set):
        return sorted(obj)
    return str(obj)


_HEADER_WORLD = re.compile(r"(\d+) nodes? × (\d+) ")


def header_world(path: str) -> tuple[int, int] | None:
    """``(nodes, gpus_per_node)`` of the layout a recipe's header comment names first ("32 nodes × 8
    V100 32GB (world 256)", "world 8 = 1 node × 8 A100 80GB"), or None (no such line, or not a
    readable file). Only the leading comment block is read."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                found = _HEADER_WORLD.search(line)
                if found:
                    return int(found[1]), int(found[2])
    except OSError:
        return None
    return None


def default_layout(args: argparse.Namespace) -> str:
    """Fill ``args.nodes`` / ``args.gpus_per_node`` left unset from the recipe's header
    (:func:`header_world`; else 1 × 8); return the sentence that says which it took."""
    if args.nodes is not None and args.gpus_per_node is not None:
        return ""
    found = header_world(args.config)
    nodes, per_node = found or (1, 8)
    args.nodes = nodes if args.nodes is None else args.nodes
    args.gpus_per_node = per_node if args.gpus_per_node is None else args.gpus_per_node
    source = "the layout its header names" if found else "no layout in its header: the default"
    return (
        f"[dryrun] {args.nodes} node(s) × {args.gpus_per_node} GPUs ({source}; --nodes / --gpus-per-node "
        "to dry-run another)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    said = default_layout(args)
    if said:
        print(said, flush=True)
    # lazy: the dry run's machinery (torch, DeepSpeed's checks) loads after the flags are checked
    from megaformer.perf.fakecuda.build import ShimUnavailableError

    try:
        result = run(args)
    except (ConfigError, ShimUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stem = os.path.splitext(os.path.basename(args.config))[0]
    out = args.output or os.path.join("runs", "dryrun", f"{stem}-rank{result['rank']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
    if "verdict" in result:
        print(describe(result))
    else:
        print(f"\nverdict: NOT OK: the rank did not complete: {result['problems'][0]}", file=sys.stderr)
        print(f"(the traceback is in {out}, under report.traceback)", file=sys.stderr)
    print(f"\nreport: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
