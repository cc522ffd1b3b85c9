"""Pipeline-parallel benchmark: tokens/s of the real training loop at pp = 1 and pp = 2.

    .venv/bin/python bench/pipeline.py [--steps 12] [--out bench/results/pipeline.json]

Each layout is one ``launch/pretrain.sh`` run (DeepSpeed launcher, gloo on CPU / nccl on GPUs) of a
small NormFormer on real text (three Gutenberg novels, tokenized into a temporary directory), so
the figure includes everything a step does: data, forward, backward, the pipeline schedule's
sends and receives, the optimizer. Reported: the run's median step time (``summary.json``,
robust to warm-up and evaluation) as tokens/s for the whole job. The global batch (8 sequences of
256 tokens, micro-batches of 2) is the same in every layout: at pp = 2 it is 4 pipeline
micro-batches. On CPU the launcher divides the cores among the processes. Prints a table and
writes JSON. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "normformer-quickstart.yaml")
MODEL = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_attention_heads=8",
    "model.seq_len=256",
]
LAYOUTS = [  # (name, processes, overrides)
    ("pp1 (1 process)", 1, ["parallel.pp_size=1"]),
    ("pp1 × dp2", 2, ["parallel.pp_size=1"]),
    ("pp2", 2, ["parallel.pp_size=2"]),
    ("pp2 + activation checkpointing", 2, ["parallel.pp_size=2", "train.activation_checkpointing=true"]),
]


def _dataset(tmp: str) -> str:
    books = [
        os.path.join(REPO, "data", "gutenberg-novels", n)
        for n in ("pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz")
    ]
    data = os.path.join(REPO, "data")
    cmd = [
        sys.executable, "-m", "data_tools.preprocess", "--input", *books,
        "--output-prefix", os.path.join(tmp, "novels"), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", os.path.join(data, "gpt2-bpe", "encoder.json"),
        "--merge-file", os.path.join(data, "gpt2-bpe", "vocab.bpe"),
        "--append-eod", "--text-split-blank-lines", "--skip-bad-records", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return os.path.join(tmp, "novels_text_document")


def run(steps: int, out: str | None) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _dataset(tmp)
        for name, nproc, extra in LAYOUTS:
            run_dir = os.path.join(tmp, f"run{len(results)}")
            overrides = [
                *MODEL, *extra, f"data.prefix={prefix}", f"output.dir={run_dir}", f"train.steps={steps}",
                "train.micro_batch_size=2", "train.global_batch_size=8", "train.warmup_steps=2",
                "train.eval_interval=1000000", "train.eval_batches=1", "train.save_interval=0",
                "train.zero_stage=0", "train.precision=fp32", "data.valid_fraction=0.02",
            ]  # fmt: skip
            env = dict(os.environ, NPROC_PER_NODE=str(nproc))
            env.pop("MASTER_PORT", None)
            proc = subprocess.run(
                ["bash", os.path.join(REPO, "launch", "pretrain.sh"), CONFIG, *overrides],
                cwd=REPO, env=env, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{name}: exit {proc.returncode}")
            with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
            row = {
                "layout": name,
                "processes": nproc,
                "tokens_per_s": summary["tokens_per_s"],
                "median_step_s": 8 * 256 / summary["tokens_per_s"],
                "parameters": summary["parameters"],
            }
            results.append(row)
            print(
                f"{name:32s} {nproc:3d} proc  {row['tokens_per_s']:9,.0f} tokens/s  "
                f"{row['median_step_s']:.3f} s/step"
            )
    report = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "model": MODEL,
        "global_batch": "8 × 256 tokens, micro-batch 2",
        "steps": steps,
        "results": results,
    }
    if out:
        atomic_write_json(out, report)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "pipeline.json"))
    args = parser.parse_args()
    run(args.steps, args.out)


if __name__ == "__main__":
    main()
