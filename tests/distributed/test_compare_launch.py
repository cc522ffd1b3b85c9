"""``python -m megaformer.experiments.compare`` on the bundled corpus: two schemes calibrated
together, trained at one budget from their calibrated step times, a table and a PNG; a second call
reuses both the calibration and the runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.conftest import REPO

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

TINY = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=2", "model.seq_len=64",
    "train.micro_batch_size=4", "train.global_batch_size=8", "train.eval_interval=10",
    "train.eval_batches=2", "data.valid_fraction=0.02", "train.save_interval=0",
]  # fmt: skip


def test_compare_writes_its_table_and_plot(gutenberg_prefix, tmp_path):
    out = tmp_path / "cmp"
    sets = [arg for item in [*TINY, f"data.prefix={gutenberg_prefix}"] for arg in ("--set", item)]
    cmd = [
        sys.executable, "-m", "megaformer.experiments.compare",
        "configs/cpu-compare/pre_ln.yaml", "configs/cpu-compare/normformer.yaml",
        "--budget-device-hours", "0.006", "--output-dir", str(out), *sets,
        "--calibration-rounds", "2", "--calibration-warmup", "3", "--calibration-steps", "6",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "comparison.json").read_text())
    assert [r["run"] for r in data["rows"]] == ["pre_ln", "normformer"]
    for row in data["rows"]:
        assert row["steps"] > 25 and row["device_hours"] > 0 and row["final_valid_ppl"] > 1
        assert row["budget_steps"] >= row["steps"] and row["calibrated_step_seconds"] > 0
    assert sorted(data["order"]) == ["normformer", "pre_ln"] and data["order_rule"] == "random"
    timings = data["calibration"]["timings"]
    assert [r["position"] for r in timings["pre_ln"]["rounds"]] == [0, 1]  # the order alternated
    assert (out / "calibration.json").is_file() and (out / "pre_ln" / "request.json").is_file()
    assert "calibrated step" in (out / "pre_ln" / "train.log").read_text()
    assert data["rows"][0]["hours_to_baseline_best_ppl"] is not None  # the baseline reaches its own best
    table = (out / "comparison.md").read_text()
    assert "| pre_ln |" in table and "| normformer |" in table
    png = (out / "valid_ppl_vs_device_hours.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # a second call reuses the finished runs instead of training again
    # (after re-checking the reused calibration on this machine: 2 more rounds of short launches)
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "done before with the same request" in again.stdout
    assert (
        "calibration: reused" in again.stdout
        and "calibration re-check: this machine's step time" in again.stdout
    )
    recheck = json.loads((out / "calibration.json").read_text())["rechecks"][-1]
    assert set(recheck["ratios"]) == {"pre_ln", "normformer"} and recheck["measured"] > 0
    assert recheck["factor"] >= 1.0  # the re-check only ever loosens the spend limit
