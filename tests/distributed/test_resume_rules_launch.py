"""Resume through the launcher: a changed config is listed and refused before the model is built;
an explicit extension continues with the stated learning-rate rule and new samples."""

from __future__ import annotations

import shutil

from tests.distributed.conftest import LIFECYCLE_TINY, read_scalars, run_pretrain

CONFIG = "configs/normformer-quickstart.yaml"


def test_changed_config_refused_and_extension_continues(lifecycle_reference, gutenberg_prefix, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lifecycle_reference, out)
    common = [*LIFECYCLE_TINY, f"data.prefix={gutenberg_prefix}", "train.resume=auto", f"output.dir={out}"]
    refused = run_pretrain(CONFIG, [*common, "model.hidden_size=128", "train.steps=16"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "model.hidden_size: saved 64, now 128" in refused.stderr
    assert "train.steps: saved 12, now 16" in refused.stderr and "Traceback" not in refused.stderr
    extended = run_pretrain(CONFIG, [*common, "train.steps=16", "train.extend_steps=true"])
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "extending the run from 12 to 16 steps" in extended.stdout
    assert "recomputed over 16 steps" in extended.stdout
    loss = read_scalars(str(out / "tensorboard"))["train/loss"]
    assert sorted(loss) == list(range(1, 17))
    assert (out / "checkpoints" / "latest").read_text() == "global_step16"
