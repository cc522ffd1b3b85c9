"""Which fused kernel should attention with dropout run on this GPU (``model.attention_backend``)?

    python3 bench/attention_backends.py [--json OUT.json]     # on a lent GPU
    .venv/bin/python bench/attention_backends.py --smoke     # this script on a CPU (sdpa only)

Times the forward and, on one retained graph, the backward (CUDA events, median of ``--repeats``
after warm-up) of causal attention at the recipes' shapes, micro-batch × heads × 2,048 tokens:
head dim 64 (125M, 355M, 1.3B: 12 / 16 / 32 heads) and 80 (2.7B: 32 heads), bf16 and fp16, for each kernel
with dropout 0.1 through :func:`megaformer.parallel.rng_ops.fused_attention_dropout` (what a compiled
block runs), the ``sdpa`` operator that reruns the forward in backward
(:func:`~megaformer.parallel.rng_ops.attention_dropout`, the code before the switch), and each kernel
without dropout (SDPA pinned to it). Prints TFLOP/s (4·B·H·T²·D forward, twice that backward, halved
for the causal mask, as FlashAttention-2 counts) and each dropout row's share of the same kernel's
no-dropout speed (issue 36's goal: ≥ 80 %, forward and backward). Not run on a GPU yet (written
2026-12-01, no GPU lent to that session).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaformer.parallel import rng_ops
from megaformer.parallel.rng import DropoutRNG

SHAPES = [(8, 12, 2048, 64), (8, 32, 2048, 64), (4, 32, 2048, 80)]  # (B, heads, T, head dim)


def _time(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall-clock on a CPU), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _variants(smoke: bool):
    """``(name, kernel, p)``: what each row runs."""
    if smoke:
        return [("sdpa p=0.1 (rerun)", "sdpa", 0.1), ("sdpa p=0", "sdpa", 0.0)]
    rows = [("sdpa p=0.1 (rerun)", "sdpa", 0.1)]
    for kernel in rng_ops.FUSED_BACKENDS:
        rows += [(f"{kernel} p=0.1", kernel, 0.1), (f"{kernel} p=0", kernel, 0.0)]
    return rows


def measure(shape, dtype, kernel: str, p: float, repeats: int, device: str) -> dict:
    """Forward and backward seconds of one row; ``error`` where the kernel cannot run the case."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype, generator=g)
    state = DropoutRNG(1, device=device).state_dict()["sharded"]
    if kernel == "sdpa" and p > 0:

        def forward():
            return rng_ops.attention_dropout(q, k, v, p, True, state)[0]
    elif p > 0:

        def forward():
            return rng_ops.fused_attention_dropout(q, k, v, p, True, kernel, state)[0]
    else:
        pinned = [rng_ops.SDP_BACKENDS[kernel]] if kernel in rng_ops.SDP_BACKENDS else None

        def forward():
            if pinned is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(pinned):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cuda = device == "cuda"
    try:
        fwd = _time(lambda: forward().detach(), repeats, cuda)
        out = forward()  # one graph, its backward timed alone (retained between repeats)
        bwd = _time(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), repeats, cuda)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0][:200]}
    b, h, t, d = shape
    flops = 0.5 * 4 * b * h * t * t * d  # causal
    return {"forward_s": fwd, "backward_s": bwd, "forward_tflops": flops / fwd / 1e12,
            "backward_tflops": 2 * flops / bwd / 1e12}  # fmt: skip


def _case_rows(shape, dtype, smoke: bool, repeats: int, device: str) -> list[dict]:
    """Every row of one shape and dtype, each dropout row with its share of the same kernel's speed
    without dropout (``sdpa``: SDPA's own choice without dropout)."""
    rows = []
    for name, kernel, p in _variants(smoke):
        r = measure(shape, dtype, kernel, p, repeats, device)
        r.update(shape=list(shape), dtype=str(dtype).removeprefix("torch."), row=name, kernel=kernel, p=p)
        rows.append(r)
    base = {r["kernel"]: r for r in rows if r["p"] == 0 and "error" not in r}
    for r in rows:
        ref = base.get(r["kernel"])
        if "error" not in r and r["p"] > 0 and ref is not None:
            r["forward_share"] = ref["forward_s"] / r["forward_s"]
            r["backward_share"] = ref["backward_s"] / r["backward_s"]
    return rows


def _line(r: dict) -> str:
    """One Markdown row."""
    head = f"| {'×'.join(map(str, r['shape']))} | {r['dtype']} | {r['row']} |"
    if "error" in r:
        return f"{head} {r['error']} | | | |"
    share = "– | –"
    if "forward_share" in r:
        share = f"{r['forward_share']:.0%} | {r['backward_share']:.0%}"
    return f"{head} {r['forward_tflops']:.2f} | {r['backward_tflops']:.2f} | {share} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on this CPU, sdpa only")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    shapes = [(1, 2, 64, 16)] if args.smoke else SHAPES
    dtypes = [torch.float32] if args.smoke else [torch.bfloat16, torch.float16]
    rows = []
    print("| shape B×H×T×D | dtype | row | fwd TFLOP/s | bwd TFLOP/s | fwd / no-dropout | bwd / no-dropout |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        for dtype in dtypes:
            case = _case_rows(shape, dtype, args.smoke, 2 if args.smoke else args.repeats, device)
            rows += case
            for r in case:
                print(_line(r))
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": meta, "rows": rows}, indent=1))
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
