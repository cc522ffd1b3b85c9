"""The step-time model against this CPU: the quickstart and the 125M-shape benchmark, predicted vs measured.

    .venv/bin/python bench/steptime_cpu_validation.py --quickstart-summary RUN/summary.json
        [--load "1.3 1.4 1.6"] [--measure-125m ROUNDS] [--out bench/results/steptime_cpu_validation.json]

Device: ``bench/results/cpu_device.json`` (``bench/cpu_device.py``). Measured:

- the quickstart (``configs/normformer-quickstart.yaml``, 2 processes on gloo, fp32, ZeRO-1, 16 ×
  128 tokens per step): a run's ``summary.json`` (``NPROC_PER_NODE=2 bash launch/pretrain.sh
  configs/normformer-quickstart.yaml train.steps=30 ...``); its mean step = tokens per step /
  ``tokens_per_s`` (the first step included), and the README's 2,341 tokens/s beside it;
- the 125M shape (``bench/norm_overhead.py``: one process, 2 threads, seq 2048, micro-batch 1, fp32,
  dropout off, forward + backward + AdamW): with ``--measure-125m ROUNDS``, its Pre-LN and NormFormer
  steps timed here (:func:`measure_125m`: the median of the steps during which other processes used
  under 5 % of the CPU; the machine is shared), the median step of those rows in
  ``bench/results/norm_overhead.json`` beside it; without, that median alone.

The prediction uses 1 thread × 2 processes for the quickstart (the launcher's OMP_NUM_THREADS =
cores / processes) and 2 threads × 1 process for the 125M rows. Writes JSON; ``tests/unit/
test_steptime.py`` recomputes the predictions against the measured figures recorded here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_tools.files import atomic_write_json  # noqa: E402
from megaformer.config import load_config  # noqa: E402
from megaformer.perf.steptime import cpu_device, predict  # noqa: E402

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


def _cpu_ticks() -> tuple[int, int]:
    """(all, busy) clock ticks of every CPU of the machine since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), sum(v) - v[3] - v[4]


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def others_share(fn, hz: float = os.sysconf("SC_CLK_TCK")) -> tuple[float, float]:
    """Runs ``fn``; returns (wall seconds, the share of the machine's CPU time that other processes
    used meanwhile: busy ticks of all CPUs less this process's CPU time, over all CPUs' ticks)."""
    all0, busy0 = _cpu_ticks()
    own0, t0 = _own_cpu_s(), time.perf_counter()
    fn()
    wall, own = time.perf_counter() - t0, _own_cpu_s() - own0
    all1, busy1 = _cpu_ticks()
    return wall, max(0.0, (busy1 - busy0) / hz - own) / max(1e-9, (all1 - all0) / hz)


def wait_quiet(limit: float = 0.05, max_wait_s: float = 120.0) -> float:
    """Waits (1 s samples, at most ``max_wait_s``) until other processes use under ``limit`` of the
    machine's CPU; returns the last sample's share."""
    deadline, share = time.monotonic() + max_wait_s, 1.0
    while time.monotonic() < deadline:
        share = others_share(lambda: time.sleep(1.0))[1]
        if share < limit:
            break
    return share


def measure_125m(rounds: int, quiet_limit: float = 0.05) -> dict:
    """Times the Pre-LN and NormFormer steps of ``bench/norm_overhead.py`` (its ``Runner``: one process,
    2 threads, seq 2048, micro-batch 1, fp32, dropout off, forward + backward + AdamW) one after the
    other for ``rounds`` rounds (order alternating, one warm-up step each), each step started when
    other processes used under ``quiet_limit`` of the CPU for 1 s; records each step's wall time and
    the others' share during it. The measured step is the median of the steps during which others
    used under ``quiet_limit`` (all steps if fewer than 2 such)."""
    import torch

    from bench.norm_overhead import ROWS, SHORT, THREADS, Runner

    torch.set_num_threads(THREADS)
    runners = {key: Runner(ROWS[SHORT.index(key)][1], 2048) for key in ROWS_125M}
    steps: dict[str, list] = {key: [] for key in runners}
    load = [os.getloadavg()]
    for key in runners:
        runners[key].step()
    for r in range(rounds):
        for key in list(runners)[:: 1 if r % 2 == 0 else -1]:
            before = wait_quiet(quiet_limit)
            wall, share = others_share(lambda: runners[key].step())  # noqa: B023
            steps[key].append({"wall_s": wall, "others_share": share, "others_share_before": before})
            print(f"round {r} {key}: {wall:.2f} s, others {share:.1%} (before {before:.1%})", flush=True)
        load.append(os.getloadavg())
    out = {"load_average_1_5_15": load, "quiet_limit": quiet_limit, "rows": {}}
    for key, got in steps.items():
        quiet = [s["wall_s"] for s in got if s["others_share"] < quiet_limit]
        use = quiet if len(quiet) >= 2 else [s["wall_s"] for s in got]
        out["rows"][key] = {
            "steps": got,
            "quiet_steps": len(quiet),
            "median_step_s": statistics.median(use),
            "min_step_s": min(use),
        }
    return out


def _cases_125m(measured: dict | None) -> dict:
    """The 125M cases: measured by :func:`measure_125m` where given (the committed
    ``norm_overhead.json`` median beside it), else that median."""
    with open(NORM_OVERHEAD_JSON) as f:
        rows = {r["key"]: r for r in json.load(f)["rows"]}
    cases = {}
    for key in ROWS_125M:
        predicted, committed = predict_125m(key), rows[key]["median_step_s"]
        case = {
            "measured_step_s": committed,
            "measured_from": "bench/results/norm_overhead.json median_step_s",
            "predicted_step_s": predicted,
        }
        if measured:
            row = measured["rows"][key]
            case.update(
                measured_step_s=row["median_step_s"],
                measured_from=(
                    f"bench/steptime_cpu_validation.py --measure-125m: median of {row['quiet_steps']} steps "
                    f"during which other processes used < {measured['quiet_limit']:.0%} of the CPU"
                ),
                measured_min_step_s=row["min_step_s"],
                norm_overhead_json_step_s=committed,
                error_vs_norm_overhead_json=predicted / committed - 1,
            )
        cases[f"125m_{key}"] = case
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quickstart-summary", required=True)
    parser.add_argument("--load", default="", help="load average during the quickstart run, as noted")
    parser.add_argument(
        "--measure-125m",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="time the 125M steps here (0: use the JSON)",
    )
    parser.add_argument(
        "--out", default=os.path.join(REPO, "bench", "results", "steptime_cpu_validation.json")
    )
    args = parser.parse_args()
    with open(args.quickstart_summary) as f:
        summary = json.load(f)
    cfg = load_config(os.path.join(REPO, QUICKSTART), [])
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    measured_qs = tokens / summary["tokens_per_s"]
    cases = {
        "quickstart": {
            "measured_step_s": measured_qs,
            "measured_from": f"summary.json of a {summary['steps']}-step run, load {args.load}",
            "readme_step_s": tokens / README_QUICKSTART_TOKENS_PER_S,
            "predicted_step_s": predict_quickstart(),
        }
    }
    measured = measure_125m(args.measure_125m) if args.measure_125m else None
    cases.update(_cases_125m(measured))
    for name, c in cases.items():
        c["error"] = c["predicted_step_s"] / c["measured_step_s"] - 1
        extra = f" (README {c['readme_step_s']:.3f} s)" if "readme_step_s" in c else ""
        if "norm_overhead_json_step_s" in c:
            committed, err = c["norm_overhead_json_step_s"], c["error_vs_norm_overhead_json"]
            extra = f" (norm_overhead.json {committed:.3f} s: {err:+.1%})"
        print(
            f"{name:18s} predicted {c['predicted_step_s']:.3f} s, measured {c['measured_step_s']:.3f} s"
            f"{extra}: {c['error']:+.1%}"
        )
    out = {"device": "bench/results/cpu_device.json", "cases": cases}
    if measured:
        out["measure_125m"] = measured
    atomic_write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
