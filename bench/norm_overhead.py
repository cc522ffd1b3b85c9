"""NormFormer's step-time overhead over Pre-LN at the paper's 125M shape, as ratios measured in one run.

    .venv/bin/python bench/norm_overhead.py [--seq-len 2048] [--rounds 4] [--warmup-rounds 1]
        [--profile] [--out bench/results/norm_overhead.json]

The model is :class:`megaformer.model.NormFormerLM` built from ``configs/paper/125m-baseline.yaml``
(GPT-3 / the paper's 125M: 12 layers, d 768, 12 heads, FFN 3072, GPT-2 vocabulary padded to 51,200
rows, sinusoidal positions, tied embeddings) with the norm switches of each row below, dropout off
(the same work in every row; on CPU, attention dropout also takes SDPA off its fused kernel and
triples the step). One step is forward + backward + AdamW ``step`` + ``zero_grad`` on one sequence
of ``--seq-len`` tokens (micro-batch 1), fp32, one process, ``torch.set_num_threads(2)`` on CPU.

All six models (and their AdamW states) are built once and kept; the steps are interleaved:
every round runs one step of each model, the order rotated by one each round, so that whatever
else the machine does hits every row alike. The first ``--warmup-rounds`` rounds are discarded.
Reported per row: the median step time, its ratio to Pre-LN's median, and the min–max of the
per-round ratios (each row's step against Pre-LN's step in the same round); next to it the model
FLOPs per token (:func:`megaformer.training.flops.model_flops_per_token`) and their ratio, i.e.
the overhead the added LayerNorms and scales would cost if they ran at matmul speed.

``--profile`` then profiles one step of Pre-LN and one of NormFormer (after a warm-up step each)
with ``torch.profiler`` and splits the self CPU time into LayerNorm, matmul, attention and the rest,
and prints the top operators. Prints tables and writes JSON. Not a test.
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
from megaformer.model import NormFormerLM, param_groups  # noqa: E402
from megaformer.training.flops import model_flops_per_token  # noqa: E402

BASE_CONFIG = os.path.join(REPO, "configs", "paper", "125m-baseline.yaml")
THREADS = 2
OFF = ["model.post_attn_ln=false", "model.head_scale=false", "model.ffn_ln=false", "model.resid_scale=false"]
NF = ["model.post_attn_ln=true", "model.head_scale=true", "model.ffn_ln=true", "model.resid_scale=false"]
ROWS = [  # (name, overrides on top of the 125M baseline recipe)
    ("Pre-LN (baseline)", OFF),
    ("NormFormer (post_attn_ln + head_scale + ffn_ln)", NF),
    ("NormFormer + resid_scale", [*NF[:3], "model.resid_scale=true"]),
    ("NormFormer + qkv_ln", [*NF, "model.qkv_ln=true"]),
    ("Post-LN", [*OFF, "model.norm_scheme=post_ln"]),
    ("DeepNorm", [*OFF, "model.norm_scheme=deepnorm"]),
]
SHORT = ["pre_ln", "normformer", "normformer+resid_scale", "normformer+qkv_ln", "post_ln", "deepnorm"]


class Runner:
    """One model, its AdamW and a fixed batch; ``step()`` times one training step."""

    def __init__(self, overrides: list[str], seq_len: int, seed: int = 1) -> None:
        common = [f"model.seq_len={seq_len}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
        self.config = load_config(BASE_CONFIG, [*common, *overrides]).model
        self.model = NormFormerLM(self.config, seed=seed).train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, 0.01), lr=1e-4, betas=(0.9, 0.98))
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, self.config.vocab_size, (1, seq_len + 1), generator=gen)
        self.parameters = sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.model(self.tokens[:, :-1], self.tokens[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def labelled_step(self) -> None:
        """One step with its phases labelled for the profiler."""
        from torch.profiler import record_function

        with record_function("phase: forward"):
            loss = self.model(self.tokens[:, :-1], self.tokens[:, 1:])
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _category(name: str) -> str:
    if "layer_norm" in name:
        return "layernorm"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    return "other"


def profile_step(runner: Runner, top: int) -> dict:
    """Self CPU time of one step by category and the top operators (one warm-up step first)."""
    from torch.profiler import ProfilerActivity, profile

    runner.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.labelled_step()
    averages = prof.key_averages()
    phases = {
        e.key[len("phase: ") :]: e.cpu_time_total / 1e6 for e in averages if e.key.startswith("phase: ")
    }
    events = [e for e in averages if not e.key.startswith("phase: ")]
    total = sum(e.self_cpu_time_total for e in events)
    cats: dict[str, float] = {}
    for e in events:
        cats[_category(e.key)] = cats.get(_category(e.key), 0.0) + e.self_cpu_time_total
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "profiled_self_cpu_s": total / 1e6,
        "phase_cpu_s": phases,
        "self_cpu_s_by_category": {k: v / 1e6 for k, v in sorted(cats.items())},
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in ranked
        ],
        "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top),
    }


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
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (one step of every row each)")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also profile Pre-LN and NormFormer")
    parser.add_argument("--top", type=int, default=15, help="operators listed per profile")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "norm_overhead.json"))
    return parser


def _timed_rounds(runners: list[Runner], rounds: int, warmup_rounds: int) -> list[list[float]]:
    """Runs the interleaved rounds (order rotated by one each round), printing each; returns the step
    times per row, per timed round (warm-up rounds discarded)."""
    n = len(runners)
    times: list[list[float]] = [[] for _ in range(n)]  # per row, per timed round
    for r in range(warmup_rounds + rounds):
        order = [(r + i) % n for i in range(n)]
        got = {i: runners[i].step() for i in order}
        tag = "warm-up" if r < warmup_rounds else "round"
        print(f"{tag} {r}: " + "  ".join(f"{SHORT[i]} {got[i]:.2f}s" for i in range(n)), flush=True)
        if r >= warmup_rounds:
            for i in range(n):
                times[i].append(got[i])
    return times


def _rows(runners: list[Runner], times: list[list[float]], seq_len: int) -> list[dict]:
    """Per row: the step times, their median and ratios to Pre-LN's, and the model FLOPs per token."""
    base_flops = model_flops_per_token(runners[0].config)
    base_median = statistics.median(times[0])
    rows = []
    for i, (name, overrides) in enumerate(ROWS):
        per_round = [t / b for t, b in zip(times[i], times[0])]
        flops = model_flops_per_token(runners[i].config)
        median = statistics.median(times[i])
        rows.append(
            {
                "name": name,
                "key": SHORT[i],
                "overrides": overrides,
                "parameters": runners[i].parameters,
                "step_times_s": times[i],
                "median_step_s": median,
                "tokens_per_s": seq_len / median,
                "ratio_of_medians": median / base_median,
                "per_round_ratios": per_round,
                "per_round_ratio_median": statistics.median(per_round),
                "per_round_ratio_min": min(per_round),
                "per_round_ratio_max": max(per_round),
                "model_flops_per_token": flops,
                "flops_ratio": flops / base_flops,
            }
        )
    return rows


def _print_table(args: argparse.Namespace, rows: list[dict]) -> None:
    """Prints the setup line and the table of step times and FLOPs per row."""
    print(
        f"\n125M shape, seq_len {args.seq_len}, micro-batch 1, fp32, {THREADS} threads, "
        f"{args.rounds} timed rounds ({args.warmup_rounds} warm-up)"
    )
    print(
        f"{'row':<48} {'median step':>11} {'vs Pre-LN':>9} {'per-round min–max':>17} "
        f"{'GFLOP/tok':>9} {'FLOPs':>7}"
    )
    for row in rows:
        spread = f"{row['per_round_ratio_min']:.3f}–{row['per_round_ratio_max']:.3f}"
        print(
            f"{row['name']:<48} {row['median_step_s']:>10.2f}s {row['ratio_of_medians']:>8.3f}× "
            f"{spread:>17} {row['model_flops_per_token'] / 1e9:>9.4f} {row['flops_ratio']:>6.4f}×"
        )


def _profiles(runners: list[Runner], top: int) -> dict:
    """Profiles Pre-LN and NormFormer (one step each), printing each; returns the profiles by key."""
    profiles = {}
    for i in (0, 1):
        prof = profile_step(runners[i], top)
        print(f"\nprofile: {ROWS[i][0]} (self CPU time of one step, s)")
        print("  " + "  ".join(f"{k} {v:.2f}" for k, v in prof["self_cpu_s_by_category"].items()))
        print("  phases: " + "  ".join(f"{k} {v:.2f}" for k, v in prof["phase_cpu_s"].items()))
        print(prof.pop("table"))
        profiles[SHORT[i]] = prof
    return profiles


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(THREADS)
    wall0 = time.perf_counter()
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    runners = [Runner(overrides, args.seq_len) for _, overrides in ROWS]
    build_s = time.perf_counter() - wall0
    times = _timed_rounds(runners, args.rounds, args.warmup_rounds)
    load_after_steps = os.getloadavg()

    rows = _rows(runners, times, args.seq_len)
    _print_table(args, rows)

    profiles = _profiles(runners, args.top) if args.profile else {}
    load_after = os.getloadavg()

    result = {
        "started_utc": started,
        "machine": {
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "load_average_1_5_15": {
            "before": load_before,
            "after_timed_rounds": load_after_steps,
            "after": load_after,
        },
        "setup": {
            "base_config": os.path.relpath(BASE_CONFIG, REPO),
            "seq_len": args.seq_len,
            "micro_batch": 1,
            "precision": "fp32",
            "dropout": 0.0,
            "padded_vocab_size": runners[0].model.padded_vocab_size,
            "step": "forward + backward + AdamW step + zero_grad",
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "order": "round-robin, rotated by one each round",
            "build_s": build_s,
        },
        "rows": rows,
        "profiles": profiles,
        "wall_s": time.perf_counter() - wall0,
    }
    atomic_write_json(args.out, result)
    print(f"\nload average before {load_before}, after {load_after}; wall {result['wall_s']:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
