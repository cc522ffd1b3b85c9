"""Predicted MFU and tokens/s per GPU of every recipe on V100 / A100 / H100 at 1, 8 and 64 nodes,
after the measured H200 rows beside the model's predictions.

    .venv/bin/python bench/steptime_table.py [--out bench/results/steptime_table.json]

First, every measured H200 row of today's program with its prediction and error, and NormFormer /
Pre-LN measured and predicted (``bench/steptime_h200.py``'s rows: the only measurements; the model's
GPU constants are fitted to those loans' profiles). Then the predictions: the step-time model
(:mod:`megaformer.perf.steptime`) for the eight paper recipes
(``configs/paper/``) and the three layout recipes (``configs/normformer-*-{3d,zero2}*.yaml``) at
their own layout, on nodes of 8 GPUs. On a V100 a paper recipe takes its ``# V100 overrides:`` line
(fp16, its micro-batch and recompute); any other bf16 recipe runs fp16 there. Where the global batch
does not split into the recipe's micro-batch over dp, the micro-batch is lowered to the largest that
does (noted); where dp exceeds the global batch the cell is empty. ``fits`` is the memory planner's
verdict (:func:`megaformer.perf.plan.make_plan`) for the layout on that GPU. Also NormFormer's
predicted step-time overhead over Pre-LN (baseline recipe) per size, and the term breakdown of the
recipes on one H100 node. Predictions, not measurements. Prints markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402
from megaformer.config import load_config  # noqa: E402
from megaformer.perf import optrace  # noqa: E402
from megaformer.perf.plan import DEVICES, make_plan, with_train  # noqa: E402
from megaformer.perf.steptime import DEVICE_SPECS, predict  # noqa: E402

GPUS = ("v100-32gb", "a100-80gb", "h100-80gb")
NODES = (1, 8, 64)
GPUS_PER_NODE = 8
LAYOUT_RECIPES = (
    "configs/normformer-1.3b-3d-v100.yaml",
    "configs/normformer-2.7b-3d-a100.yaml",
    "configs/normformer-350m-zero2.yaml",
)


def recipes() -> list[str]:
    paper = sorted(glob.glob(os.path.join(REPO, "configs", "paper", "*.yaml")), key=_size_key)
    return [os.path.relpath(p, REPO) for p in paper] + list(LAYOUT_RECIPES)


def _size_key(path: str) -> tuple[bool, float, str]:
    """The causal recipes by size, then the masked LMs (``mlm-125m-*``)."""
    name = os.path.basename(path)
    mlm = name.startswith("mlm-")
    size = name.removeprefix("mlm-").split("-")[0]
    value = float(size[:-1]) * (1000 if size.endswith("b") else 1)
    return mlm, value, name


def v100_overrides(path: str) -> list[str]:
    with open(os.path.join(REPO, path)) as f:
        for line in f:
            if line.startswith("# V100 overrides:"):
                return shlex.split(line.split(":", 1)[1])
    return []


def cell_config(path: str, gpu: str, nodes: int) -> tuple[object | None, str]:
    """The config of one cell (``path`` at its layout for ``gpu`` on ``nodes`` nodes) and its note;
    None where dp exceeds the global batch."""
    overrides = v100_overrides(path) if gpu == "v100-32gb" else []
    cfg = load_config(os.path.join(REPO, path), overrides)
    if not DEVICES[gpu].bf16 and cfg.train.precision == "bf16":
        cfg = with_train(cfg, precision="fp16")
    world = nodes * GPUS_PER_NODE
    t, par = cfg.train, cfg.parallel
    dp = world // (par.tp_size * par.pp_size)
    if t.global_batch_size < dp:
        return None, f"dp {dp} > batch"
    micro = t.micro_batch_size
    while t.global_batch_size % (micro * dp):
        micro -= 1
    if micro != t.micro_batch_size:
        return with_train(cfg, micro_batch_size=micro), f"micro-batch {micro}"
    return cfg, ""


def prefetch_traces() -> None:
    """Every cell's block trace in one fake-CUDA child per (GPU kind, TP size), not one per cell."""
    for gpu in GPUS:
        cfgs = [cell_config(p, gpu, n)[0] for p in recipes() for n in NODES]
        optrace.trace_blocks([c for c in cfgs if c is not None], 2, optrace.gpu_for(DEVICE_SPECS[gpu]))


def cell(path: str, gpu: str, nodes: int) -> dict:
    cfg, note = cell_config(path, gpu, nodes)
    world = nodes * GPUS_PER_NODE
    if cfg is None:
        return {"path": path, "gpu": gpu, "nodes": nodes, "world": world, "note": note}
    t, par = cfg.train, cfg.parallel
    dp = world // (par.tp_size * par.pp_size)
    micro = t.micro_batch_size
    st = predict(cfg, DEVICE_SPECS[gpu], world, GPUS_PER_NODE)
    fits = make_plan(cfg, DEVICES[gpu], world).fits
    return {
        "path": path,
        "gpu": gpu,
        "nodes": nodes,
        "world": world,
        "layout": f"tp {par.tp_size} pp {par.pp_size} dp {dp} zero {t.zero_stage} {t.precision} "
        f"micro {micro} gas {st.micro_batches} recompute {t.recompute_mode}",
        "note": note,
        "fits": fits,
        **st.as_dict(),
    }


def zero2_comparison() -> tuple[list[dict], list[str]]:
    """The bf16 NormFormer recipes at ZeRO-1 (DeepSpeed's BF16 optimizer: fp32 accumulation, one
    all-reduce after the last backward, not overlapped) against ZeRO-2 with the same JSON (fp32
    accumulation, a reduce-scatter per micro-batch overlapped with backward), on 1, 2 and 8 nodes."""
    rows, lines = [], ["", "bf16 ZeRO-1 (BF16 optimizer) against ZeRO-2, NormFormer recipes (step s):", ""]
    lines += [
        "| recipe | GPU | nodes | ZeRO-1 step (DP exposed) | ZeRO-2 step (DP exposed) | ZeRO-2 / ZeRO-1 |"
    ]
    lines += ["|---|---|---|---|---|---|"]
    for size in ("355m", "1.3b", "2.7b"):
        for gpu in ("a100-80gb", "h100-80gb"):
            for nodes in (1, 2, 8):
                world, got = nodes * GPUS_PER_NODE, {}
                for zero in (1, 2):
                    cfg = load_config(
                        os.path.join(REPO, f"configs/paper/{size}-normformer.yaml"),
                        [f"train.zero_stage={zero}"],
                    )
                    if cfg.train.global_batch_size % (cfg.train.micro_batch_size * world):
                        break
                    got[zero] = predict(cfg, DEVICE_SPECS[gpu], world, GPUS_PER_NODE)
                if len(got) < 2:
                    continue
                one, two = got[1], got[2]
                rows.append({"size": size, "gpu": gpu, "nodes": nodes, "zero1_step_s": one.total,
                             "zero1_dp_exposed_s": one.dp_comm, "zero2_step_s": two.total,
                             "zero2_dp_exposed_s": two.dp_comm})  # fmt: skip
                lines.append(
                    f"| {size}-normformer | {gpu} | {nodes} | {one.total:.3f} ({one.dp_comm:.3f}) | "
                    f"{two.total:.3f} ({two.dp_comm:.3f}) | {two.total / one.total:.3f} |"
                )
    return rows, lines


def _h200_lines() -> dict:
    """The measured H200 rows beside the model's predictions (``bench/steptime_h200.py``), and
    NormFormer / Pre-LN per size and block mode, measured and predicted."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import steptime_h200

    rows = [r for r in steptime_h200.rows() if "predicted_step_s" in r]
    lines = [
        "MEASURED and predicted on one H200 (bench/results/gpu/2026-11-26-h200*; one process, bf16, ZeRO-1, "
        "4 micro-batches; the model's constants fitted to the profiles, bench/steptime_h200.py):",
        "",
        "| recipe | blocks | micro | measured step s | predicted step s | error | measured MFU "
        "| predicted MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["recipe"] + "".join(f" ({e})" for e in r["extra"])
        lines.append(
            f"| {name} | {r['blocks']} | {r['micro_batch']} | {r['step_s']:.3f} | "
            f"{r['predicted_step_s']:.3f} | {r['error']:+.1%} | {r['mfu']:.1%} | {r['predicted_mfu']:.1%} |"
        )
    ratios, seen = [], set()
    for r in rows:
        size, _, kind = r["recipe"].partition("-")
        key = (size, r["blocks"], tuple(r["extra"]))
        if kind != "normformer" or key in seen:
            continue
        base = next(
            (
                b
                for b in rows
                if b["recipe"] == f"{size}-baseline" and (size, b["blocks"], tuple(b["extra"])) == key
            ),
            None,
        )
        if base is None:
            continue
        seen.add(key)
        ratios.append({"size": size, "blocks": r["blocks"], "extra": r["extra"],
                       "measured": r["step_s"] / base["step_s"],
                       "predicted": r["predicted_step_s"] / base["predicted_step_s"]})  # fmt: skip
    lines += ["", "| NormFormer / Pre-LN | blocks | measured | predicted |", "|---|---|---|---|"]
    for q in ratios:
        extra = "".join(f" ({e})" for e in q["extra"])
        lines.append(f"| {q['size']}{extra} | {q['blocks']} | {q['measured']:.3f}× | {q['predicted']:.3f}× |")
    return {"lines": lines, "rows": rows, "ratios": ratios}


def _terms_lines(by: dict) -> list[str]:
    """The table of the predicted terms on one H100 node (share of the step), per recipe."""
    lines: list[str] = []
    terms = (
        "compute",
        "memory",
        "attention",
        "tp_comm",
        "pp_bubble",
        "pp_p2p",
        "dp_comm",
        "optimizer",
        "host",
    )
    lines += ["", "Predicted terms on one H100 node (share of the step):", ""]
    lines += ["| recipe | MFU | " + " | ".join(terms) + " |", "|---" * (2 + len(terms)) + "|"]
    for path in recipes():
        c = by[(path, "h100-80gb", 1)]
        if "step_s" in c:
            shares = " | ".join(f"{c[k] / c['step_s']:.1%}" for k in terms)
            lines.append(f"| {os.path.basename(path)[:-5]} | {c['mfu']:.1%} | {shares} |")
    return lines


def _overhead_lines(by: dict, head: str) -> tuple[dict, list[str]]:
    """NormFormer's predicted step-time overhead over Pre-LN per size, GPU and nodes, and its table."""
    overhead = {}
    lines: list[str] = []
    lines += ["", "NormFormer's PREDICTED step-time overhead over Pre-LN (same layout):", ""]
    lines += [f"| size | {head} |", "|---" * (1 + len(GPUS) * len(NODES)) + "|"]
    for size in ("125m", "355m", "1.3b", "2.7b"):
        row = []
        for g in GPUS:
            for n in NODES:
                base = by[(f"configs/paper/{size}-baseline.yaml", g, n)]
                nf = by[(f"configs/paper/{size}-normformer.yaml", g, n)]
                if "step_s" not in base or "step_s" not in nf:
                    row.append("—")
                    continue
                ratio = nf["step_s"] / base["step_s"] - 1
                overhead[f"{size}/{g}/{n}"] = ratio
                row.append(f"{ratio:+.1%}")
        lines.append(f"| {size} | " + " | ".join(row) + " |")
    return overhead, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "steptime_table.json"))
    args = parser.parse_args()
    h200 = _h200_lines()
    prefetch_traces()
    cells = [cell(p, g, n) for p in recipes() for g in GPUS for n in NODES]
    by = {(c["path"], c["gpu"], c["nodes"]): c for c in cells}

    head = " | ".join(f"{g.split('-')[0].upper()} ×{n}" for g in GPUS for n in NODES)
    lines = h200["lines"] + [
        "",
        "PREDICTED MFU / tokens/s per GPU (the step-time model; no V100, A100 or H100 was measured; "
        "nodes of 8; † = micro-batch lowered to split the batch, * = does not fit the planner's 80 % limit)",
        "",
        f"| recipe | {head} |",
        "|---" * (1 + len(GPUS) * len(NODES)) + "|",
    ]
    for path in recipes():
        row = []
        for g in GPUS:
            for n in NODES:
                c = by[(path, g, n)]
                if "mfu" not in c:
                    row.append("—")
                    continue
                mark = ("†" if c["note"] else "") + ("" if c["fits"] else "*")
                row.append(f"{c['mfu']:.0%} / {c['tokens_per_s_per_device']:,.0f}{mark}")
        lines.append(f"| {os.path.basename(path)[:-5]} | " + " | ".join(row) + " |")

    overhead, overhead_lines = _overhead_lines(by, head)
    lines += overhead_lines

    lines += _terms_lines(by)
    zero2, zero2_lines = zero2_comparison()
    lines += zero2_lines
    text = "\n".join(lines)
    print(text)
    atomic_write_json(
        args.out,
        {
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "what": "predictions of megaformer.perf.steptime (not measurements)",
            "gpus_per_node": GPUS_PER_NODE,
            "cells": cells,
            "normformer_overhead": overhead,
            "h200_measured_vs_predicted": h200["rows"],
            "h200_normformer_ratio": h200["ratios"],
            "bf16_zero1_vs_zero2": zero2,
            "markdown": text,
        },
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
