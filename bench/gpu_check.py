"""The day a GPU is there: measurements beside predictions, in one JSON and one Markdown table.

    bash scripts/gpu_check.sh [--smoke]           # runs this after pytest -m gpu tests/gpu
    .venv/bin/python bench/gpu_check.py [--sizes 125m,355m,1.3b] [--steps 10] [--smoke]
    .venv/bin/python bench/gpu_check.py --predict-only --gpu h100-80gb     # on a CPU machine

For each case of ``bench/gpu.py`` (a paper recipe on one GPU: ZeRO 0/1 × recompute), the measured
peak memory, tokens/s and MFU beside two predictions of the same configuration: the planner's
(``megaformer.tools.plan``) and the fake-CUDA dry run's (``megaformer.fakecuda``: the fake
allocations' peak, by category). The dry run needs a CPU build of torch (its shim stands in for
CUDA); on the GPU machine its figures are read from ``bench/results/gpu_check_predictions.json``,
written beforehand on a CPU machine with ``--predict-only --gpu <the GPU>``, and a case without one
says so. ``--smoke`` runs the CPU path of everything (a tiny model, gloo): CI runs it to keep the
script working; its figures mean nothing.

Writes ``--out`` (JSON, default ``bench/results/gpu_check.json``) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREDICTIONS = REPO / "bench" / "results" / "gpu_check_predictions.json"
GIB = 1024**3


def case_key(row: dict, gpu: str) -> str:
    return f"{row['recipe']}|{' '.join(row['overrides'])}|{gpu}"


def predict(row: dict, gpu: str, smoke: bool) -> dict:
    """Planner and dry-run predictions for one bench case (the same config, one GPU)."""
    from megaformer.config import load_config
    from megaformer.tools.plan import DEVICES, cpu_device, make_plan

    path = f"configs/paper/{row['recipe']}.yaml"
    cfg = load_config(path, row["overrides"])
    device = cpu_device(1) if smoke else DEVICES[gpu]
    plan = make_plan(cfg, device, 1)
    out: dict = {"planner_peak_gib": plan.peak / GIB, "planner_step_s_at_40pct_mfu": plan.step_time_s}
    if not smoke:  # the step-time model (plan --predict) for the same config on one such GPU
        from megaformer.tools import steptime

        try:
            out["steptime"] = steptime.predict(cfg, steptime.DEVICE_SPECS[gpu], 1, 1).as_dict()
        except RuntimeError as e:  # its block trace needs a CPU torch (fake CUDA): a CUDA image has none
            hint = "bench/gpu_check.py --repredict THIS.json on a CPU machine"
            out["steptime"] = {"error": f"{str(e).splitlines()[0]}; run {hint}"}
    try:
        from megaformer.fakecuda.build import build_shim
        from megaformer.fakecuda.launch import run_session

        build_shim()
    except Exception as e:  # a CUDA torch or no compiler: the committed predictions, if any
        saved = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
        dry = saved.get(case_key(row, gpu))
        hint = f"bench/gpu_check.py --predict-only --gpu {gpu} on a CPU machine"
        out["dryrun"] = dry or {"missing": f"no dry-run prediction here ({type(e).__name__}); run {hint}"}
        return out
    report = run_session(path, row["overrides"], world_size=1, rank=0, gpu=gpu, steps=2)
    if "error" in report:
        out["dryrun"] = {"error": report["error"]}
    else:
        by_category = {k: v / GIB for k, v in report["peak_by_category"].items()}
        out["dryrun"] = {"peak_gib": report["peak_bytes"] / GIB, "by_category_gib": by_category}
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| recipe | ZeRO | recompute | micro | step s | predicted step s | tokens/s | MFU | predicted MFU "
        "| peak GiB measured | dry run | planner |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("prediction", {})
        dry = p.get("dryrun", {})
        dry_s = f"{dry['peak_gib']:.2f}" if "peak_gib" in dry else (dry.get("error") or "not predicted")[:40]
        if "error" in r:
            measured = f"error: {r['error'][:40]}"
            lines.append(
                f"| {r['recipe']} | {r['zero']} | {r['recompute']} | | | | | | | {measured} | {dry_s} | |"
            )
            continue
        mem = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        planned = p.get("planner_peak_gib", float("nan"))
        st = p.get("steptime")
        st_step, st_mfu = (f"{st['step_s']:.3f}", f"{st['mfu']:.1%}") if st and "step_s" in st else ("-", "-")
        lines.append(
            f"| {r['recipe']} | {r['zero']} | {r['recompute']} | {r['micro_batch']} | {r['step_s']:.3f} | "
            f"{st_step} | {r['tokens_per_s']:,.0f} | {mfu} | {st_mfu} | {mem} | {dry_s} | {planned:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="125m,355m,1.3b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", default=None, help="ZeRO/recompute cases for bench/gpu.py (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for bench/gpu.py")
    parser.add_argument("--profile", default=None, help="for bench/gpu.py: a folder for profiler tables")
    parser.add_argument(
        "--gpu", default=None, help="the GPU kind (default: detected; --predict-only: required)"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--predict-only", action="store_true", help="write dry-run predictions (CPU machine)")
    parser.add_argument(
        "--repredict",
        metavar="JSON",
        help="a gpu_check JSON measured elsewhere: predict its rows again here (planner, step-time "
        "model, dry run) and write --out with its table",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_check.json"))
    args = parser.parse_args()
    bench_out = Path(args.out).with_name(Path(args.out).stem + "_bench.json")
    if args.repredict:
        try:
            measured = json.loads(Path(args.repredict).read_text())
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"--repredict {args.repredict}: {e} (a JSON that bench/gpu_check.py wrote, whole)")
        return _write(measured["rows"], args.gpu or measured["gpu"], False, args.out)
    if args.predict_only:
        if not args.gpu:
            parser.error("--predict-only needs --gpu (e.g. h100-80gb)")
        from bench.gpu import case_rows

        rows = case_rows(args.sizes.split(","), args.gpu)
        saved = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
        for row in rows:
            p = predict(row, args.gpu, smoke=False)
            saved[case_key(row, args.gpu)] = p["dryrun"]
            print(f"{row['recipe']} {' '.join(row['overrides'])}: {p['dryrun']}", flush=True)
        PREDICTIONS.write_text(json.dumps(saved, indent=1))
        return 0
    cmd = (
        [
            sys.executable,
            str(REPO / "bench" / "gpu.py"),
            "--sizes",
            args.sizes,
            "--steps",
            str(args.steps),
            "--out",
            str(bench_out),
        ]
        + (["--smoke"] if args.smoke else [])
        + (["--cases", args.cases] if args.cases else [])
    )
    cmd += [f"--set={item}" for item in args.set] + ([f"--profile={args.profile}"] if args.profile else [])
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
        return 1
    rows = json.loads(bench_out.read_text())
    return _write(rows, args.gpu or ("a100-80gb" if args.smoke else _detect_gpu(rows)), args.smoke, args.out)


def _write(rows: list[dict], gpu: str, smoke: bool, out: str) -> int:
    """Each measured row's predictions beside it; ``out`` (JSON) and its Markdown table."""
    for row in rows:
        if "overrides" in row:
            row["prediction"] = predict(row, gpu, smoke)
    Path(out).write_text(json.dumps({"gpu": gpu, "smoke": smoke, "rows": rows}, indent=1))
    md = table(rows)
    Path(out).with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"\nwritten: {out} and {Path(out).with_suffix('.md')}")
    return 0


def _detect_gpu(rows: list[dict]) -> str:
    """The GPU kind of the measurements (by the device name bench/gpu.py recorded)."""
    name = next((r.get("device", "") for r in rows if "device" in r), "").upper()
    for key, tag in (
        ("h200-141gb", "H200"),
        ("h100-80gb", "H100"),
        ("a100-80gb", "A100-SXM4-80GB"),
        ("a100-40gb", "A100"),
        ("v100-32gb", "V100"),
    ):
        if tag in name:
            return key
    return "h100-80gb"


if __name__ == "__main__":
    sys.exit(main())
