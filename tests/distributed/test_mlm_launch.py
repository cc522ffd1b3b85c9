"""configs/mlm-quickstart.yaml as 2 CPU ranks (tiny, a few steps): the
masked LM trains (finite, decreasing loss), logs its masked-token validation loss and perplexity, and
the causal-only tools refuse its checkpoint."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.distributed.conftest import REPO, read_scalars, run_ranks

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks): outside `scripts/check.sh --fast`

TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=5",
    "train.eval_batches=1",
    "train.save_interval=100",
    "train.steps=10",
    "data.valid_fraction=0.02",
]


def test_mlm_quickstart_trains_and_logs_the_masked_validation_loss(gutenberg_prefix, tmp_path):
    out = tmp_path / "run"
    proc = run_ranks(
        "configs/mlm-quickstart.yaml", [*TINY, f"data.prefix={gutenberg_prefix}", f"output.dir={out}"]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(str(out / "tensorboard"))
    losses = [scalars["train/loss"][s] for s in sorted(scalars["train/loss"])]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    valid = scalars["valid/loss"]
    assert sorted(valid) == [5, 10] and all(math.isfinite(x) for x in valid.values())
    assert "valid loss" in proc.stdout + proc.stderr
    assert "masked LM (loss on masked tokens)" in proc.stdout + proc.stderr
    # The checkpoint is a masked LM: generation refuses it before loading a model.
    gen = subprocess.run(
        [sys.executable, "-m", "megaformer.tools.generate", "--checkpoint", str(out / "checkpoints")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 2 and "model.objective='mlm'" in gen.stderr, gen.stderr[-2000:]
