"""``bash scripts/gpu_check.sh --smoke``: the GPU-day command's CPU path (GPU tests collected and
skipped, bench/gpu.py on a tiny model over gloo, each case's planner and fake-CUDA dry-run
prediction beside it) writes its JSON and Markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_writes_measurements_beside_predictions(shim, tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, VENV="none", PYTHON=sys.executable, OUT=str(out), SIZES="125m", STEPS="2")
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = tmp_path / "gpu_check_smoke.json"
    result = json.loads(written.read_text())
    rows = [r for r in result["rows"] if "error" not in r]
    assert result["smoke"] and len(rows) == 3, result  # ZeRO 0 and 1 of NormFormer, the Pre-LN baseline
    for row in rows:
        assert row["tokens_per_s"] > 0
        prediction = row["prediction"]
        assert prediction["planner_peak_gib"] > 0
        assert prediction["dryrun"]["peak_gib"] > 0, prediction  # the dry run of the same config
    table = written.with_suffix(".md").read_text()
    assert table.startswith("| recipe | ZeRO |") and table.count("\n") == 2 + len(rows)
