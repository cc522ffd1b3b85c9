"""The dry run (``megaformer.tools.dryrun``) of every shipped recipe at its layout, against the planner.

    .venv/bin/python bench/dryrun_recipes.py            # runs every dry run (~15 min on 2 cores)
    .venv/bin/python bench/dryrun_recipes.py --only 1.3b-normformer --only 1.3b-normformer-v100
    .venv/bin/python bench/dryrun_recipes.py --table    # only the table, from the saved reports

Each layout runs as the rank the dry run picks (the busiest pipeline stage's first rank) with the
recipe's full micro-batch count, on the GPU its header names (the paper recipes: the file on an A100
80GB, ``<name>-v100`` its ``# V100 overrides:`` line on a V100 32GB), and writes
``bench/results/dryrun/<name>.json`` (the dry run's report) and ``.txt`` (its console). The table
(printed, and written to ``bench/results/dryrun/summary.md`` and ``summary.json``) sets the fake
allocations' peak by category beside the planner's figure for the same layout, computed now (so a
planner change shows at once without running the dry runs again). The planner's ``buffers`` (CUDA
context, NCCL, cuBLAS workspaces: 2 GiB) are memory no fake allocation sees; the fake run's
``other`` is what backward allocates besides gradients (activation gradients, the logits'
gradient), which the planner counts inside its activation and logit terms. So the comparable sums
are activations + other (measured) against activations + logits (planned), and the measured total
+ 2 GiB against the planner's total.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "results" / "dryrun"
GIB = 1024**3
CONTEXT_GIB = 2.0  # the planner's buffers term (CUDA context, NCCL, workspaces)

PAPER = [
    (f"{s}-{k}", n)
    for s, n in (("125m", 1), ("355m", 1), ("1.3b", 2), ("2.7b", 4))
    for k in ("baseline", "normformer")
]
PAPER += [(f"mlm-125m-{k}", 1) for k in ("baseline", "normformer", "normformer-resscale")]


def _v100_overrides(name: str) -> list[str]:
    text = (REPO / "configs" / "paper" / f"{name}.yaml").read_text(encoding="utf-8")
    return re.search(r"^# V100 overrides: (.*)$", text, re.MULTILINE)[1].split()


RECIPES = [  # name, config, nodes × 8 GPUs, GPU (the header's), overrides
    *[(name, f"configs/paper/{name}.yaml", n, "a100-80gb", []) for name, n in PAPER],
    *[
        (f"{name}-v100", f"configs/paper/{name}.yaml", n, "v100-32gb", _v100_overrides(name))
        for name, n in PAPER
    ],
    ("normformer-1.3b-3d-v100", "configs/normformer-1.3b-3d-v100.yaml", 32, "v100-32gb", []),
    ("normformer-2.7b-3d-a100", "configs/normformer-2.7b-3d-a100.yaml", 32, "a100-80gb", []),
    ("normformer-350m-zero2", "configs/normformer-350m-zero2.yaml", 1, "a100-80gb", []),
]


def run_all(only: list[str] | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, config, nodes, gpu, overrides in RECIPES:
        if only and name not in only:
            continue
        cmd = [
            sys.executable,
            "-m",
            "megaformer.tools.dryrun",
            config,
            *overrides,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "8",
            "--gpu",
            gpu,
            "--output",
            str(OUT / f"{name}.json"),
        ]
        print(f"[dryrun_recipes] {name}: {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (OUT / f"{name}.txt").write_text(proc.stdout + proc.stderr)
        print(f"[dryrun_recipes] {name}: exit {proc.returncode}", flush=True)


def rows() -> list[dict]:
    """One row per recipe: measured (from its saved report) and planned (the planner, now)."""
    from megaformer.config import load_config
    from megaformer.perf.fakecuda.session import GRADIENT_BUFFER_SITES
    from megaformer.perf.plan import DEVICES, make_plan

    out = []
    for name, config, _nodes, gpu, _overrides in RECIPES:
        path = OUT / f"{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        if "memory" not in result:
            out.append({"name": name, "ok": False, "problems": result.get("problems")})
            continue
        cfg = load_config(config, result.get("overrides", []))
        stage = result["report"]["layout"]["pp_rank"]
        s = make_plan(cfg, DEVICES[gpu], result["world"]).stages[stage]
        got = dict(result["report"]["peak_by_category"])
        # DeepSpeed's reduction buckets are gradient buffers (reports written before the dry run
        # labelled them so had them under "other")
        for big in result["report"].get("peak_largest", []):
            if big["category"] == "other" and re.search(GRADIENT_BUFFER_SITES, big["where"]):
                got["other"] -= big["bytes"]
                got["gradients"] += big["bytes"]
        measured = {k: got[k] / GIB for k in got}
        planned = {
            "parameters": s.weights / GIB,
            "gradients": s.grads / GIB,
            "optimizer_state": s.optimizer / GIB,
            "activations": (s.activations + s.logits) / GIB,
            "buffers": s.buffers / GIB,
        }
        out.append(
            {
                "name": name,
                "gpu": gpu,
                "rank": result["rank"],
                "world": result["world"],
                "ok": result["ok"],
                "micro_batches": result["report"]["engine"]["gas"],
                "seconds": result["report"]["seconds"],
                "measured_gib": measured,
                "planned_gib": planned,
                "measured_total_gib": result["report"]["peak_bytes"] / GIB + CONTEXT_GIB,
                "planned_total_gib": s.total / GIB,
            }
        )
    return out


def _pct(a: float, b: float) -> str:
    return f"{(a - b) / b:+.0%}" if b else "-"


def table(data: list[dict]) -> str:
    lines = [
        "| recipe (rank of world, GPU) | verdict | parameters | gradients | optimizer state "
        "| activations + other (vs activations + logits) | total + 2 GiB context (vs planner) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data:
        if "measured_gib" not in r:
            lines.append(f"| {r['name']} | NOT OK: {r.get('problems')} | | | | | |")
            continue
        m, p = r["measured_gib"], r["planned_gib"]
        cells = [
            f"{m[k]:.2f} / {p[k]:.2f} ({_pct(m[k], p[k])})"
            for k in ("parameters", "gradients", "optimizer_state")
        ]
        act_m = m["activations"] + m["other"]
        cells.append(f"{act_m:.2f} / {p['activations']:.2f} ({_pct(act_m, p['activations'])})")
        cells.append(
            f"{r['measured_total_gib']:.2f} / {r['planned_total_gib']:.2f} "
            f"({_pct(r['measured_total_gib'], r['planned_total_gib'])})"
        )
        head = f"{r['name']} (rank {r['rank']} of {r['world']}, {r['gpu']})"
        lines.append(f"| {head} | {'OK' if r['ok'] else 'NOT OK'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", action="store_true", help="only the table, from the saved reports")
    names = [r[0] for r in RECIPES]
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only these (one of {', '.join(names)})",
    )
    args = parser.parse_args()
    if not args.table:
        run_all(args.only)
    data = rows()
    md = table(data)
    (OUT / "summary.md").write_text(
        "GiB, measured (fake allocations) / planned (megaformer.tools.plan)\n\n" + md + "\n"
    )
    (OUT / "summary.json").write_text(json.dumps(data, indent=1))
    print(md)
    return 0 if all(r["ok"] for r in data) else 1


if __name__ == "__main__":
    sys.exit(main())
