"""Through launch/pretrain.sh on 2 processes: bad data fails fast, before the model is built; the
loader's worker count does not change a run; the validation loss does not depend on the dp size.
The runs on real text read the small-vocabulary novels (``small_vocab_prefix`` with ``SMALL_VOCAB``):
their subject is the data path, not the GPT-2 vocabulary (the test of ids beyond the vocabulary
keeps GPT-2's, which its message names)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tests.distributed.conftest import SMALL_VOCAB, read_scalars, run_pretrain, run_ranks
from tests.distributed.test_train_launch import CONFIG, TINY, _check

pytestmark = pytest.mark.slow  # multi-process training runs: outside `scripts/check.sh --fast`


def _fails_fast(prefix: str, tmp_path, *needles: str, vocab: tuple[str, ...] = ()) -> None:
    # Failing fast, shown by what happened rather than by a wall-clock bound (a loaded machine
    # would make one flaky): the preflight refused the data before a model or loader was built.
    # ``vocab``: the data's vocabulary overrides (SMALL_VOCAB for small_vocab_prefix's).
    overrides = [*TINY, *vocab, f"data.prefix={prefix}", "train.steps=10", f"output.dir={tmp_path}"]
    proc = run_pretrain(CONFIG, overrides)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]  # the configuration/data error's status
    assert "[megaformer] model:" not in out and "[megaformer] data:" not in out  # nothing was built
    for needle in needles:
        assert needle in out, (needle, out[-3000:])


def test_missing_prefix_fails_in_seconds_naming_it(tmp_path):
    _fails_fast(
        str(tmp_path / "nothere_text_document"), tmp_path, "nothere_text_document", "data_tools.preprocess"
    )


def test_corrupt_prefix_fails_in_seconds_naming_it(small_vocab_prefix, tmp_path):
    prefix = str(tmp_path / "corrupt_text_document")
    for ext in (".bin", ".idx", ".stats.json"):
        shutil.copy(small_vocab_prefix + ext, prefix + ext)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") // 2)  # a copy cut short
    _fails_fast(prefix, tmp_path, "corrupt_text_document.bin", vocab=tuple(SMALL_VOCAB))


def test_ids_beyond_the_vocabulary_fail_in_seconds_naming_the_fix(tmp_path):
    from data_tools.indexed_dataset import IndexedDatasetWriter
    from data_tools.stats import compute_stats, write_stats

    prefix = str(tmp_path / "wide_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(200):
            w.add_document(np.append(rng.integers(0, 60000, size=300), 50256).astype(np.uint16))
    write_stats(prefix, compute_stats(prefix, eod_token=50256))
    _fails_fast(prefix, tmp_path, "wide_text_document.bin holds token id", "model.vocab_size=50257")


def test_num_workers_does_not_change_the_losses(small_vocab_prefix, tmp_path):
    """data.num_workers = 0 and = 2: bitwise-equal training losses over 20 steps."""
    losses = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        proc = run_ranks(
            CONFIG,
            [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.steps=20",
             f"data.num_workers={workers}", "model.hidden_dropout=0.1", f"output.dir={out}",
             f"data.index_cache_dir={tmp_path / 'cache'}"],
        )  # fmt: skip
        _check(proc)
        assert f"loader workers {workers}" in proc.stdout
        losses[workers] = read_scalars(str(out / "tensorboard"))
    assert sorted(losses[0]["train/loss"]) == list(range(1, 21))
    assert losses[0]["train/loss"] == losses[2]["train/loss"]  # bitwise: same floats at every step
    assert losses[0]["valid/loss"] == losses[2]["valid/loss"]


@pytest.mark.parametrize("precision", ["fp32"])
def test_validation_loss_is_the_same_at_dp1_and_dp2(small_vocab_prefix, tmp_path, precision):
    """The same held-out samples at any data-parallel size: equal validation losses (<= 1e-6 rel)."""
    valid = {}
    for nproc in (1, 2):
        out = tmp_path / f"dp{nproc}"
        proc = run_ranks(
            CONFIG,
            [*TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.steps=10",
             "train.eval_interval=5", f"train.precision={precision}", f"output.dir={out}"],
            nproc=nproc,
        )  # fmt: skip
        _check(proc)
        valid[nproc] = read_scalars(str(out / "tensorboard"))["valid/loss"]
    assert sorted(valid[1]) == sorted(valid[2]) == [5, 10]
    for step in (5, 10):
        assert valid[2][step] == pytest.approx(valid[1][step], rel=1e-6), (step, valid)
