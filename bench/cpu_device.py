"""This CPU as a device for the step-time model: matmul peak, copy bandwidth and attention rate, measured.

    .venv/bin/python bench/cpu_device.py [--out bench/results/cpu_device.json] [--seconds 1.5] [--rounds 3]

For 1 and 2 torch threads (the quickstart runs 2 processes of 1 thread; ``bench/norm_overhead.py``
one process of 2): ``torch.matmul`` float32 GFLOP/s at large sizes (2048² and 3072² squares and
the 125M block's fc1, 2048 × 768 × 3072; best of repeated runs, ``2·m·k·n`` FLOPs each; the peak is
the best of them), a stream-like copy bandwidth (``dst.copy_(src)`` of 64 Mi
float32 elements, 256 MiB each way: bytes read + written per second, best of repeats) and the rate
of the CPU's causal SDPA kernel, forward + backward at the 125M recipe's head shape (1 × 12 heads ×
2048 × 64, fp32, no dropout), in the model's attention-FLOP convention (``3 · 4·T²·d_head`` per
head, the causal mask not halved, as :mod:`megaformer.training.flops` counts), and the element rates
of ``torch.exp`` and ``F.gelu`` (16 Mi float32 elements), which on a CPU are compute-bound (the
loss's softmax and the FFN's GeLU run at these rates, not at memory speed); the rate of skinny
GEMMs (one dimension 64, 128 or 256) as a fraction of that round's large-GEMM rate; and the
parameters per second of ``torch.optim.AdamW``'s step (defaults: the per-tensor loop on CPU). The
step-time model (:mod:`megaformer.perf.steptime`, ``cpu_device``) reads this JSON. Not a test.

The rates of exp, GeLU and AdamW above are of tensors of 16 Mi elements (64 MiB): above glibc
malloc's largest mmap threshold (32 MiB), so every fresh output is new pages, zero-filled by the
kernel on first touch, and ``F.gelu`` or AdamW's temporaries run far below the copy bandwidth. The
125M model's activations (2048 × 768 or 3072 fp32, 6-24 MiB) and weights are below it; measured at
those shapes (added 2026-11-25, issue 19, after a torch.profiler split of a 125M step; first
measured that day on this 2-core AMD EPYC VM, torch 2.13.0+cpu):

- ``block_gemm_gflops``: the 125M block's four linear layers (2048 tokens; 768 → 2304, 768 → 768,
  768 → 3072, 3072 → 768), forward + backward through autograd (``3 · 2·m·k·n`` FLOPs each), the
  rate of GEMMs as a model runs them (transposed operands, weight gradients);
- ``layernorm_gelems``: ``F.layer_norm`` forward + backward (input, weight and bias gradients) on
  2048 × 3072 (the FFN LayerNorm), input elements per second: compute-bound, not at copy speed;
- ``gelu_fwd_bwd_gelems``: ``F.gelu`` forward + ``gelu_backward`` on 2048 × 3072 (the fc1 output),
  elements per second;
- ``cross_entropy_glogits``: megaformer's ``vocab_parallel_cross_entropy`` (no TP group, in place,
  as the model calls it) forward + backward on 2048 × 51,200 fp32 logits, logits per second;
- ``adamw_block_gparams``: ``torch.optim.AdamW``'s step on 8 tensors of 768 × 3072 (below the mmap
  threshold), parameters per second.

Each round starts when other processes use under 5 % of the CPU for 1 s (waiting at most 60 s),
each measurement likewise (at most 20 s; the machine is shared); the others' share before each round
and the load average before and after are recorded.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402

SHAPES = ((2048, 2048, 2048), (3072, 3072, 3072), (2048, 768, 3072))
"""Square GEMMs and the 125M block's fc1 (2048 tokens × 768 × 3072)."""


def _best(fn, seconds: float, min_runs: int = 3) -> float:
    """Shortest wall time of ``fn()`` over at least ``min_runs`` runs and ``seconds`` (one warm-up)."""
    fn()
    best, runs, deadline = float("inf"), 0, time.perf_counter() + seconds
    while runs < min_runs or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def matmul_gflops(m: int, k: int, n: int, seconds: float) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / _best(lambda: torch.matmul(a, b), seconds) / 1e9


def copy_gbs(elements: int, seconds: float) -> float:
    src, dst = torch.randn(elements), torch.empty(elements)
    return 2 * 4 * elements / _best(lambda: dst.copy_(src), seconds) / 1e9


THIN = (64, 128, 256)
"""The thin dimension of the skinny GEMMs measured: each placed as m, k and n in turn, the other two
2048 and 8192 (a model's small width or micro-batch against a large one)."""


def thin_gemm_fractions(peak: float, seconds: float) -> dict[str, float]:
    """Per thin dimension, the mean over its three placements of the GEMM rate as a fraction of ``peak``."""
    out = {}
    for t in THIN:
        shapes = ((t, 2048, 8192), (2048, t, 8192), (2048, 8192, t))
        out[str(t)] = sum(matmul_gflops(m, k, n, seconds) for m, k, n in shapes) / 3 / peak
    return out


def adamw_gparams(seconds: float, params: int = 16 * 2**20) -> float:
    """Parameters per second (1e9) of ``torch.optim.AdamW``'s step with its defaults (one tensor)."""
    w = torch.nn.Parameter(torch.randn(params))
    w.grad = torch.randn(params)
    opt = torch.optim.AdamW([w], lr=1e-4)
    return params / _best(opt.step, seconds) / 1e9


def elementwise_gelems(fn, seconds: float, elements: int = 16 * 2**20) -> float:
    """Elements per second (1e9) of ``fn`` on a float32 tensor (exp, GeLU: compute-bound on a CPU)."""
    x = torch.randn(elements)
    return elements / _best(lambda: fn(x), seconds) / 1e9


BLOCK_LINEARS = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
"""(in, out) features of the 125M block's linear layers: qkv, attention output, fc1, fc2."""


def block_gemm_gflops(seconds: float, tokens: int = 2048) -> float:
    """GFLOP/s of the 125M block's linear layers, forward + backward through autograd."""
    layers = [torch.nn.Linear(i, o) for i, o in BLOCK_LINEARS]
    xs = [torch.randn(tokens, i, requires_grad=True) for i, _ in BLOCK_LINEARS]
    gs = [torch.randn(tokens, o) for _, o in BLOCK_LINEARS]

    def run() -> None:
        for layer, x, g in zip(layers, xs, gs):
            layer(x).backward(g)

    return sum(3 * 2 * tokens * i * o for i, o in BLOCK_LINEARS) / _best(run, seconds) / 1e9


def layernorm_gelems(seconds: float, tokens: int = 2048, width: int = 3072) -> float:
    """Input elements per second (1e9) of ``F.layer_norm`` forward + backward (all three gradients)."""
    ln = torch.nn.LayerNorm(width)
    x, g = torch.randn(tokens, width, requires_grad=True), torch.randn(tokens, width)
    return tokens * width / _best(lambda: ln(x).backward(g), seconds) / 1e9


def gelu_fwd_bwd_gelems(seconds: float, tokens: int = 2048, width: int = 3072) -> float:
    """Elements per second (1e9) of ``F.gelu`` forward + backward at the fc1 output's shape."""
    x, g = torch.randn(tokens, width, requires_grad=True), torch.randn(tokens, width)
    return tokens * width / _best(lambda: F.gelu(x).backward(g), seconds) / 1e9


def cross_entropy_glogits(seconds: float, tokens: int = 2048, vocab: int = 51200) -> float:
    """Logits per second (1e9) of the model's loss (in place, no TP group) forward + backward."""
    from megaformer.parallel.layers import vocab_parallel_cross_entropy

    logits = torch.randn(tokens, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))

    def run() -> None:
        buf = logits.detach().requires_grad_()  # the same storage every run, as a fresh GEMM output
        vocab_parallel_cross_entropy(buf, labels, None, vocab, inplace=True).mean().backward()

    return tokens * vocab / _best(run, seconds) / 1e9


def adamw_block_gparams(seconds: float, tensors: int = 8, shape: tuple[int, int] = (768, 3072)) -> float:
    """Parameters per second (1e9) of ``torch.optim.AdamW``'s step on block-sized weight tensors."""
    ws = [torch.nn.Parameter(torch.randn(*shape)) for _ in range(tensors)]
    for w in ws:
        w.grad = torch.randn(*shape)
    opt = torch.optim.AdamW(ws, lr=1e-4)
    return tensors * shape[0] * shape[1] / _best(opt.step, seconds) / 1e9


def others_cpu_share(dt: float = 1.0) -> float:
    """Share of all CPUs' time that other processes used over ``dt`` seconds (``/proc/stat``)."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), sum(v) - v[3] - v[4]

    (a0, b0), c0 = ticks(), time.process_time()
    time.sleep(dt)
    (a1, b1), own = ticks(), time.process_time() - c0
    hz = os.sysconf("SC_CLK_TCK")
    return max(0.0, (b1 - b0) / hz - own) / max(1e-9, (a1 - a0) / hz)


def wait_quiet(limit: float = 0.05, max_wait_s: float = 60.0) -> float:
    """Waits until other processes use under ``limit`` of the CPU for 1 s; returns the last share."""
    deadline, share = time.monotonic() + max_wait_s, 1.0
    while time.monotonic() < deadline and (share := others_cpu_share()) >= limit:
        pass
    return share


def attention_gflops(seconds: float, heads: int = 12, t: int = 2048, hd: int = 64) -> float:
    q, k, v = (torch.randn(1, heads, t, hd, requires_grad=True) for _ in range(3))
    g = torch.randn(1, heads, t, hd)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(g)

    return 3 * 4 * t * t * hd * heads / _best(run, seconds) / 1e9


def _row(seconds: float) -> dict:
    """One round's figures at the current thread count (each after a wait for a quiet CPU)."""
    measures = {
        "matmul_gflops": lambda: {f"{m}x{k}x{n}": matmul_gflops(m, k, n, seconds) for m, k, n in SHAPES},
        "copy_gbs": lambda: copy_gbs(64 * 2**20, seconds),
        "attention_gflops": lambda: attention_gflops(seconds),
        "exp_gelems": lambda: elementwise_gelems(torch.exp, seconds),
        "gelu_gelems": lambda: elementwise_gelems(F.gelu, seconds),
        "adamw_gparams": lambda: adamw_gparams(seconds),
        "block_gemm_gflops": lambda: block_gemm_gflops(seconds),
        "layernorm_gelems": lambda: layernorm_gelems(seconds),
        "gelu_fwd_bwd_gelems": lambda: gelu_fwd_bwd_gelems(seconds),
        "cross_entropy_glogits": lambda: cross_entropy_glogits(seconds),
        "adamw_block_gparams": lambda: adamw_block_gparams(seconds),
    }
    row = {}
    for key, fn in measures.items():
        wait_quiet(max_wait_s=20.0)
        row[key] = fn()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cpu_device.json"))
    parser.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="each figure is the best of the rounds")
    args = parser.parse_args()
    result = {
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "load_average_before": os.getloadavg(),
        "threads": {},
        "others_cpu_share_before_rounds": [],
    }
    for round_ in range(args.rounds):  # best of rounds: the machine is shared, peaks are what we want
        for threads in (2, 1):  # 2 first: some BLAS builds do not grow their pool again after 1
            torch.set_num_threads(threads)
            quiet = wait_quiet()
            row = _row(args.seconds)
            result["others_cpu_share_before_rounds"].append(quiet)
            row["thin_gemm_fraction"] = thin_gemm_fractions(max(row["matmul_gflops"].values()), args.seconds)
            print(f"round {round_}, {threads} thread(s): {row}", flush=True)
            best = result["threads"].setdefault(str(threads), {})
            for key, value in row.items():
                if isinstance(value, dict):
                    inner = best.setdefault(key, {})
                    for k, x in value.items():
                        inner[k] = max(inner.get(k, 0.0), x)
                else:
                    best[key] = max(best.get(key, 0.0), value)
            best["peak_matmul_gflops"] = max(best["matmul_gflops"].values())
    result["load_average_after"] = os.getloadavg()
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
