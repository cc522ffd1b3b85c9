"""Resume through the launcher: a changed config is listed and refused before the model is built;
an explicit extension continues with the stated learning-rate rule (at every new step, as the
uninterrupted run) and new samples; a finished run relaunched is left as it is. On the
small-vocabulary novels (``small_vocab_prefix`` with ``SMALL_VOCAB``): the subject is the resume,
not the GPT-2 vocabulary."""

from __future__ import annotations

import json
import shutil

import pytest

from megaformer.config import load_config
from megaformer.training.schedule import lr_at
from tests.distributed.conftest import LIFECYCLE_TINY, SMALL_VOCAB, read_scalars, run_pretrain, run_ranks

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"


def test_changed_config_refused_and_extension_continues(
    lifecycle_reference_small_vocab, small_vocab_prefix, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(lifecycle_reference_small_vocab, out)
    data = [*SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]
    common = [*LIFECYCLE_TINY, *data, "train.resume=auto", f"output.dir={out}"]
    refused = run_pretrain(CONFIG, [*common, "model.hidden_size=128", "train.steps=16"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "model.hidden_size: saved 64, now 128" in refused.stderr
    assert "train.steps: saved 12, now 16" in refused.stderr and "Traceback" not in refused.stderr
    # refused before any worker started (issue 39): said once, no launcher, no 'Killing subprocess'
    assert refused.stderr.count("model.hidden_size: saved 64, now 128") == 1
    assert (
        "Killing subprocess" not in refused.stdout + refused.stderr and "[pretrain.sh]" not in refused.stderr
    )
    # the extension and its reference are the ranks' work: started by the test (run_ranks)
    extended = run_ranks(CONFIG, [*common, "train.steps=16", "train.extend_steps=true"])
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "extending the run from 12 to 16 steps" in extended.stdout
    assert "recomputed over 16 steps" in extended.stdout
    # the summary line counts this launch's steps and the run's, not the run's alone (issue 39)
    assert "done: 4 steps in this launch (steps 13–16; the run has 16 of 16)" in extended.stdout
    assert "device-hours (the run's totals, all launches)" in extended.stdout  # not this launch's
    scalars = read_scalars(str(out / "tensorboard"))
    assert sorted(scalars["train/loss"]) == list(range(1, 17))
    assert (out / "checkpoints" / "latest").read_text() == "global_step16"
    # Every new step's learning rate is the uninterrupted 16-step run's, the first one included
    # (issue 23: it took the 12-step schedule's last rate, min_lr, from the optimizer state).
    straight = tmp_path / "straight"
    proc = run_ranks(
        CONFIG,
        [*LIFECYCLE_TINY, *data, "train.steps=16", "train.save_interval=0", f"output.dir={straight}"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = read_scalars(str(straight / "tensorboard"))["train/lr"]
    lr = scalars["train/lr"]
    assert lr[13] != pytest.approx(lr[12])  # the 12-step schedule had ended at min_lr
    for step in range(13, 17):
        assert lr[step] == pytest.approx(want[step], rel=1e-6), (step, lr[step], want[step])
    t16 = load_config(CONFIG, [*LIFECYCLE_TINY, "train.steps=16"]).train
    assert lr[13] == pytest.approx(lr_at(12, t16), rel=1e-6)  # the rate the extension log line states
    assert f"(step 13) takes lr {lr_at(12, t16):.3e}" in extended.stdout
    step13 = [ln for ln in extended.stdout.splitlines() if "| step 13/16 |" in ln]
    assert len(step13) == 1 and f"| lr {lr_at(12, t16):.3e} |" in step13[0], step13


def test_relaunching_a_finished_run_changes_nothing(
    lifecycle_reference_small_vocab, small_vocab_prefix, tmp_path
):
    """The same command again (or a Slurm requeue) after the run completed: exit 0, a message naming
    its summary, and its summary, checkpoints and TensorBoard events byte-identical (issue 23: it
    ran zero steps and rewrote summary.json with NaN)."""
    out = tmp_path / "run"
    shutil.copytree(lifecycle_reference_small_vocab, out)
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    data = [*SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]
    again = [*LIFECYCLE_TINY, *data, "train.resume=auto", f"output.dir={out}"]
    proc = run_pretrain(CONFIG, again)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run already complete" in proc.stdout and f"its summary: {out / 'summary.json'}" in proc.stdout
    assert "nothing written" in proc.stdout and "Traceback" not in proc.stderr
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert sorted(after) == sorted(before)
    assert [name for name in before if after[name] != before[name]] == []
    summary = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)
    assert summary["steps"] == 12 and summary["final_valid_loss"] > 0


def _refuse(name: str) -> None:
    raise ValueError(f"summary.json is not strict JSON: {name}")
