"""``python -m megaformer.experiments.sweep`` on the bundled corpus: two schemes, two learning rates,
calibrated together; the table, the plot and a best config per scheme; a second call reuses the
calibration and every cell. In this process, its runs on warm-forked ranks (the subject is the
sweep; its launches through ``launch/pretrain.sh`` are test_launcher_runs.py's and
test_compare_launch.py's), on the small-vocabulary novels (``small_vocab_prefix``; compare's
``TINY`` carries ``SMALL_VOCAB``): the subject is the sweep, not the GPT-2 vocabulary."""

from __future__ import annotations

import json

import pytest

from megaformer.config.load import load_config
from megaformer.experiments import sweep
from tests.distributed.test_compare_launch import TINY

pytestmark = pytest.mark.slow  # 8 multi-process launches: outside `scripts/check.sh --fast`


def test_sweep_picks_a_rate_per_scheme_and_resumes(
    small_vocab_prefix, tmp_path, warm_experiment_launches, capsys
):
    out = tmp_path / "sweep"
    sets = [arg for item in [*TINY, f"data.prefix={small_vocab_prefix}"] for arg in ("--set", item)]
    cmd = [
        "configs/cpu-compare/pre_ln.yaml", "configs/cpu-compare/normformer.yaml",
        "--lr", "3e-4", "--lr", "3e-3", "--budget-device-hours", "0.004", "--output-dir", str(out), *sets,
        "--calibration-rounds", "2", "--calibration-warmup", "3", "--calibration-steps", "6",
    ]  # fmt: skip
    code = sweep.main(cmd)
    said = capsys.readouterr()
    assert code == 0, said.out[-3000:] + said.err[-3000:]
    record = json.loads((out / "sweep.json").read_text())
    assert len(record["rows"]) == 4 and len(record["order"]) == 4
    for name in ("pre_ln", "normformer"):
        best = record["best"][name]
        mine = [r for r in record["rows"] if r["scheme"] == name]
        assert best["mean"] == min(r["mean"] for r in mine)
        cfg = load_config(str(out / "best" / f"{name}.yaml"))
        assert cfg.train.lr == best["lr"] and cfg.data.prefix == small_vocab_prefix
        decided = {s for r in mine for s in r["budget_steps"]}
        assert len(decided) == 1  # the learning rate does not change a scheme's step count
    png = (out / "final_loss_vs_lr.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # A second call reuses the calibration and every cell. Trusting the saved calibration
    # (--recheck-rounds 0) spares 4 launches here: the re-check is calibrate_runs', the same call
    # the comparison makes, and test_compare_launch re-checks through it.
    trusted = [*cmd, "--recheck-rounds", "0"]
    code = sweep.main(trusted)
    again = capsys.readouterr()
    assert code == 0, again.err[-2000:]
    assert again.out.count("done before with the same request") == 4
    assert "calibration: reused" in again.out and "re-check" not in again.out
