"""The step-time model against this CPU: the quickstart and the 125M-shape benchmark, predicted vs measured.

    .venv/bin/python bench/steptime_cpu_validation.py --quickstart-summary RUN/summary.json
        [--load "1.3 1.4 1.6"] [--out bench/results/steptime_cpu_validation.json]

Device: ``bench/results/cpu_device.json`` (``bench/cpu_device.py``). Measured:

- the quickstart (``configs/normformer-quickstart.yaml``, 2 processes on gloo, fp32, ZeRO-1, 16 ×
  128 tokens per step): a run's ``summary.json`` (``NPROC_PER_NODE=2 bash launch/pretrain.sh
  configs/normformer-quickstart.yaml train.steps=30 ...``); its mean step = tokens per step /
  ``tokens_per_s`` (the first step included), and the README's 2,341 tokens/s beside it;
- the 125M shape (``bench/norm_overhead.py``: one process, 2 threads, seq 2048, micro-batch 1, fp32,
  dropout off, forward + backward + AdamW): the median step of its Pre-LN and NormFormer rows in
  ``bench/results/norm_overhead.json``.

The prediction uses 1 thread × 2 processes for the quickstart (the launcher's OMP_NUM_THREADS =
cores / processes) and 2 threads × 1 process for the 125M rows. Writes JSON; ``tests/unit/
test_steptime.py`` recomputes the predictions against the measured figures recorded here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402
from megaformer.config import load_config  # noqa: E402
from megaformer.tools.steptime import cpu_device, predict  # noqa: E402

QUICKSTART = "configs/normformer-quickstart.yaml"
README_QUICKSTART_TOKENS_PER_S = 2341.0
NORM_OVERHEAD_JSON = os.path.join(REPO, "bench", "results", "norm_overhead.json")
ROWS_125M = {
    "pre_ln": ["model.post_attn_ln=false", "model.head_scale=false", "model.ffn_ln=false"],
    "normformer": ["model.post_attn_ln=true", "model.head_scale=true", "model.ffn_ln=true"],
}
COMMON_125M = [
    "model.seq_len=2048",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "model.embedding_dropout=0.0",
    "model.resid_scale=false",
    "train.precision=fp32",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
    "train.zero_stage=0",
]


def predict_quickstart() -> float:
    cfg = load_config(os.path.join(REPO, QUICKSTART), [])
    return predict(cfg, cpu_device(threads=1, processes=2), 2, 2).total


def predict_125m(key: str) -> float:
    cfg = load_config(
        os.path.join(REPO, "configs", "paper", "125m-baseline.yaml"), COMMON_125M + ROWS_125M[key]
    )
    return predict(cfg, cpu_device(threads=2, processes=1), 1, 1).total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quickstart-summary", required=True)
    parser.add_argument("--load", default="", help="load average during the quickstart run, as noted")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "bench", "results", "steptime_cpu_validation.json")
    )
    args = parser.parse_args()
    with open(args.quickstart_summary) as f:
        summary = json.load(f)
    cfg = load_config(os.path.join(REPO, QUICKSTART), [])
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    measured_qs = tokens / summary["tokens_per_s"]
    with open(NORM_OVERHEAD_JSON) as f:
        rows = {r["key"]: r for r in json.load(f)["rows"]}
    cases = {
        "quickstart": {
            "measured_step_s": measured_qs,
            "measured_from": f"summary.json of a {summary['steps']}-step run, load {args.load}",
            "readme_step_s": tokens / README_QUICKSTART_TOKENS_PER_S,
            "predicted_step_s": predict_quickstart(),
        }
    }
    for key in ROWS_125M:
        cases[f"125m_{key}"] = {
            "measured_step_s": rows[key]["median_step_s"],
            "measured_from": "bench/results/norm_overhead.json median_step_s",
            "predicted_step_s": predict_125m(key),
        }
    for name, c in cases.items():
        c["error"] = c["predicted_step_s"] / c["measured_step_s"] - 1
        extra = f" (README {c['readme_step_s']:.3f} s)" if "readme_step_s" in c else ""
        print(
            f"{name:18s} predicted {c['predicted_step_s']:.3f} s, measured {c['measured_step_s']:.3f} s"
            f"{extra}: {c['error']:+.1%}"
        )
    atomic_write_json(args.out, {"device": "bench/results/cpu_device.json", "cases": cases})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
