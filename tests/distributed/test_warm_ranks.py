"""The tests' ranks forked from a warm interpreter (:mod:`tests.support.warm_ranks`, used by
``run_ranks``) train exactly as new interpreters do: the same run both ways gives the same untimed
TensorBoard scalars, bit for bit (dropout on, so every generator state counts; two evaluations), as
``scripts/fingerprint_runs.py`` compares them. This is what lets the multi-process tier trust the
forks."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.distributed.conftest import LIFECYCLE_TINY, REPO, SMALL_VOCAB, run_ranks
from tests.support import warm_ranks

pytestmark = pytest.mark.slow  # two multi-process training runs: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
_spec = importlib.util.spec_from_file_location("fingerprint_runs", REPO / "scripts" / "fingerprint_runs.py")
fingerprint_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fingerprint_runs)


def test_forked_ranks_train_bitwise_as_new_interpreters(small_vocab_prefix, tmp_path, monkeypatch):
    data = [*SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]  # the subject is the fork, not GPT-2's tokens
    overrides = [*LIFECYCLE_TINY, *data, "train.steps=8", "train.eval_interval=4"]
    warm = run_ranks(CONFIG, [*overrides, f"output.dir={tmp_path / 'warm'}"])
    monkeypatch.setenv("MEGAFORMER_TEST_FRESH_RANKS", "1")
    assert not warm_ranks.can_fork(dict(os.environ))
    fresh = run_ranks(CONFIG, [*overrides, f"output.dir={tmp_path / 'fresh'}"])
    assert warm.returncode == 0 and fresh.returncode == 0, warm.stderr[-3000:] + fresh.stderr[-3000:]
    assert warm.forked and not fresh.forked
    got = fingerprint_runs.scalars(tmp_path / "warm" / "tensorboard")
    want = fingerprint_runs.scalars(tmp_path / "fresh" / "tensorboard")
    assert {"train/loss", "train/grad_norm", "valid/loss"} <= set(want), sorted(want)
    assert len(want["train/loss"]) == 8 and got == want


def test_a_test_sitecustomize_on_pythonpath_still_forks_and_other_paths_do_not(monkeypatch):
    """The CPU fp16 switch and the save-fault injector are run by the fork itself (their
    ``sitecustomize.py``); any other ``PYTHONPATH`` change is a start-up difference: fresh ranks."""
    monkeypatch.delenv("MEGAFORMER_TEST_FRESH_RANKS", raising=False)
    server = {"PYTHONPATH": str(REPO)}
    monkeypatch.setattr(warm_ranks, "_server_env", server)
    for site in warm_ranks.SITE_DIRS:
        assert warm_ranks.can_fork({"PYTHONPATH": os.pathsep.join([str(REPO), site])})
        assert warm_ranks._site_dirs({"PYTHONPATH": os.pathsep.join([str(REPO), site])})[0] == [site]
    assert not warm_ranks.can_fork({"PYTHONPATH": os.pathsep.join([str(REPO), "/elsewhere"])})
    assert not warm_ranks.can_fork({"PYTHONPATH": str(REPO), "LD_PRELOAD": "/lib/x.so"})
