"""The step-time model's block counts, fake-CUDA trace against formula, for every shipped recipe.

For each recipe (``configs/paper/*.yaml``, ``configs/normformer-*.yaml``) at its own layout (micro-batch,
TP size, sequence parallelism, precision, recompute), one transformer block, one micro-batch, one rank:
GEMM FLOPs, attention FLOPs (causal not halved), memory-bound bytes and TP bytes (ring bytes each rank
sends), from :func:`megaformer.perf.optrace.trace_block` and from the formula of
:func:`megaformer.perf.costs.formula_block_costs` (read with unit-rate devices:
:func:`~megaformer.perf.optrace.formula_counts`). Prints the table and writes
``bench/results/steptime_trace.json`` with, per recipe, both counts, their ratios, the trace's memory
bytes by op and phase, and the seconds the traces took.

The memory-bound bytes three ways: the eager trace, the compiled block as estimated by
:func:`megaformer.perf.optrace.fuse` (inductor's fusion of the memory-bound ops between extern
kernels, plus megaformer's opaque dropout / attention-dropout operators: an estimate, an upper bound
on what fusion saves), and the formula; and NormFormer's bytes over the Pre-LN baseline's, eager and
fused, for each ``configs/paper`` pair; ``cols apart``: the fused estimate with each column reduction
(bias / gain gradient summed over tokens) a kernel of its own (``fuse(column_reductions_fuse=False)``).

The estimate against inductor (2026-11-25, torch 2.13.0+cpu, this 2-core VM): one block compiled with
inductor's C++ backend on the CPU (``torch.compile(fullgraph=True, dynamic=False)``, fp32, dropout
off; b 2, s 256, d 256, 4 heads, FFN 1024), each generated ``cpp_fused_*`` kernel's traffic counted
from the output code (its ``in_ptr`` / ``out_ptr`` / ``in_out_ptr`` buffers, full size each), against
``fuse`` of the same block traced on fake CUDA (MB per micro-batch; kernels):

    ===========  ===========  ===================  ===================  ============  ======
    block        phase        estimate (cols fuse  estimate (cols       inductor CPU  eager
                              / kernels)           apart / kernels)     (kernels)     trace
    ===========  ===========  ===================  ===================  ============  ======
    Pre-LN       forward       8.93 / 4             8.93 / 4             8.94 / 4     11.55
    Pre-LN       backward     17.33 / 5            21.52 / 9            22.07 / 6     23.62
    NormFormer   forward       9.99 / 5             9.99 / 5            10.01 / 5     18.91
    NormFormer   backward     20.51 / 6            26.27 / 11           24.73 / 6     37.81
    ===========  ===========  ===================  ===================  ============  ======

NormFormer − Pre-LN: eager +21.5 MB (+61%), inductor +3.7 MB (+12%), estimate +4.2 MB (+16%; columns
apart +5.8 MB). The forward kernels match in number and bytes (within 0.3%); in backward inductor's
C++ backend recomputes the pointwise gradient inside the column reductions (bias sums) and
materialises the q, k, v gradients' ``stack`` (a ``ConcatKernel``) before the copy to qkv's layout,
so its bytes lie between the two estimates. (The d = 64, s = 32 block: forward 4 / 4 and 5 / 5 kernels,
0.281 vs 0.282 MB and 0.318 vs 0.320 MB; backward 0.546 – 0.677 vs 0.779 MB and 0.652 – 0.832 vs
0.785 MB.) GPU kernels (Triton) were not compiled: no GPU in that session.

    .venv/bin/python bench/steptime_trace.py [--gpu h100-80gb] [--out bench/results/steptime_trace.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megaformer.config import load_config  # noqa: E402
from megaformer.perf import optrace  # noqa: E402

METRICS = ("gemm_flops", "attention_flops", "memory_bytes", "tp_wire_bytes")
ABLATIONS = {
    "ffn_ln off": ["model.ffn_ln=false"],
    "no sequence parallelism": ["parallel.sequence_parallel=false"],
    "ffn_ln off, no sequence parallelism": ["model.ffn_ln=false", "parallel.sequence_parallel=false"],
    "full recompute": ["train.recompute=full"],
}
"""Variants of the tp > 1 recipes that attribute their differences (the TP FFN LayerNorm, sequence
parallelism, recompute), traced beside them; a variant equal to the recipe is left out."""


def recipes() -> list[str]:
    """The shipped recipes, paths relative to the repository root."""
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "*.yaml")))
    paths += sorted(glob.glob(os.path.join(ROOT, "configs", "normformer-*.yaml")))
    return [os.path.relpath(p, ROOT) for p in paths]


def row(path: str, cfg, trace, q: int) -> dict:
    """One recipe's comparison (trace, formula, trace / formula) and the trace's details."""
    tr, fo = optrace.trace_counts(trace), optrace.formula_counts(cfg, q)
    ratio = {k: (tr[k] / fo[k] if fo[k] else (1.0 if not tr[k] else float("inf"))) for k in METRICS}
    by_op = optrace.memory_by_op(trace)
    fused = optrace.fuse(trace)
    return {
        "recipe": path,
        "layout": {
            "micro_batch_size": cfg.train.micro_batch_size,
            "seq_len": cfg.model.seq_len,
            "tp": cfg.parallel.tp_size,
            "sequence_parallel": trace.key.sequence_parallel,
            "recompute": cfg.train.recompute_mode,
            "dtype": trace.key.dtype,
        },
        "trace": tr,
        "formula": fo,
        "trace_over_formula": ratio,
        "fused_over_trace": tr["fused_memory_bytes"] / tr["memory_bytes"],
        "fused_kernels_by_phase": {
            phase: fused.count(phase) for phase in ("forward", "backward", "recompute") if fused.count(phase)
        },
        "gemms": len(trace.gemms),
        "attention_ops": [op.name for op in trace.of_kind("attention")],
        "collectives": trace.collectives,
        "memory_by_op": [{"op": k, "calls": c, "bytes": b} for k, (c, b) in list(by_op.items())[:25]],
        "trace_seconds_in_child": trace.seconds,
    }


def show(rows: list[dict]) -> str:
    head = f"{'recipe':72s} {'tp/sp/rc/dt':>16s}"
    head += "".join(f" {m.split('_')[0] + ' trace':>13s} {'formula':>11s} {'ratio':>6s}" for m in METRICS)
    lines = [head]
    for r in rows:
        lay = r["layout"]
        tag = f"{lay['tp']}/{int(lay['sequence_parallel'])}/{lay['recompute'][:4]}/{lay['dtype']}"
        cells = "".join(
            f" {r['trace'][m]:13.4g} {r['formula'][m]:11.4g} {r['trace_over_formula'][m]:6.3f}"
            for m in METRICS
        )
        lines.append(f"{r['recipe']:72s} {tag:>16s}{cells}")
    return "\n".join(lines)


def _tag(r: dict) -> str:
    lay = r["layout"]
    return f"{lay['tp']}/{int(lay['sequence_parallel'])}/{lay['recompute'][:4]}/{lay['dtype']}"


def show_fused(rows: list[dict]) -> str:
    """Memory-bound bytes per block and micro-batch: eager trace, fused estimate (of which the opaque
    operators'), fused / eager, formula, and the fused kernels (regions)."""
    head = f"{'recipe':72s} {'tp/sp/rc/dt':>16s} {'eager MB':>10s} {'fused MB':>10s} {'(extern)':>9s}"
    lines = [head + f" {'fused/eager':>11s} {'cols apart':>10s} {'formula MB':>10s} {'kernels':>7s}"]
    for r in rows:
        tr = r["trace"]
        lines.append(
            f"{r['recipe']:72s} {_tag(r):>16s} {tr['memory_bytes'] / 1e6:10.2f}"
            f" {tr['fused_memory_bytes'] / 1e6:10.2f} {tr['fused_extern_bytes'] / 1e6:9.2f}"
            f" {r['fused_over_trace']:11.3f} {tr['fused_memory_bytes_columns_apart'] / 1e6:10.2f}"
            f" {r['formula']['memory_bytes'] / 1e6:10.2f}"
            f" {tr['fused_kernels']:7.0f}"
        )
    return "\n".join(lines)


def normformer_overheads(rows: list[dict]) -> list[dict]:
    """NormFormer − Pre-LN memory-bound bytes, eager and fused, for each ``configs/paper`` pair
    (``X-baseline.yaml`` and ``X-normformer.yaml``, each at its own layout)."""
    by_path = {r["recipe"]: r for r in rows}
    out = []
    for path, base in by_path.items():
        if not path.startswith("configs/paper/") or not path.endswith("-baseline.yaml"):
            continue
        nf = by_path.get(path.replace("-baseline.yaml", "-normformer.yaml"))
        if nf is None:
            continue
        eager = nf["trace"]["memory_bytes"] - base["trace"]["memory_bytes"]
        fused = nf["trace"]["fused_memory_bytes"] - base["trace"]["fused_memory_bytes"]
        apart = "fused_memory_bytes_columns_apart"
        fused_apart = nf["trace"][apart] - base["trace"][apart]
        out.append(
            {
                "pair": path.removesuffix("-baseline.yaml").removeprefix("configs/paper/"),
                "same_layout": base["layout"] == nf["layout"],
                "eager_extra_bytes": eager,
                "fused_extra_bytes": fused,
                "eager_extra_over_baseline": eager / base["trace"]["memory_bytes"],
                "fused_extra_over_baseline": fused / base["trace"]["fused_memory_bytes"],
                "fused_columns_apart_extra_bytes": fused_apart,
                "fused_columns_apart_extra_over_baseline": fused_apart / base["trace"][apart],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gpu", default="h100-80gb", help="fake GPU (its attention kernel): h100-80gb, v100-32gb"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "steptime_trace.json"))
    args = ap.parse_args(argv)
    paths = recipes()
    cfgs = [load_config(os.path.join(ROOT, p)) for p in paths]
    for path, cfg in list(zip(paths, cfgs)):
        if cfg.parallel.tp_size > 1:
            seen = {optrace.trace_key(cfg)}
            for name, overrides in ABLATIONS.items():
                variant = load_config(os.path.join(ROOT, path), overrides)
                if optrace.trace_key(variant) not in seen:
                    seen.add(optrace.trace_key(variant))
                    paths.append(f"{path} [{name}]")
                    cfgs.append(variant)
    t0 = time.perf_counter()
    traces = optrace.trace_blocks(cfgs, gpu=args.gpu)
    wall = time.perf_counter() - t0
    rows = []
    for path, cfg, trace in zip(paths, cfgs, traces):
        q = 4 if trace.key.dtype == "fp32" else 2
        rows.append(row(path, cfg, trace, q))
    print(show(rows))
    print()
    print(show_fused(rows))
    overheads = normformer_overheads(rows)
    print()
    for o in overheads:
        print(
            f"NormFormer - Pre-LN {o['pair']:>8s}: eager {o['eager_extra_bytes'] / 1e6:+9.2f} MB"
            f" ({o['eager_extra_over_baseline']:+.1%}), fused {o['fused_extra_bytes'] / 1e6:+9.2f} MB"
            f" ({o['fused_extra_over_baseline']:+.1%}), columns apart"
            f" {o['fused_columns_apart_extra_bytes'] / 1e6:+9.2f} MB"
            f" ({o['fused_columns_apart_extra_over_baseline']:+.1%})"
            f"{'' if o['same_layout'] else ' (layouts differ)'}"
        )
    print(f"{len(rows)} recipes traced in {wall:.1f} s ({len({t.key.tp for t in traces})} child process(es))")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        out = {"gpu": args.gpu, "seconds_all_traces": wall, "recipes": rows, "normformer_overhead": overheads}
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
