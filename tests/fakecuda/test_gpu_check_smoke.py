"""``bash scripts/gpu_check.sh --smoke``: the GPU-day command's CPU path (bench/gpu.py on a tiny model
over gloo, NormFormer and Pre-LN as a pair, the attention kernels named by the profiler, each case's
planner and fake-CUDA dry-run prediction beside it) writes its JSON, Markdown table and log inside
the ``$OUT`` folder, as the device's ``$OUT`` is one. The probe (``bench/gpu_probe.py``, ~1 min of
compilation on this CPU) is left to ``tests/unit/test_gpu_check_predict.py``'s slow test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_gpu_check_smoke_writes_measurements_beside_predictions_in_the_out_folder(shim, tmp_path):
    out = tmp_path / "OUT"
    out.mkdir()
    env = dict(
        os.environ, VENV="none", PYTHON=sys.executable, OUT=str(out), SIZES="125m", STEPS="1", PROBE="0"
    )
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # nothing beside the folder
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check_smoke.json",
        "gpu_check_smoke.log",
        "gpu_check_smoke.md",
    ]
    result = json.loads((out / "gpu_check_smoke.json").read_text())
    rows = [r for r in result["rows"] if "error" not in r]
    assert result["smoke"] and result["complete"] and len(rows) == 2, result
    assert [r["recipe"] for r in rows] == ["125m-normformer", "125m-baseline"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0
        attention = row["attention"]  # CPU eager with dropout: ATen's math kernel, once per layer
        assert attention["backend"] == "math", attention
        assert attention["forward_calls"] == attention["expected_forwards"] == 2 * 4  # layers × micro
        prediction = row["prediction"]
        assert prediction["planner_peak_gib"] > 0
        assert prediction["dryrun"]["peak_gib"] > 0, prediction  # the dry run of the same config
    assert [p["size"] for p in result["pairs"]] == ["125m"]
    assert result["environment"]["torch"].startswith("2.")
    table = (out / "gpu_check_smoke.md").read_text()
    assert table.startswith("| recipe | ZeRO |")
    assert "| 125m | 1 | none | eager |" in table  # the NormFormer / Pre-LN line
    assert "2/2 125m-baseline ZeRO 1 none" in (out / "gpu_check_smoke.log").read_text()
