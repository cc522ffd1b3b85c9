"""One-GPU training throughput of the paper's recipes: tokens/s, TFLOP/s, MFU and peak memory.

    .venv/bin/python bench/gpu.py [--sizes 125m,355m,1.3b] [--steps 10] [--out bench/results/gpu.json]

For each recipe (``configs/paper/{size}-normformer.yaml``, and the 125M baseline for NormFormer's
overhead over Pre-LN), bf16, one process on one GPU (NCCL), the cases ZeRO 0 / 1 × recompute
none / selective / full, each in a fresh process (so its peak memory is its own): the model,
optimizer and DeepSpeed engine are built by the trainer's own builders
(:mod:`megaformer.training.builders`, :func:`megaformer.training.ds_adapter.initialize`), the
batches are random tokens already on the device (the loader is not measured), dropout as in the
recipe. After 3 warm-up steps (1 with ``--smoke``, whose figures mean nothing), ``--steps`` steps
are timed between two ``cuda.synchronize``;
micro-batch = the recipe's, or what the planner (:mod:`megaformer.perf.plan`) says fits, with 4
accumulation steps. MFU = model FLOPs (:func:`megaformer.training.flops.model_flops_per_token`,
recomputation not counted) per second over the GPU's datasheet bf16 peak. Cases that run out of
memory are reported as such. After the timed steps one more step runs under ``torch.profiler`` to
name the attention kernels that ran (:func:`attention_calls`: the SDPA backend, e.g. cuDNN or
flash, and how many attention forwards ran per step against the layers × micro-batches the step
needs); ``--pairs`` adds the Pre-LN baseline at every size (NormFormer / Pre-LN per size).

``--smoke`` runs a tiny model on the CPU (gloo, fp32) through the same code, to check the script
where no GPU is available; its figures mean nothing. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = [(zero, recompute) for zero in (0, 1) for recompute in ("none", "selective", "full")]
WARMUP_STEPS = 3
"""Untimed steps before the timed ones (compilation, allocator and cuDNN warm-up); bench/gpu_check.py's
time estimates repeat the figure (they run without importing this module)."""
SMOKE = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=256",
    "model.seq_len=128",
    "train.precision=fp32",
    "train.micro_batch_size=2",
]


def _micro_batch(cfg, smoke: bool, device=None) -> int:
    """The recipe's micro-batch if the planner says it fits this GPU (``device``: a planner
    ``Device``; default: the visible CUDA device), else the largest that does."""
    import dataclasses

    from megaformer.perf import plan as planner

    if smoke:
        return cfg.train.micro_batch_size
    if device is None:
        import torch

        props = torch.cuda.get_device_properties(0)
        device = planner.Device(props.name, props.total_memory / planner.GIB, 989.0)
    for micro in (cfg.train.micro_batch_size, 16, 8, 4, 2, 1):
        trial = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro, global_batch_size=4 * micro)
        )
        if planner.make_plan(trial, device, 1).fits:
            return micro
    return 1


def case_overrides(recipe: str, zero: int, recompute: str, smoke: bool, device=None) -> list[str]:
    """The overrides of one case: ZeRO stage, recompute, precision, and the micro-batch that fits
    (4 accumulation steps), applied to ``recipe`` (see the module docstring)."""
    from megaformer.config import load_config

    overrides = [
        f"train.zero_stage={zero}",
        f"train.recompute={recompute}",
        "train.activation_checkpointing=false",
    ]
    overrides += (
        SMOKE + ["train.deepspeed_config=configs/deepspeed/cpu-engine.json"]
        if smoke
        else ["train.precision=bf16"]
        # ZeRO-0: DeepSpeed 0.19 has no fp32 gradient accumulation of bf16 outside a ZeRO optimizer
        # (the paper JSON asks for it; config.check_engine_combination refuses it): no engine JSON.
        + (["train.deepspeed_config="] if zero == 0 else [])
    )
    micro = _micro_batch(load_config(recipe, overrides), smoke, device)
    return [*overrides, f"train.micro_batch_size={micro}", f"train.global_batch_size={4 * micro}"]


def case_rows(
    sizes: list[str], gpu: str, only: list[tuple[int, str]] | None = None, pairs: bool = False
) -> list[dict]:
    """The cases :func:`main` would run on a ``gpu`` (a planner device name), without running them:
    ``recipe``, ``zero``, ``recompute`` and ``overrides`` (for predictions made elsewhere)."""
    from megaformer.perf.plan import DEVICES

    rows = []
    for recipe, zero, recompute in _cases(sizes, smoke=False, only=only, pairs=pairs):
        overrides = case_overrides(recipe, zero, recompute, False, DEVICES[gpu])
        rows.append(
            {"recipe": Path(recipe).stem, "zero": zero, "recompute": recompute, "overrides": overrides}
        )
    return rows


def parse_cases(text: str | None) -> list[tuple[int, str]]:
    """``--cases`` ("1/none,0/full": ZeRO stage / recompute) as (zero, recompute) pairs; None: all.

    Raises:
        ValueError: a pair that is not one of :data:`CASES`, naming it and the choices.
    """
    if not text:
        return list(CASES)
    pairs = []
    for item in text.split(","):
        zero, _, recompute = item.strip().partition("/")
        if not zero.isdigit() or (int(zero), recompute) not in CASES:
            choices = ", ".join(f"{z}/{r}" for z, r in CASES)
            raise ValueError(f"--cases: {item!r} is not a ZeRO/recompute case; choose from {choices}")
        pairs.append((int(zero), recompute))
    return pairs


def _cases(
    sizes: list[str], smoke: bool, only: list[tuple[int, str]] | None = None, pairs: bool = False
) -> list[tuple[str, int, str]]:
    """(recipe path, ZeRO stage, recompute) to run, in order. NormFormer at every size and case (the
    first two cases under ``smoke``); the 125M Pre-LN baseline at ZeRO-1 without recompute for
    NormFormer's overhead, or with ``pairs`` the Pre-LN baseline right after every NormFormer case
    (each size's ratio measured back to back)."""
    chosen = only if only is not None else list(CASES)
    cases = []
    for size in sizes:
        for zero, recompute in chosen if not smoke else chosen[:2]:
            cases.append((f"configs/paper/{size}-normformer.yaml", zero, recompute))
            if pairs:
                cases.append((f"configs/paper/{size}-baseline.yaml", zero, recompute))
    if not pairs and "125m" in sizes:  # NormFormer's overhead over Pre-LN at 125M, ZeRO 1, no recompute
        cases.append(("configs/paper/125m-baseline.yaml", 1, "none"))
    return cases


# SDPA's backend entry points (ATen ops under F.scaled_dot_product_attention and the compiled
# attention-dropout operator) and the name this script gives each; their "_backward" ops are the
# backward passes. The composite aten::scaled_dot_product_attention itself is not a kernel.
ATTENTION_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
KERNEL_MARKS = ("sdpa", "flash", "fmha", "attention", "attn")  # device kernels of attention, by name


def attention_calls(train_step, sync, expected_forwards: int) -> dict:
    """One training step under ``torch.profiler``: which attention backend ran and how often.

    Returns ``backend`` (the SDPA forward backends seen, e.g. ``"cudnn"``; ``"+"``-joined if several),
    ``forward_calls`` (attention forwards in the step; under ``model.attention_backend=sdpa`` the
    compiled attention-dropout operator reruns the forward in backward, so 2 × ``expected_forwards``
    there; the fused operator runs it once), ``expected_forwards`` (layers ×
    micro-batches), ``ops`` (every SDPA ATen op and its calls) and ``kernels`` (the device kernels
    whose names mark attention, with calls; empty on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        train_step()
        sync()
    ops, kernels = {}, {}
    for event in prof.key_averages():
        name = event.key
        if name.startswith("aten::") and "scaled_dot_product" in name:
            ops[name] = event.count
        elif (
            not name.startswith("aten::")
            and any(m in name.lower() for m in KERNEL_MARKS)
            and getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        ):
            kernels[name[:120]] = event.count
    forwards = {op: n for op, n in ops.items() if op in ATTENTION_OPS}
    return {
        "backend": "+".join(sorted({ATTENTION_OPS[op] for op in forwards})) or "none seen",
        "forward_calls": sum(forwards.values()),
        "expected_forwards": expected_forwards,
        "ops": ops,
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6]),
    }


def _build_case(recipe: str, overrides: list[str]) -> tuple:
    """``(cfg, layout, model, engine)`` of one case, built as the trainer builds them (one rank)."""
    from megaformer.config import load_config
    from megaformer.parallel.rng import DropoutRNG
    from megaformer.training.builders import build_layout, build_model, build_optimizer
    from megaformer.training.deepspeed_config import build_deepspeed_config
    from megaformer.training.ds_adapter import initialize

    cfg = load_config(recipe, overrides)
    layout = build_layout(cfg, 1)
    model = build_model(cfg, layout, DropoutRNG(cfg.train.seed, device=layout.device))
    optimizer, scheduler = build_optimizer(model, cfg, 0)
    engine = initialize(
        model, optimizer, scheduler, build_deepspeed_config(cfg, 1), layout.state, pipelined=False
    )
    return cfg, layout, model, engine


def _rates(m, tokens_per_s: float, layout) -> tuple[float, str, float | None]:
    """``(TFLOP/s, device name, its peak TFLOP/s or None)`` of a case's measured throughput."""
    import torch

    from megaformer.training.flops import PEAK_TFLOPS, model_flops_per_token

    tflops = model_flops_per_token(m, m.padded_vocab_size(1)) * tokens_per_s / 1e12
    name = torch.cuda.get_device_name(0) if layout.device.type == "cuda" else "cpu"
    return tflops, name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def run_case(
    recipe: str,
    zero: int,
    recompute: str,
    steps: int,
    smoke: bool,
    extra: list[str] | None = None,
    profile: str | None = None,
    attention: bool = True,
) -> dict:
    """Train ``steps`` timed steps of one case in this process; returns its figures. ``extra``:
    overrides after the case's own (e.g. ``train.compile=false``); ``profile``: a folder where two
    more steps, run under ``torch.profiler``, leave their kernel table (the 40 largest by device
    time, as text); ``attention``: one more step under the profiler names the attention kernels
    (:func:`attention_calls`). ``setup_s`` (imports done to the engine built) and ``warmup_s`` (the
    :data:`WARMUP_STEPS` warm-up steps, compilation included) are recorded for the time estimates of
    ``bench/gpu_check.py``."""
    t_setup = time.perf_counter()
    import torch

    overrides = case_overrides(recipe, zero, recompute, smoke) + list(extra or [])
    cfg, layout, model, engine = _build_case(recipe, overrides)
    micro = cfg.train.micro_batch_size
    m = cfg.model
    gen = torch.Generator(device=layout.device).manual_seed(0)

    def batches():
        while True:
            x = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), device=layout.device, generator=gen)
            yield x[:, :-1], x[:, 1:]

    it = batches()
    sync = torch.cuda.synchronize if layout.device.type == "cuda" else (lambda: None)
    t_warmup = time.perf_counter()
    for _ in range(1 if smoke else WARMUP_STEPS):  # the smoke checks the path, not the speed
        loss = engine.train_step(it)
    sync()
    warmup_s = time.perf_counter() - t_warmup
    if layout.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = engine.train_step(it)
    sync()
    step_s = (time.perf_counter() - t0) / steps
    peak_gib = torch.cuda.max_memory_allocated() / 1024**3 if layout.device.type == "cuda" else None
    calls = None
    if attention:
        micro_batches = cfg.train.global_batch_size // micro
        calls = attention_calls(lambda: engine.train_step(it), sync, m.num_layers * micro_batches)
    if profile:
        name = re.sub(r"[^A-Za-z0-9._-]", "-", "_".join([Path(recipe).stem, *(extra or [])]))
        _profile(engine, it, sync, Path(profile) / f"profile_{name}.txt")
    tokens_per_s = cfg.train.global_batch_size * m.seq_len / step_s
    tflops, name, peak = _rates(m, tokens_per_s, layout)
    return {
        "recipe": Path(recipe).stem,
        "zero": zero,
        "recompute": recompute,
        "overrides": overrides,
        "micro_batch": micro,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gib": peak_gib,
        "loss": float(loss),
        "device": name,
        # a block whose compiled call failed runs eager from then on (model/compile.py)
        "compiled_blocks": sum(
            getattr(b, "_compiled_call_impl", None) is not None
            for b in model.modules()
            if type(b).__name__ == "NormFormerBlock"
        ),
        "attention": calls,
        "setup_s": t_warmup - t_setup,
        "warmup_s": warmup_s,
    }


def _profile(engine, batches, sync, path: Path) -> None:
    """Two training steps under ``torch.profiler``; their operators' table (by device time) to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            engine.train_step(batches)
        sync()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def _spawn(
    recipe: str,
    zero: int,
    recompute: str,
    steps: int,
    smoke: bool,
    extra=(),
    profile=None,
    timeout_s: float | None = None,
) -> dict:
    """:func:`run_case` in a fresh process (its peak memory its own); the row it printed, with
    ``wall_s`` (the whole process, start to exit). A case still running after ``timeout_s`` is
    killed with everything it started (inductor's compile workers) and reported as an error."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env.setdefault("MASTER_PORT", "29533")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--case", recipe, str(zero), recompute, str(steps)] + (
        ["--smoke"] if smoke else []
    )
    cmd += [f"--set={item}" for item in extra] + ([f"--profile={profile}"] if profile else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    wall_s = time.perf_counter() - t0
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "wall_s": wall_s}
    if timed_out:
        error = f"timeout: stopped after {timeout_s:.0f} s (the time budget left for this case)"
    else:
        error = "OOM" if "out of memory" in stderr.lower() else stderr[-800:]
    return {
        "recipe": Path(recipe).stem,
        "zero": zero,
        "recompute": recompute,
        "error": error,
        "wall_s": wall_s,
    }


def _brief(row: dict) -> str:
    if "error" in row:
        return "error " + row["error"][-300:]
    mfu = "-" if row.get("mfu") is None else f"{row['mfu']:.1%}"
    peak = "" if row.get("peak_memory_gib") is None else f", peak {row['peak_memory_gib']:.1f} GiB"
    return f"{row['step_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}{peak}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="125m,355m,1.3b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu.json"))
    parser.add_argument(
        "--cases", default=None, help="ZeRO/recompute cases, e.g. 1/none,0/full (default: all six)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script only")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every case"
    )
    parser.add_argument("--profile", default=None, help="a folder for each case's profiler table")
    parser.add_argument(
        "--pairs", action="store_true", help="the Pre-LN baseline beside NormFormer at every size and case"
    )
    parser.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        recipe, zero, recompute, steps = args.case
        print(
            "RESULT "
            + json.dumps(
                run_case(recipe, int(zero), recompute, int(steps), args.smoke, args.set, args.profile)
            ),
            flush=True,
        )
        os._exit(0)  # skip gloo/NCCL teardown races at exit
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to measure (use --smoke to check the script on CPU)")
        return 1
    try:
        only = parse_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))
    cases = _cases(args.sizes.split(","), args.smoke, only, args.pairs)
    rows = []
    for n, (r, z, c) in enumerate(cases, 1):
        rows.append(_spawn(r, z, c, args.steps, args.smoke, args.set, args.profile))
        # written after every case, so a run stopped part-way keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"[gpu.py] {n}/{len(cases)} {Path(r).stem} ZeRO {z} {c}: {_brief(rows[-1])}", flush=True)
    print(f"{'recipe':18s} ZeRO recompute  micro  step s  tokens/s  TFLOP/s   MFU  peak GiB")
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:18s} {r['zero']:4d} {r['recompute']:9s}  {r['error'][:60]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(
            f"{r['recipe']:18s} {r['zero']:4d} {r['recompute']:9s} {r['micro_batch']:5d} {r['step_s']:7.3f} "
            f"{r['tokens_per_s']:9,.0f} {r['tflops']:8.1f} {mfu:>5s} {mem:>9s}"
        )
    ok = {(r["recipe"], r["zero"], r["recompute"]): r for r in rows if "error" not in r}
    nf, base = ok.get(("125m-normformer", 1, "none")), ok.get(("125m-baseline", 1, "none"))
    if nf and base:
        print(f"NormFormer / Pre-LN step time at 125M: {nf['step_s'] / base['step_s']:.3f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
