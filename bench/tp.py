"""Tensor-parallel benchmark: training-step time and tokens/s of a small NormFormer at TP = 1 and 2.

    .venv/bin/python bench/tp.py [--steps 10] [--warmup 3] [--out bench/results/tp.json]

The model is :class:`megaformer.model.NormFormerLM`, the one the trainer trains at pp = 1. Each TP
degree runs in its own group of spawned processes (gloo on CPU, nccl on GPUs), one model
replica (dp = 1), so the figures show what splitting one model costs or gains on this machine. A
step is forward + backward + AdamW on one batch; the median over ``--steps`` timed steps is reported.
On CPU the cores are divided among the processes (``torch.set_num_threads(cores // tp)``), so TP = 2
uses the same cores as TP = 1. Prints a table and writes JSON. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_tools.files import atomic_write_json
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM, param_groups

MODEL = ModelConfig(hidden_size=256, num_layers=4, num_attention_heads=8, seq_len=256)
BATCH = 8  # sequences per step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, tp: int, sp: bool, port: int, steps: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=tp, timeout=timedelta(seconds=120)
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.new_group(list(range(tp))) if tp > 1 else None
    model = NormFormerLM(MODEL, tp_group=group, seed=1, sequence_parallel=sp).to(device)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len + 1), generator=gen).to(device)
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"step_times_s": times, "loss": float(loss.detach())}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(tp: int, sp: bool, steps: int, warmup: int, scratch: str) -> dict:
    out = os.path.join(scratch, f"tp{tp}{'_sp' if sp else ''}.json")
    mp.spawn(_worker, args=(tp, sp, _free_port(), steps, warmup, out), nprocs=tp, join=True)
    with open(out, encoding="utf-8") as f:
        data = json.load(f)
    step = statistics.median(data["step_times_s"])
    return {
        "tp": tp,
        "sequence_parallel": sp,
        "processes": tp,
        "median_step_s": step,
        "tokens_per_s": BATCH * MODEL.seq_len / step,
        "loss": data["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tp.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    layouts = [(1, False), (2, False), (2, True)]
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        layouts = [(1, False)]
    with tempfile.TemporaryDirectory() as scratch:  # rank 0's raw timings
        rows = [run(tp, sp, args.steps, args.warmup, scratch) for tp, sp in layouts]
    base = rows[0]["median_step_s"]
    for r in rows:
        r["speedup_vs_tp1"] = base / r["median_step_s"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    result = {
        "machine": {"device": device, "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "model": {
            "hidden_size": MODEL.hidden_size,
            "num_layers": MODEL.num_layers,
            "num_attention_heads": MODEL.num_attention_heads,
            "seq_len": MODEL.seq_len,
            "vocab_size": MODEL.vocab_size,
            "batch": BATCH,
        },
        "steps": args.steps,
        "rows": rows,
    }
    atomic_write_json(args.out, result)
    print(f"{'layout':<14} {'step (s)':>9} {'tokens/s':>10} {'vs tp1':>7}")
    for r in rows:
        name = f"tp{r['tp']}" + (" +sp" if r["sequence_parallel"] else "")
        print(
            f"{name:<14} {r['median_step_s']:>9.3f} {r['tokens_per_s']:>10,.0f} {r['speedup_vs_tp1']:>7.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
