"""The masked LM's training step with its head decoding every position against the masked ones only
(``model.mlm_head_positions`` all / masked), as ratios measured in one run.

    .venv/bin/python bench/mlm_head.py [--rounds 6] [--warmup-rounds 1] [--threads 2]
        [--out bench/results/mlm_head_cpu.json]

Shapes (rows): the CPU masked LMs of ``configs/cpu-compare-mlm/pre_ln.yaml`` (d 128, 4 layers, T 128,
micro-batch 8: the SST-2 records of EXPERIMENTS.md) and RoBERTa-base's ``configs/paper/mlm-125m-
baseline.yaml`` at T 512, micro-batch 1 (to keep a CPU step short), dropout off in both. For each
shape both models are built from one seed (the same parameters: the key changes no weight) with one
AdamW each. One step is forward + backward + AdamW ``step`` + ``zero_grad``, fp32, one process, on
one batch masked by the data's own rule (:func:`megaformer.data.mlm.mask_block`).

The steps are interleaved: each round runs one step of every model, the order rotated each round,
so whatever else the machine does hits both alike; the first ``--warmup-rounds`` are discarded.
Reported: each model's median step, the per-round ratios all / masked (median, min, max) and, beside
them, the ratio of model FLOPs per token (:func:`megaformer.training.flops.model_flops_per_token`:
what the step would gain if every operation ran at matmul speed). Prints a table and writes JSON.
Not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402
from megaformer.config.load import load_config  # noqa: E402
from megaformer.data.mlm import BOS_ID, GPT2_VOCAB_SIZE, mask_block  # noqa: E402
from megaformer.model import NormFormerLM, param_groups  # noqa: E402
from megaformer.training.flops import model_flops_per_token  # noqa: E402

NO_DROPOUT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "model.embedding_dropout=0.0"]
SHAPES = [  # (name, config, overrides, micro-batch)
    ("cpu d128 L4 T128", "configs/cpu-compare-mlm/pre_ln.yaml", [], 8),
    ("roberta-base T512", "configs/paper/mlm-125m-baseline.yaml", ["model.seq_len=512"], 1),
]
POSITIONS = ("all", "masked")


class Runner:
    """One model, its AdamW and a fixed masked batch; ``step()`` times one training step."""

    def __init__(self, config: str, overrides: list[str], positions: str, batch: int) -> None:
        extra = [*NO_DROPOUT, *overrides, f"model.mlm_head_positions={positions}"]
        self.config = load_config(os.path.join(REPO, config), extra).model
        self.model = NormFormerLM(self.config, seed=1).train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, 0.01), lr=1e-4, betas=(0.9, 0.98))
        tokens = np.random.default_rng(0).integers(0, GPT2_VOCAB_SIZE, (batch, self.config.seq_len))
        tokens[:, 0] = BOS_ID
        pairs = [mask_block(t, seed=1, epoch=0, index=i) for i, t in enumerate(tokens)]
        self.inputs, self.labels = (torch.from_numpy(np.stack(x)) for x in zip(*pairs, strict=True))

    def step(self) -> float:
        start = time.perf_counter()
        self.model(self.inputs, self.labels).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def measure(rounds: int, warmup_rounds: int) -> list[dict]:
    """Per shape: both models' step times over interleaved rounds, their medians and ratios."""
    rows = []
    for name, config, overrides, batch in SHAPES:
        runners = [Runner(config, overrides, p, batch) for p in POSITIONS]
        times: list[list[float]] = [[], []]
        for r in range(warmup_rounds + rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            got = {i: runners[i].step() for i in order}
            print(f"{name} {'warm-up' if r < warmup_rounds else 'round'} {r}: "
                  f"all {got[0]:.3f}s  masked {got[1]:.3f}s", flush=True)  # fmt: skip
            if r >= warmup_rounds:
                for i in (0, 1):
                    times[i].append(got[i])
        ratios = [a / b for a, b in zip(*times, strict=True)]
        flops = [model_flops_per_token(r.config) for r in runners]
        rows.append(
            {
                "shape": name,
                "config": config,
                "overrides": [*NO_DROPOUT, *overrides],
                "micro_batch_size": batch,
                "seq_len": runners[0].config.seq_len,
                "step_times_s": dict(zip(POSITIONS, times, strict=True)),
                "median_step_s": {p: statistics.median(t) for p, t in zip(POSITIONS, times, strict=True)},
                "per_round_ratio_all_over_masked": ratios,
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "model_flops_per_token": dict(zip(POSITIONS, flops, strict=True)),
                "flops_ratio_all_over_masked": flops[0] / flops[1],
            }
        )
        del runners
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (one step of each model)")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "mlm_head_cpu.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup_rounds < 0 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1, --warmup-rounds >= 0")
    torch.set_num_threads(args.threads)
    rows = measure(args.rounds, args.warmup_rounds)
    print(f"\n{'shape':<20} {'all (s)':>9} {'masked (s)':>11} {'ratio (min-max)':>22} {'FLOPs ratio':>12}")
    for r in rows:
        med = r["median_step_s"]
        span = f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        print(f"{r['shape']:<20} {med['all']:>9.3f} {med['masked']:>11.3f} {span:>22} "
              f"{r['flops_ratio_all_over_masked']:>11.2f}x")  # fmt: skip
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "rows": rows,
    }
    atomic_write_json(args.out, record)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
