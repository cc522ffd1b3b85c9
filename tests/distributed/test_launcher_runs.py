"""The experiment commands' launcher (:mod:`megaformer.experiments.launcher`) through the real
``launch/pretrain.sh``: the launch path that the sweep and comparison tests replace with warm-forked
ranks (their subject is the experiment) is checked here, once, as a user's run would take it."""

from __future__ import annotations

import pytest

from megaformer.experiments.launcher import launch_run
from tests.distributed.test_compare_launch import TINY  # with SMALL_VOCAB: small_vocab_prefix's data

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`


def test_launch_run_trains_through_pretrain_sh_and_names_a_failure(small_vocab_prefix, tmp_path):
    out = tmp_path / "run"
    args = [
        *TINY,
        f"data.prefix={small_vocab_prefix}",
        "train.steps=4",
        "train.warmup_steps=2",
        f"output.dir={out}",
    ]
    summary = launch_run("configs/cpu-compare/pre_ln.yaml", out, args, 2, "test")
    assert summary["steps"] == 4 and summary["world_size"] == 2
    log = (out / "train.log").read_text()
    # the launcher's own lines: pretrain.sh's banner and DeepSpeed's runner, then the ranks' run
    assert "[pretrain.sh] 1 node(s) x 2 process(es)" in log and "step 4/4" in log
    bad = tmp_path / "bad"
    with pytest.raises(RuntimeError, match=r"training failed \(exit 2\): .*model\.hidden_sise"):
        launch_run(
            "configs/cpu-compare/pre_ln.yaml",
            bad,
            [*args[:-1], "model.hidden_sise=64", f"output.dir={bad}"],
            2,
            "test",
        )
