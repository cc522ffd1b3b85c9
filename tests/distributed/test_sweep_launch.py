"""``python -m megaformer.experiments.sweep`` on the bundled corpus: two schemes, two learning rates,
calibrated together; the table, the plot and a best config per scheme; a second call reuses the
calibration and every cell."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaformer.config.load import load_config
from tests.distributed.conftest import REPO
from tests.distributed.test_compare_launch import TINY

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`


def test_sweep_picks_a_rate_per_scheme_and_resumes(gutenberg_prefix, tmp_path):
    out = tmp_path / "sweep"
    sets = [arg for item in [*TINY, f"data.prefix={gutenberg_prefix}"] for arg in ("--set", item)]
    cmd = [
        sys.executable, "-m", "megaformer.experiments.sweep",
        "configs/cpu-compare/pre_ln.yaml", "configs/cpu-compare/normformer.yaml",
        "--lr", "3e-4", "--lr", "3e-3", "--budget-device-hours", "0.004", "--output-dir", str(out), *sets,
        "--calibration-rounds", "2", "--calibration-warmup", "3", "--calibration-steps", "6",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "sweep.json").read_text())
    assert len(record["rows"]) == 4 and len(record["order"]) == 4
    for name in ("pre_ln", "normformer"):
        best = record["best"][name]
        mine = [r for r in record["rows"] if r["scheme"] == name]
        assert best["mean"] == min(r["mean"] for r in mine)
        cfg = load_config(str(out / "best" / f"{name}.yaml"))
        assert cfg.train.lr == best["lr"] and cfg.data.prefix == gutenberg_prefix
        decided = {s for r in mine for s in r["budget_steps"]}
        assert len(decided) == 1  # the learning rate does not change a scheme's step count
    png = (out / "final_loss_vs_lr.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # A second call reuses the calibration and every cell. Trusting the saved calibration
    # (--recheck-rounds 0) spares 4 launches here: the re-check is calibrate_runs', the same call
    # the comparison makes, and test_compare_launch re-checks through it.
    trusted = [*cmd, "--recheck-rounds", "0"]
    again = subprocess.run(trusted, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("done before with the same request") == 4
    assert "calibration: reused" in again.stdout and "re-check" not in again.stdout
