"""The compiled decoder block (``train.compile``) against the eager one on this machine, ratios in one run.

    .venv/bin/python bench/compile.py [--seq-len 2048] [--rounds 8] [--warmup-rounds 2]
        [--out bench/results/compile.json]

One :class:`megaformer.model.NormFormerBlock` of the paper's 125M shape (``configs/paper/125m-*.yaml``:
d 768, 12 heads, FFN 3072, GELU), fp32, one sequence of ``--seq-len`` tokens (micro-batch 1), one
process, ``torch.set_num_threads(2)``. Timed: forward + backward of the block (``y = block(x)``,
``y.backward(g)``, the gradients of x and of the block's parameters), not the optimizer. Rows: Pre-LN
(the baseline recipe's block) and NormFormer (the NormFormer recipe's: post-attention LN, HeadScale,
FFN LN, ResScale), each with dropout off and with the recipes' dropout (hidden and attention 0.1),
each eager and compiled (:func:`megaformer.model.compile_blocks`: ``torch.compile(fullgraph=True)``,
inductor's C++ backend on CPU).

Every variant is built once; its first call (which compiles) is timed separately. Then the steps
are interleaved: every round runs one step of each variant, the order rotated by one each round,
so that the machine's drift (other processes on shared cores) hits all alike; the first
``--warmup-rounds`` rounds are discarded. Reported per variant: the minimum and median step times;
per row, compiled against eager as the ratio of minima, of medians and the median of the
per-round ratios (each compiled step against the eager step of the same round); and NormFormer
against Pre-LN, eager and compiled. On shared cores the minimum is the figure other processes
disturb least (they only add time). Then (``--ln-rounds``) the FFN LayerNorm's statistics path
alone, forward: before issue 19, eager now, compiled, and ``F.layer_norm``; and
(``--ln-precision-tp``) its error against an fp64 LayerNorm at TP 2 and 4 on gloo, eager and
compiled. Prints tables and writes JSON (with the load average before and after). Not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402
from megaformer.config.load import load_config  # noqa: E402
from megaformer.model import compile_blocks  # noqa: E402
from megaformer.model.normformer import NormFormerBlock  # noqa: E402
from megaformer.parallel.rng import DropoutRNG  # noqa: E402

THREADS = 2
RECIPES = {  # row: the paper recipe whose model section builds the block
    "pre_ln": os.path.join(REPO, "configs", "paper", "125m-baseline.yaml"),
    "normformer": os.path.join(REPO, "configs", "paper", "125m-normformer.yaml"),
}
DROPOUTS = (0.0, 0.1)


class Variant:
    """One block (a recipe, a dropout, eager or compiled), a fixed input and output gradient."""

    def __init__(self, row: str, dropout: float, compiled: bool, seq_len: int) -> None:
        self.row, self.dropout, self.compiled = row, dropout, compiled
        overrides = [f"model.seq_len={seq_len}", f"model.hidden_dropout={dropout}"]
        overrides.append(f"model.attention_dropout={dropout}")
        self.config = load_config(RECIPES[row], overrides).model
        self.block = NormFormerBlock(self.config, 0, seed=1, dropout_rng=DropoutRNG(5)).train()
        self.messages: list[str] = []
        if compiled:
            compile_blocks(self.block, log=self.messages.append)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(1, seq_len, self.config.hidden_size, generator=gen).requires_grad_()
        self.grad = torch.randn(1, seq_len, self.config.hidden_size, generator=gen)

    @property
    def name(self) -> str:
        return f"{self.row} p={self.dropout} {'compiled' if self.compiled else 'eager'}"

    def step(self) -> float:
        start = time.perf_counter()
        self.block(self.x).backward(self.grad)
        elapsed = time.perf_counter() - start
        self.x.grad = None
        self.block.zero_grad(set_to_none=True)
        return elapsed


def _two_pass_layer_norm(x, w, b, n: int, eps: float = 1e-5):
    """The FFN LayerNorm's forward as it was before issue 19 (at one rank): mean, then M2 of the
    centred values, then each operation of the normalisation on its own buffer."""
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean.unsqueeze(-1)).square().sum(-1) / n + eps)
    return (((xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)) * w + b).to(x.dtype)


def layer_norm_table(rounds: int, tokens: int = 8192, n: int = 1536) -> list[dict]:
    """The FFN LayerNorm's statistics path (``sharded_layer_norm``, the code TP > 1 runs, here at one
    rank, no collective): forward only, fp32 ``[tokens, n]`` (n = 1,536: the 125M FFN shard at
    TP = 2), before issue 19, eager now, compiled, and ``F.layer_norm``'s fused kernel; interleaved."""
    from megaformer.parallel.layers import sharded_layer_norm

    def current(x, w, b):
        return sharded_layer_norm(x, w, b, normalized_size=n, eps=1e-5, tp_group=None)

    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(tokens, n, generator=gen),
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
    )
    rows = {
        "two-pass (before issue 19)": lambda x, w, b: _two_pass_layer_norm(x, w, b, n),
        "var_mean, eager (now)": current,
        "var_mean, compiled": torch.compile(current, fullgraph=True),
        "F.layer_norm (fused, no TP)": lambda x, w, b: torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.no_grad():
        for fn in rows.values():
            fn(x, w, b)  # warm-up (compiles)
        for _ in range(rounds):
            for name, fn in rows.items():
                start = time.perf_counter()
                fn(x, w, b)
                times[name].append(time.perf_counter() - start)
    return [
        {"name": k, "min_s": min(v), "median_s": statistics.median(v), "times_s": v} for k, v in times.items()
    ]


def _precision_worker(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank of :func:`layer_norm_precision`: writes rank 0's errors to ``out`` (JSON)."""
    import json
    from datetime import timedelta

    import torch.distributed as dist
    import torch.nn.functional as F

    from megaformer.parallel.layers import sharded_layer_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    group, n = dist.new_group(list(range(world))), 1024

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def local(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, rank * t.shape[dim] // world, t.shape[dim] // world)

    def outputs(fn, x, w, b, g) -> list[torch.Tensor]:
        ins = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = fn(*ins)
        (y * g).sum().backward()
        return [y.detach()] + [t.grad for t in ins]

    def eager(x, w, b):
        return sharded_layer_norm(x, w, b, normalized_size=n, eps=1e-5, tp_group=group)

    def torch_ln(x, w, b):
        return F.layer_norm(x, (n,), w, b, 1e-5)

    ours = {"eager": eager, "compiled": torch.compile(eager, fullgraph=True)}
    w, b = 1 + 0.5 * torch.randn(n, generator=gen(30)), torch.randn(n, generator=gen(31))
    g = torch.randn(4, 16, n, generator=gen(32))  # the inputs of test_tp_layers' precision check
    rows = []
    for mean in (1.0, 300.0, 3000.0):
        x = mean + torch.randn(4, 16, n, generator=gen(33))
        exact = outputs(torch_ln, x.double(), w.double(), b.double(), g.double())
        row = {"tp": world, "mean_over_std": mean}
        row["F.layer_norm"] = [
            float((o.double() - e).abs().max()) for o, e in zip(outputs(torch_ln, x, w, b, g), exact)
        ]
        for name, fn in ours.items():
            got = outputs(fn, local(x, -1), local(w, 0), local(b, 0), local(g, -1))
            errs = [local(e, d) - o.double() for o, e, d in zip(got, exact, (-1, -1, 0, 0))]
            row[name] = [float(e.abs().max()) for e in errs]  # this rank's slice
        rows.append(row)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:  # the largest error over the ranks' slices
        for i, row in enumerate(rows):
            for name in ours:
                row[name] = [max(r[i][name][j] for r in gathered) for j in range(4)]
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def layer_norm_precision(tp_sizes: list[int]) -> list[dict]:
    """Max |error| of the FFN LayerNorm (y, dx, dgain, dshift) against ``F.layer_norm`` in fp64 at
    TP = ``tp_sizes`` on gloo, eager and compiled, with ``F.layer_norm``'s own fp32 error beside:
    the inputs of ``tests/distributed/test_tp_layers.py``'s precision check (rows of 1,024 values,
    std 1, ``|mean| / std`` = 1, 300, 3,000)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    for tp in tp_sizes:
        with socket.socket() as sock, tempfile.TemporaryDirectory() as tmp:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            out = os.path.join(tmp, "rows.json")
            mp.spawn(_precision_worker, args=(tp, port, out), nprocs=tp, join=True)
            with open(out) as f:
                rows += json.load(f)
    return rows


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "cpu"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (one step of every variant each)")
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--ln-rounds", type=int, default=20, help="rounds of the LayerNorm table (0: skip)")
    parser.add_argument(
        "--ln-precision-tp",
        type=int,
        nargs="*",
        default=[2, 4],
        help="TP sizes of the fp64 check (none: skip)",
    )
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "compile.json"))
    return parser


def _timed_rounds(variants: list[Variant], rounds: int, warmup_rounds: int) -> list[list[float]]:
    """The interleaved rounds (order rotated by one each round), each printed; step times per
    variant per timed round."""
    n = len(variants)
    times: list[list[float]] = [[] for _ in range(n)]
    for r in range(warmup_rounds + rounds):
        got = {i: variants[i].step() for i in ((r + j) % n for j in range(n))}
        tag = "warm-up" if r < warmup_rounds else "round"
        print(f"{tag} {r}: " + "  ".join(f"{got[i]:.3f}s" for i in range(n)), flush=True)
        if r >= warmup_rounds:
            for i in range(n):
                times[i].append(got[i])
    return times


def _ratio(a: list[float], b: list[float]) -> dict:
    """``a`` against ``b``: the ratio of medians and the per-round ratios' median, min and max."""
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "ratio_of_minima": min(a) / min(b),
        "ratio_of_medians": statistics.median(a) / statistics.median(b),
        "per_round_median": statistics.median(per_round),
        "per_round_min": min(per_round),
        "per_round_max": max(per_round),
    }


def _results(variants: list[Variant], times: list[list[float]], first_call_s: list[float]) -> dict:
    by_key = {(v.row, v.dropout, v.compiled): i for i, v in enumerate(variants)}
    out = {"variants": [], "compiled_vs_eager": [], "normformer_vs_pre_ln": []}
    for i, v in enumerate(variants):
        out["variants"].append(
            {
                "name": v.name,
                "row": v.row,
                "dropout": v.dropout,
                "compiled": v.compiled,
                "first_call_s": first_call_s[i],
                "step_times_s": times[i],
                "median_step_s": statistics.median(times[i]),
                "min_step_s": min(times[i]),
                "compile_log": v.messages,
            }
        )
    for row in RECIPES:
        for p in DROPOUTS:
            eager, comp = times[by_key[(row, p, False)]], times[by_key[(row, p, True)]]
            ratio = _ratio(eager, comp)  # > 1: the compiled block is faster
            out["compiled_vs_eager"].append({"row": row, "dropout": p, "speedup": ratio})
    for p in DROPOUTS:
        for compiled in (False, True):
            nf, pre = times[by_key[("normformer", p, compiled)]], times[by_key[("pre_ln", p, compiled)]]
            entry = {"dropout": p, "compiled": compiled, "overhead": _ratio(nf, pre)}
            out["normformer_vs_pre_ln"].append(entry)
    return out


def _print_tables(args: argparse.Namespace, results: dict) -> None:
    print(
        f"\n125M block (d 768, 12 heads, FFN 3072), seq_len {args.seq_len}, micro-batch 1, fp32, "
        f"{THREADS} threads, forward + backward, {args.rounds} timed rounds ({args.warmup_rounds} warm-up)"
    )
    print(f"{'variant':<32} {'first call':>10} {'min step':>9} {'median step':>11}")
    for v in results["variants"]:
        steps = f"{v['min_step_s']:>8.3f}s {v['median_step_s']:>10.3f}s"
        print(f"{v['name']:<32} {v['first_call_s']:>9.1f}s {steps}")
    header = f"{'of minima':>9} {'of medians':>10} {'per round: median (min–max)':>30}"
    print(f"\n{'compiled vs eager (speed-up)':<32} {header}")
    for e in results["compiled_vs_eager"]:
        print(f"{e['row'] + ' p=' + str(e['dropout']):<32} {_ratio_cells(e['speedup'])}")
    print(f"\n{'NormFormer vs Pre-LN (step time)':<32} {header}")
    for e in results["normformer_vs_pre_ln"]:
        name = f"p={e['dropout']} {'compiled' if e['compiled'] else 'eager'}"
        print(f"{name:<32} {_ratio_cells(e['overhead'])}")


def _ratio_cells(s: dict) -> str:
    spread = f"{s['per_round_median']:.3f} ({s['per_round_min']:.3f}–{s['per_round_max']:.3f})"
    return f"{s['ratio_of_minima']:>8.3f}× {s['ratio_of_medians']:>9.3f}× {spread:>30}"


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(THREADS)
    wall0 = time.perf_counter()
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    variants = [Variant(r, p, c, args.seq_len) for r in RECIPES for p in DROPOUTS for c in (False, True)]
    first_call_s = []
    for v in variants:  # the compiled variants compile here
        first_call_s.append(v.step())
        print(f"first call {v.name}: {first_call_s[-1]:.1f}s {' '.join(v.messages)}", flush=True)
    times = _timed_rounds(variants, args.rounds, args.warmup_rounds)
    results = _results(variants, times, first_call_s)
    _print_tables(args, results)
    ln_rows = layer_norm_table(args.ln_rounds) if args.ln_rounds else []
    if ln_rows:
        print("\nFFN LayerNorm, statistics path, forward, fp32 [8192, 1536]   min      median")
        for row in ln_rows:
            print(f"{row['name']:<60} {row['min_s'] * 1e3:>6.1f} ms {row['median_s'] * 1e3:>6.1f} ms")
    precision = layer_norm_precision(args.ln_precision_tp) if args.ln_precision_tp else []
    if precision:
        print("\nFFN LayerNorm against fp64, max |error| of y / dx / dgain / dshift")
        for row in precision:
            cells = "  ".join(
                f"{name} " + "/".join(f"{e:.1e}" for e in row[name])
                for name in ("F.layer_norm", "eager", "compiled")
            )
            print(f"TP {row['tp']} mean/std {row['mean_over_std']:>6.0f}: {cells}")
    load_after = os.getloadavg()
    result = {
        "started_utc": started,
        "machine": {
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "setup": {
            "recipes": {row: os.path.relpath(path, REPO) for row, path in RECIPES.items()},
            "seq_len": args.seq_len,
            "micro_batch": 1,
            "precision": "fp32",
            "timed": "one block: forward + backward (input and parameter gradients)",
            "compile": "megaformer.model.compile_blocks: torch.compile(fullgraph=True), inductor (C++)",
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "order": "round-robin, rotated by one each round",
        },
        **results,
        "ffn_layer_norm_forward": ln_rows,
        "ffn_layer_norm_precision_vs_fp64": precision,
        "wall_s": time.perf_counter() - wall0,
    }
    atomic_write_json(args.out, result)
    print(f"\nload average before {load_before}, after {load_after}; wall {result['wall_s']:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
