"""How fast are the Triton kernels of ``model.fused_kernels`` against what they replace, on this GPU?

    python3 bench/fused_kernels.py [--rows 65536] [--json OUT.json]      # on a lent GPU; seconds
    TRITON_INTERPRET=1 .venv/bin/python bench/fused_kernels.py --smoke   # this script on a CPU

Times, forward + backward, CUDA events, median of ``--repeats`` after warm-up, bf16:

* ``ffn``: NormFormer's FFN LayerNorm after GELU on ``[rows, 3072]`` (the 125M recipe: micro-batch
  32 x 2,048 tokens = 65,536 rows) -- eager (``F.layer_norm(F.gelu(u))``), inductor
  (``torch.compile`` of the same two operations, what a compiled block ran on the H200: ~0.9 ms per
  call in the profile), and ours (:func:`megaformer.model.kernels.layer_norm_activation`);
* ``post_attn``: ``x + dropout(LN(a))`` on ``[rows, 768]``, p = 0.1, the same three ways (ours:
  :func:`~megaformer.model.kernels.layer_norm_dropout_residual` with the keep mask given; the eager
  and inductor versions multiply by the same mask).

Beside each time: the bandwidth bound, the bytes the pass must move (forward: read u, write y;
backward: read u and dy, write du; plus the mask and the residual for ``post_attn``) over the
device's copy rate, measured here with ``torch.Tensor.copy_`` of a tensor of the same size. Not run
on a GPU yet (written 2026-11-28, no GPU lent to that session); prints one table and, with
``--json``, writes the figures.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaformer.model import kernels


def _time_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after 3 warm-up runs (CUDA events; the
    wall clock on a CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(fn, inputs, grad):
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad)

    return run


def _copy_gbps(n_bytes: int, repeats: int, device: str) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), repeats)
    return 2 * n_bytes / ms / 1e6  # read + write, GB/s


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="check this script on a CPU: 64 rows, interpreter")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args.rows, args.repeats, dev = 64, 1, "cpu"
        if not kernels.interpreted():
            print("--smoke needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("bench/fused_kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        dev = "cuda"
    dt, rows, p = torch.bfloat16, args.rows, 0.1
    gbps = _copy_gbps(rows * args.ffn * 2, args.repeats, dev)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter: figures mean nothing)"
    results = {"device": name, "rows": rows, "copy_gbps": gbps, "cases": []}

    def compiled(fn):
        return torch.compile(fn) if dev == "cuda" else fn  # the smoke run checks the script, not inductor

    def case(name, width, fns, inputs, grad, bytes_moved):
        bound_ms = bytes_moved / gbps / 1e6
        row = {"case": name, "width": width, "bandwidth_bound_ms": bound_ms}
        for label, fn in fns.items():
            row[f"{label}_ms"] = _time_ms(_fwd_bwd(fn, inputs, grad), args.repeats)
        results["cases"].append(row)

    n = args.ffn
    u = torch.randn(rows, n, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(n, device=dev, dtype=dt, requires_grad=True)
    b = torch.zeros(n, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(rows, n, device=dev, dtype=dt)

    def ffn_eager(u, w, b):
        return F.layer_norm(F.gelu(u), (n,), w, b, 1e-5)

    def ffn_ours(u, w, b):
        return kernels.layer_norm_activation(
            u, w, b, activation="gelu", normalized_size=n, eps=1e-5, tp_group=None
        )

    # forward: read u, write y; backward: read u, dy, write du (2 bytes each)
    case(
        "ffn",
        n,
        {"eager": ffn_eager, "inductor": compiled(ffn_eager), "ours": ffn_ours},
        (u, w, b),
        dy,
        5 * rows * n * 2,
    )

    d = args.hidden
    a, x = (torch.randn(rows, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    wd = torch.ones(d, device=dev, dtype=dt, requires_grad=True)
    bd = torch.zeros(d, device=dev, dtype=dt, requires_grad=True)
    dh = torch.randn(rows, d, device=dev, dtype=dt)
    keep = torch.rand(rows, d, device=dev) >= p
    scale = 1.0 / (1.0 - p)

    def post_eager(a, x, w, b):
        return x + F.layer_norm(a, (d,), w, b, 1e-5) * keep * scale

    def post_ours(a, x, w, b):
        return kernels.layer_norm_dropout_residual(a, x, w, b, keep=keep, scale=scale, eps=1e-5)

    # forward: read a, x, keep (1 byte), write h; backward: read dh, a, keep, write da
    case(
        "post_attn",
        d,
        {"eager": post_eager, "inductor": compiled(post_eager), "ours": post_ours},
        (a, x, wd, bd),
        dh,
        rows * d * (2 + 2 + 1 + 2 + 2 + 2 + 1 + 2),
    )

    _report(results, gbps, rows, args.json)
    return 0


def _report(results: dict, gbps: float, rows: int, path: Path | None) -> None:
    """Print the table of ``results`` and write its JSON to ``path`` (when given)."""
    print(f"{results['device']}: copy rate {gbps:,.0f} GB/s; forward + backward, bf16, {rows:,} rows")
    print("| case | width | eager ms | inductor ms | ours ms | bandwidth bound ms |")
    print("|---|---|---|---|---|---|")
    for r in results["cases"]:
        print(
            f"| {r['case']} | {r['width']} | {r['eager_ms']:.3f} | {r['inductor_ms']:.3f} "
            f"| {r['ours_ms']:.3f} | {r['bandwidth_bound_ms']:.3f} |"
        )
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"written: {path}")


if __name__ == "__main__":
    sys.exit(main())
