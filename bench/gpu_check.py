"""The day a GPU is there: NormFormer and Pre-LN measured in pairs, in one JSON and one Markdown table.

    bash scripts/gpu_check.sh                      # on the GPU machine (runs this; docs/gpus.md)
    python3 bench/gpu_check.py [--sizes 125m,1.3b,355m] [--cases 1/none] [--steps 10] [--out DIR]
    python3 bench/gpu_check.py --estimate          # the case list and its predicted duration
    .venv/bin/python bench/gpu_check.py --repredict DIR_OR_JSON [--out ...]   # afterwards, on a CPU
    .venv/bin/python bench/gpu_check.py --predict-only --gpu h100-80gb        # dry-run peaks, CPU

**Measure** (the default): for each size, NormFormer then its Pre-LN baseline (``configs/paper/
{size}-{normformer,baseline}.yaml``), each in a fresh process through ``bench/gpu.py``'s
:func:`~bench.gpu.run_case` (one GPU, bf16, the recipe's DeepSpeed JSON, blocks compiled as
``train.compile`` does on CUDA, 4 micro-batches per step, 3 warm-up and ``--steps`` timed steps,
then one step under the profiler naming the attention kernels); then ``bench/gpu_probe.py`` (compiled
against eager dropout masks and gradients on the device). Per case: step time, tokens/s, MFU, peak
memory, the attention backend and its forward calls per step, the case's wall time; per size the
NormFormer / Pre-LN step ratio. The JSON is rewritten after every case, so a run stopped part-way
keeps what it measured.

``--budget-s``: the seconds this command may take. A case is started only if the estimate of its
duration (:func:`estimate_case_s`, from the committed H200 timings) fits in what is left after the
probe's share, and is killed when it outlives that; a case not started is recorded as skipped. The
default case list (:data:`DEFAULT_SIZES` × :data:`DEFAULT_CASES`, pairs) is sized to end inside
:data:`TIME_LIMIT_S` (``--estimate`` prints the arithmetic; a unit test holds it).

Predictions are not made on the GPU machine: the step-time model and the dry run trace the model on
fake CUDA, which needs a CPU build of torch. ``--repredict`` adds them afterwards on the CPU machine
to every measured row (the planner's peak, the step-time model's step and MFU, the fake-CUDA dry
run's peak) and writes ``<name>_predicted.json`` / ``.md``. ``--smoke`` runs the CPU path of all of
it (a tiny model over gloo, the probe on CPU, predictions made at once); its figures mean nothing.

``--out``: a folder (made if missing; the device's ``$OUT``) receives ``gpu_check.json`` and
``gpu_check.md`` (``gpu_check_smoke.*`` under ``--smoke``); a path ending in ``.json`` is the JSON
itself, with the table beside it as ``.md`` (the form of earlier runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREDICTIONS = REPO / "bench" / "results" / "gpu_check_predictions.json"
GIB = 1024**3

# The default case list: NormFormer / Pre-LN pairs at three sizes, ZeRO-1 without recompute (the
# recipes' layout), blocks compiled. 1.3B before 355M: if the budget runs short, 355M is the pair
# the goals need least.
DEFAULT_SIZES = "125m,1.3b,355m"
DEFAULT_CASES = "1/none"
TIME_LIMIT_S = 480.0  # the default run must end inside 8 minutes (issue 36: a 10-minute command)

# Time estimates, from the second H200 loan (bench/results/gpu/2026-11-26-h200-2/): the compiled
# step times of measured.json, and a fixed cost per case (process start, imports, engine build,
# inductor's compilation of one block and of the loss). That loan bounds the fixed cost: its fourth
# call, on a fresh machine (cold compile caches), held the GPU 107 s (11 min 22 s - 9 min 35 s,
# README.md) for the machine's start, the wheels' install and two compiled 125M cases whose 13 steps
# each took 15.5 s in all: at most (107 - 15.5) / 2 = 46 s per case, the machine's start included.
H200_TIMINGS = REPO / "bench" / "results" / "gpu" / "2026-11-26-h200-2" / "measured.json"
CASE_OVERHEAD_S = 46.0
WARMUP_STEPS = 3  # bench/gpu.py's warm-up steps
PROFILED_STEPS = 2  # the one step under the profiler (attention kernels), counted twice for its overhead
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.05, "full": 4 / 3}  # one more forward for full
PROBE_S = 60.0  # bench/gpu_probe.py: start, three small compilations; 60 s on this 2-core CPU
SETUP_S = 20.0  # scripts/gpu_check.sh before the cases: the wheels' install, deepspeed's import check


def output_paths(out: str | os.PathLike, stem: str = "gpu_check") -> tuple[Path, Path]:
    """The JSON and Markdown paths ``--out`` names: ``out/stem.json`` and ``out/stem.md`` for a folder
    (anything not ending in ``.json``; made if missing), else ``out`` and ``out`` with ``.md``.

    Raises:
        ValueError: ``out`` ends in ``.json`` but is a folder, or is a file that is not a folder.
    """
    path = Path(out)
    if path.suffix == ".json":
        if path.is_dir():
            raise ValueError(f"--out {out}: a folder named .json; give a folder or a file.json path")
        return path, path.with_suffix(".md")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: a file, not a folder; give a folder or a path ending in .json")
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{stem}.json", path / f"{stem}.md"


def committed_step_s(recipe: str, timings: Path = H200_TIMINGS) -> float:
    """The longest compiled step of ``recipe`` (e.g. ``"125m-normformer"``) in the committed H200
    timings, with the recipe's own dropout (rows with overrides beyond the case's are left out).

    Raises:
        KeyError: no such row, naming the file (a recipe never measured on the H200 has no estimate).
    """
    rows = json.loads(Path(timings).read_text())["rows"]
    steps = [
        r["step_s"]
        for r in rows
        if r["recipe"] == recipe and r.get("compiled_blocks") and not extra_overrides(r)
    ]
    if not steps:
        raise KeyError(f"{recipe}: no compiled step in {timings}; measure it once to estimate it")
    return max(steps)


def estimate_case_s(recipe: str, recompute: str, steps: int, timings: Path = H200_TIMINGS) -> float:
    """Seconds one case of ``bench/gpu.py`` takes on one H200: :data:`CASE_OVERHEAD_S` plus its
    warm-up, timed and profiled steps at the committed step time (scaled for recomputation)."""
    step_s = committed_step_s(recipe, timings) * RECOMPUTE_FACTOR[recompute]
    return CASE_OVERHEAD_S + (WARMUP_STEPS + steps + PROFILED_STEPS) * step_s


def estimate_s(cases: list[tuple[str, int, str]], steps: int, probe: bool = True) -> dict:
    """The whole command's estimate on one H200: ``cases`` as ``bench/gpu.py`` lists them (recipe
    path, ZeRO, recompute), the probe and :data:`SETUP_S`. Returns ``{"cases": [(name, s)], "probe_s",
    "setup_s", "total_s"}``."""
    per_case = [
        (f"{Path(r).stem} ZeRO {z} {c}", estimate_case_s(Path(r).stem, c, steps)) for r, z, c in cases
    ]
    probe_s = PROBE_S if probe else 0.0
    total = SETUP_S + probe_s + sum(s for _, s in per_case)
    return {"cases": per_case, "probe_s": probe_s, "setup_s": SETUP_S, "total_s": total}


def case_key(row: dict, gpu: str) -> str:
    return f"{row['recipe']}|{' '.join(row['overrides'])}|{gpu}"


def predict(row: dict, gpu: str, smoke: bool, sessions=None) -> dict:
    """Planner and dry-run predictions for one bench case (the same config, one GPU); the dry run
    forked from ``sessions`` (a :class:`~megaformer.perf.fakecuda.launch.WarmSessions`, see
    :func:`warm_sessions`) when given, else in a fresh interpreter."""
    from megaformer.config import load_config
    from megaformer.perf.plan import DEVICES, cpu_device, make_plan

    path = f"configs/paper/{row['recipe']}.yaml"
    cfg = load_config(path, row["overrides"])
    device = cpu_device(1) if smoke else DEVICES[gpu]
    plan = make_plan(cfg, device, 1)
    out: dict = {"planner_peak_gib": plan.peak / GIB, "planner_step_s_at_40pct_mfu": plan.step_time_s}
    if not smoke:  # the step-time model (plan --predict) for the same config on one such GPU
        from megaformer.perf import steptime

        try:
            out["steptime"] = steptime.predict(cfg, steptime.DEVICE_SPECS[gpu], 1, 1).as_dict()
        except RuntimeError as e:  # its block trace needs a CPU torch (fake CUDA): a CUDA image has none
            hint = "bench/gpu_check.py --repredict THIS.json on a CPU machine"
            out["steptime"] = {"error": f"{str(e).splitlines()[0]}; run {hint}"}
    try:
        from megaformer.perf.fakecuda.build import build_shim
        from megaformer.perf.fakecuda.launch import run_session

        build_shim()
    except Exception as e:  # a CUDA torch or no compiler: the committed predictions, if any
        saved = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
        dry = saved.get(case_key(row, gpu))
        hint = f"bench/gpu_check.py --predict-only --gpu {gpu} on a CPU machine"
        out["dryrun"] = dry or {"missing": f"no dry-run prediction here ({type(e).__name__}); run {hint}"}
        return out
    report = run_session(path, row["overrides"], world_size=1, rank=0, gpu=gpu, steps=2, sessions=sessions)
    if "error" in report:
        out["dryrun"] = {"error": report["error"]}
    else:
        by_category = {k: v / GIB for k, v in report["peak_by_category"].items()}
        out["dryrun"] = {"peak_gib": report["peak_bytes"] / GIB, "by_category_gib": by_category}
    return out


@contextlib.contextmanager
def warm_sessions():
    """Warm fake-CUDA interpreters for a loop of :func:`predict` calls (the imports paid once per
    GPU model, not per case), or None where fake CUDA cannot run (a CUDA image)."""
    try:
        from megaformer.perf.fakecuda.launch import WarmSessions
    except Exception:  # e.g. no compiler for the shim: predict() says why per case
        yield None
        return
    with WarmSessions() as sessions:
        yield sessions


def _size(recipe: str) -> str:
    """``"125m-normformer"`` -> ``"125m"``."""
    return recipe.split("-")[0]


def extra_overrides(row: dict) -> list[str]:
    """The overrides a row has beyond its case's own (``bench/gpu.py``'s ``--set``): those after the
    case's ``train.global_batch_size``, its last."""
    overrides = row.get("overrides", [])
    last = max((i for i, o in enumerate(overrides) if o.startswith("train.global_batch_size=")), default=-1)
    return overrides[last + 1 :]


def _measured(row: dict) -> bool:
    return "step_s" in row and "error" not in row and "skipped" not in row


def pair_ratios(rows: list[dict]) -> list[dict]:
    """NormFormer / Pre-LN step time for every size, ZeRO stage, recompute and block mode measured
    for both (``{size}-normformer`` against ``{size}-baseline``, the same extra overrides)."""
    by_key: dict[tuple, dict] = {}
    for row in filter(_measured, rows):
        size, _, kind = row["recipe"].partition("-")
        extra = tuple(extra_overrides(row))
        key = (size, row["zero"], row["recompute"], bool(row.get("compiled_blocks")), extra)
        by_key.setdefault(key, {})[kind] = row
    pairs = []
    for (size, zero, recompute, compiled, extra), both in by_key.items():
        if "normformer" in both and "baseline" in both:
            nf, base = both["normformer"]["step_s"], both["baseline"]["step_s"]
            pairs.append(
                {
                    "size": size,
                    "zero": zero,
                    "recompute": recompute,
                    "blocks": "compiled" if compiled else "eager",
                    "extra_overrides": list(extra),
                    "normformer_step_s": nf,
                    "baseline_step_s": base,
                    "ratio": nf / base,
                }
            )
    return pairs


def _attention_cell(row: dict) -> str:
    a = row.get("attention")
    if not a:
        return "-"
    return f"{a['backend']}, {a['forward_calls']} fwd for {a['expected_forwards']}"


def _prediction_cells(row: dict) -> list[str]:
    p = row.get("prediction") or {}
    st = p.get("steptime") or {}
    if "step_s" in st:
        cells = [f"{st['step_s']:.3f}", f"{row['step_s'] / st['step_s']:.2f}×", f"{st['mfu']:.1%}"]
    else:
        cells = ["-", "-", "-"]
    dry = p.get("dryrun")
    if dry is None:
        cells.append("-")
    elif "peak_gib" in dry:
        cells.append(f"{dry['peak_gib']:.2f}")
    else:
        cells.append((dry.get("error") or dry.get("missing") or "not predicted")[:40])
    cells.append(f"{p['planner_peak_gib']:.2f}" if "planner_peak_gib" in p else "-")
    return cells


def table(doc: dict) -> str:
    """The Markdown of a gpu_check JSON: one row per case (measured, then predicted where predicted),
    the NormFormer / Pre-LN ratios, the probe's verdict and the software."""
    lines = [
        "| recipe | ZeRO | recompute | micro | blocks | step s | tokens/s | MFU | peak GiB | attention "
        "| case wall s | predicted step s | measured / predicted | predicted MFU | dry-run peak GiB "
        "| planner peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        head = f"| {r['recipe']} | {r['zero']} | {r['recompute']} |"
        if not _measured(r):
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r.get('error', '?')}"
            why = why.replace("\n", " ").replace("|", "/")[-120:]
            lines.append(f"{head} {' | '.join(['', '', why] + [''] * 10)} |")  # in "step s", 16 columns
            continue
        mem = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        blocks = "compiled" if r.get("compiled_blocks") else "eager"
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
        cells = [
            str(r["micro_batch"]),
            blocks,
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            mfu,
            mem,
            _attention_cell(r),
            wall,
            *_prediction_cells(r),
        ]
        lines.append(f"{head} {' | '.join(cells)} |")
    pairs = doc.get("pairs") or pair_ratios(doc["rows"])
    if pairs:
        lines += [
            "",
            "| size | ZeRO | recompute | blocks | NormFormer step s | Pre-LN step s | NormFormer / Pre-LN |",
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for p in pairs:
            extra = f" ({' '.join(p['extra_overrides'])})" if p.get("extra_overrides") else ""
            lines.append(
                f"| {p['size']} | {p['zero']} | {p['recompute']} | {p['blocks']}{extra} | "
                f"{p['normformer_step_s']:.3f} | {p['baseline_step_s']:.3f} | {p['ratio']:.3f}× |"
            )
    probe = doc.get("probe")
    if probe:
        from bench.gpu_probe import summary

        lines += ["", "Compiled against eager on the device (`bench/gpu_probe.py`):", "", "```"]
        lines += [summary(probe), "```"]
    env = doc.get("environment")
    if env:
        lines += ["", "Software: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None)]
    return "\n".join(lines)


def environment() -> dict:
    """What ran: the device, Python, torch, CUDA, Triton and DeepSpeed versions, the commit."""
    import platform
    from importlib import metadata

    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("triton", "deepspeed"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        env["commit"] = (commit + (" + uncommitted changes" if dirty else "")) or None
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    return env


def _run_probe(device: str, timeout_s: float | None) -> dict:
    """``bench/gpu_probe.py --json`` in its own process (its compilations apart from the cases')."""
    cmd = [sys.executable, str(REPO / "bench" / "gpu_probe.py"), "--json", "--device", device]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"device": device, "ok": False, "error": f"timeout: stopped after {timeout_s:.0f} s"}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"device": device, "ok": False, "error": stderr.strip()[-600:] or f"exit {proc.returncode}"}


def _write(doc: dict, json_path: Path, md_path: Path, quiet: bool = False) -> None:
    json_path.write_text(json.dumps(doc, indent=1))
    md_path.write_text(table(doc) + "\n")
    if not quiet:
        print(table(doc))
        print(f"\nwritten: {json_path} and {md_path}", flush=True)


def _can_measure(smoke: bool) -> bool:
    """Whether this interpreter has torch and (unless ``smoke``) a CUDA device; says why not."""
    try:
        import torch
    except ImportError as e:
        print(
            f"error: {sys.executable} has no torch ({e}): run with the interpreter that has it (PYTHON=...)",
            file=sys.stderr,
        )
        return False
    if not smoke and not torch.cuda.is_available():
        print(
            f"no CUDA device for {sys.executable} (torch {torch.__version__}): nothing to measure. On a "
            "GPU machine, run with its python (PYTHON=python3); on a CPU, --smoke checks the script",
            file=sys.stderr,
        )
        return False
    return True


def _probe_within(deadline: float | None, smoke: bool) -> dict:
    """The compiled-against-eager probe if the time budget leaves 15 s for it, else why not."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left < 15:
        return {"device": "-", "ok": False, "error": f"skipped: the time budget ({left:.0f} s left)"}
    print("[gpu_check] probe: compiled against eager (bench/gpu_probe.py)", flush=True)
    return _run_probe("cpu" if smoke else "cuda", left)


def _run_cases(
    args, cases: list, doc: dict, deadline: float | None, probe_reserve: float, json_path: Path, md_path: Path
) -> None:
    """Runs each case (or records it skipped for the time budget) into ``doc["rows"]``."""
    from bench import gpu

    for n, (recipe, zero, recompute) in enumerate(cases, 1):
        name = f"{Path(recipe).stem} ZeRO {zero} {recompute}"
        timeout = None
        if deadline is not None:
            left = deadline - time.monotonic() - probe_reserve
            try:
                need = estimate_case_s(Path(recipe).stem, recompute, args.steps) if not args.smoke else 0.0
            except KeyError:  # never timed: started if any time is left, killed when it runs out
                need = 1.0
            if need > left:
                why = f"the time budget ({left:.0f} s left, the case needs ~{need:.0f} s)"
                doc["rows"].append(
                    {"recipe": Path(recipe).stem, "zero": zero, "recompute": recompute, "skipped": why}
                )
                print(f"[gpu_check] {n}/{len(cases)} {name}: skipped, {why}", flush=True)
                continue
            timeout = max(left, 1.0)
        doc["rows"].append(
            gpu._spawn(recipe, zero, recompute, args.steps, args.smoke, args.set, args.profile, timeout)
        )
        _write(doc, json_path, md_path, quiet=True)
        row = doc["rows"][-1]
        wall = f", {row['wall_s']:.0f} s in all" if "wall_s" in row else ""
        attention = f", attention {_attention_cell(row)}" if row.get("attention") else ""
        print(f"[gpu_check] {n}/{len(cases)} {name}: {gpu._brief(row)}{attention}{wall}", flush=True)


def measure(args, json_path: Path, md_path: Path) -> int:
    """The measurement (module docstring); exit status 0 when every case was measured and the probe
    agreed, 1 otherwise (the JSON says which)."""
    if not _can_measure(args.smoke):
        return 1
    from bench import gpu

    cases = gpu._cases(args.sizes.split(","), args.smoke, gpu.parse_cases(args.cases), pairs=True)
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else None
    probe_reserve = PROBE_S if args.probe else 0.0
    doc: dict = {
        "gpu": args.gpu,
        "smoke": args.smoke,
        "complete": False,
        "command": " ".join(sys.argv),
        "steps": args.steps,
        "budget_s": args.budget_s,
        "environment": None,  # at the end: reading the device's name here would start CUDA in this process
        "rows": [],
    }
    if not args.smoke:
        try:
            doc["estimate_s"] = estimate_s(cases, args.steps, args.probe)["total_s"]
        except KeyError as e:  # a recipe never timed on the H200: run it, within the budget's timeout
            doc["estimate_s"] = None
            print(f"[gpu_check] no time estimate: {e.args[0]}", flush=True)
    _run_cases(args, cases, doc, deadline, probe_reserve, json_path, md_path)
    doc["pairs"] = pair_ratios(doc["rows"])
    for p in doc["pairs"]:
        print(
            f"[gpu_check] NormFormer / Pre-LN at {p['size']} ({p['blocks']}): {p['ratio']:.3f}x", flush=True
        )
    if args.probe:
        doc["probe"] = _probe_within(deadline, args.smoke)
    doc["gpu"] = args.gpu or ("a100-80gb" if args.smoke else _detect_gpu(doc["rows"]))
    doc["environment"] = environment()
    if args.predict == "yes" or (args.predict == "auto" and args.smoke):
        with warm_sessions() as sessions:
            for row in doc["rows"]:
                if "overrides" in row:
                    row["prediction"] = predict(row, doc["gpu"], args.smoke, sessions)
    doc["complete"] = True
    doc["wall_s"] = time.monotonic() - start
    _write(doc, json_path, md_path)
    if not args.smoke:
        print(
            "predictions, afterwards on the CPU machine: .venv/bin/python bench/gpu_check.py "
            f"--repredict {json_path.name} (the JSON copied back; writes {json_path.stem}_predicted.json/.md)"
        )
    measured_all = all(_measured(r) for r in doc["rows"])
    return 0 if measured_all and (not args.probe or doc["probe"].get("ok")) else 1


def load_measured(path: str | os.PathLike) -> tuple[dict, Path]:
    """A gpu_check JSON (or a folder holding ``gpu_check.json``; or ``bench/gpu.py``'s list of rows)
    as a document with ``rows``, and the JSON's path.

    Raises:
        ValueError: no such file, or not such a JSON, naming the path and what it should be.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "gpu_check.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"--repredict {path}: {e} (give the gpu_check.json a GPU run wrote, whole, or its folder)"
        ) from e
    if isinstance(data, list):  # bench/gpu.py --out
        data = {"gpu": None, "smoke": False, "rows": data}
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"--repredict {path}: no 'rows' list; not a JSON that bench/gpu_check.py wrote")
    return data, path


def repredict(source: str, out: str | None, gpu: str | None) -> int:
    """Add the predictions to the rows of a run measured elsewhere; write ``<name>_predicted.json``
    and ``.md`` beside it (or at ``out``)."""
    doc, path = load_measured(source)
    doc["gpu"] = gpu or doc.get("gpu") or _detect_gpu(doc["rows"])
    with warm_sessions() as sessions:
        for row in doc["rows"]:
            if "overrides" in row and _measured(row):
                row["prediction"] = predict(row, doc["gpu"], False, sessions)
    doc.setdefault("pairs", pair_ratios(doc["rows"]))
    doc["predicted"] = {"on": environment(), "gpu": doc["gpu"]}
    stem = f"{path.stem}_predicted"
    json_path, md_path = (
        output_paths(out, stem) if out else (path.with_name(f"{stem}.json"), path.with_name(f"{stem}.md"))
    )
    _write(doc, json_path, md_path)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring); errors name the flag and the fix."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help=f"ZeRO/recompute cases, e.g. 1/none,0/full (default {DEFAULT_CASES})",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for bench/gpu.py")
    parser.add_argument("--profile", default=None, help="for bench/gpu.py: a folder for profiler tables")
    parser.add_argument(
        "--gpu", default=None, help="the GPU kind (default: detected; --predict-only: required)"
    )
    parser.add_argument("--smoke", action="store_true", help="the CPU path: a tiny model over gloo")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="seconds this command may take (default: no limit)"
    )
    parser.add_argument(
        "--no-probe", dest="probe", action="store_false", help="skip bench/gpu_probe.py (compiled vs eager)"
    )
    parser.add_argument(
        "--predict",
        choices=["auto", "yes", "no"],
        default="auto",
        help="predictions beside the rows now (auto: under --smoke only; a GPU run: --repredict later)",
    )
    parser.add_argument("--estimate", action="store_true", help="print the case list's estimated H200 time")
    parser.add_argument("--predict-only", action="store_true", help="write dry-run predictions (CPU machine)")
    parser.add_argument(
        "--repredict",
        metavar="JSON_OR_DIR",
        help="a gpu_check JSON measured elsewhere (or its folder): add the predictions here (planner, "
        "step-time model, dry run) and write <name>_predicted.json/.md beside it or at --out",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="a folder (gets gpu_check.json/.md) or a .json path (default bench/results/gpu_check.json; "
        "with --repredict: beside the input)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1 timed step")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(
            f"--budget-s {args.budget_s}: the time left is used up; give a positive number of seconds"
        )
    from bench.gpu import parse_cases

    try:
        parse_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))
    for size in args.sizes.split(","):
        if not (REPO / "configs" / "paper" / f"{size}-normformer.yaml").exists():
            parser.error(
                f"--sizes: no configs/paper/{size}-normformer.yaml; sizes are 125m, 355m, 1.3b, 2.7b"
            )
    if args.predict_only and not args.gpu:
        parser.error("--predict-only needs --gpu (e.g. h100-80gb)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.gpu import _cases, case_rows, parse_cases

    if args.estimate:
        cases = _cases(args.sizes.split(","), False, parse_cases(args.cases), pairs=True)
        try:
            est = estimate_s(cases, args.steps, args.probe)
        except KeyError as e:
            print(f"error: {e.args[0]}", file=sys.stderr)
            return 2
        for name, seconds in est["cases"]:
            print(f"{name:40s} {seconds:6.0f} s")
        print(
            f"{'probe':40s} {est['probe_s']:6.0f} s\n{'setup (wheels, imports)':40s} {est['setup_s']:6.0f} s"
        )
        print(f"{'total on one H200 (estimate)':40s} {est['total_s']:6.0f} s = {est['total_s'] / 60:.1f} min")
        return 0
    if args.repredict:
        try:
            return repredict(args.repredict, args.out, args.gpu)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.predict_only:
        rows = case_rows(args.sizes.split(","), args.gpu, parse_cases(args.cases), pairs=True)
        saved = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
        with warm_sessions() as sessions:
            for row in rows:
                p = predict(row, args.gpu, smoke=False, sessions=sessions)
                saved[case_key(row, args.gpu)] = p["dryrun"]
                print(f"{row['recipe']} {' '.join(row['overrides'])}: {p['dryrun']}", flush=True)
        PREDICTIONS.write_text(json.dumps(saved, indent=1))
        return 0
    try:
        json_path, md_path = output_paths(
            args.out or REPO / "bench" / "results" / "gpu_check.json",
            "gpu_check_smoke" if args.smoke else "gpu_check",
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return measure(args, json_path, md_path)


if __name__ == "__main__":
    sys.exit(main())
