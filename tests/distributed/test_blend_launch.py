"""End to end, 2 ranks, with a blend of two real-text datasets and the index cache."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.distributed.conftest import DATA, REPO, read_scalars, run_ranks
from tests.distributed.test_train_launch import CONFIG, TINY, _check

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks): outside `scripts/check.sh --fast`

BOOKS_A = ("pg42.txt.xz", "244-0.txt.xz")  # two different sets of novels
BOOKS_B = ("pg2097.txt.xz", "pg345.txt.xz")


def _preprocess(out, books) -> str:
    paths = [DATA / "gutenberg-novels" / name for name in books]
    assert all(p.is_file() for p in paths), paths
    cmd = [
        sys.executable, "-m", "data_tools.preprocess", "--input", *map(str, paths),
        "--output-prefix", str(out), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(DATA / "gpt2-bpe" / "encoder.json"),
        "--merge-file", str(DATA / "gpt2-bpe" / "vocab.bpe"),
        "--append-eod", "--text-split-blank-lines", "--skip-bad-records", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return f"{out}_text_document"


@pytest.fixture(scope="module")
def blend_runs(tmp_path_factory):
    """Two 8-step runs of the same blended config sharing one index cache directory."""
    tmp = tmp_path_factory.mktemp("blend")
    a, b = _preprocess(tmp / "books_a", BOOKS_A), _preprocess(tmp / "books_b", BOOKS_B)
    overrides = [
        *TINY,
        f"data.blend=0.7 {a} 0.3 {b}",
        "train.steps=8",
        f"data.index_cache_dir={tmp / 'cache'}",
    ]
    runs = []
    for k in range(2):
        out = tmp / f"run{k}"
        proc = run_ranks(CONFIG, [*overrides, f"output.dir={out}"])
        _check(proc)
        runs.append((out, proc))
    return tmp / "cache", runs


def test_blend_trains_and_caches_indices(blend_runs):
    cache, ((out, proc), _) = blend_runs
    loss = read_scalars(str(out / "tensorboard"))["train/loss"]
    assert sorted(loss) == list(range(1, 9))
    assert all(math.isfinite(v) for v in loss.values())
    assert sum(loss[s] for s in (6, 7, 8)) / 3 < sum(loss[s] for s in (1, 2, 3)) / 3 - 0.3, loss
    # Both ranks build into the empty cache at once (atomic renames): rank 0, which logs, may find
    # some indices already built by rank 1; either way 4 indices (2 datasets x train/valid).
    found = re.search(r"sample-index cache: (\d+) hit, (\d+) built", proc.stdout)
    assert "data: 0.7 " in proc.stdout and found and int(found[1]) + int(found[2]) == 4, proc.stdout
    # per dataset a train and a validation index, three arrays each; no temporaries left
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 12 and all(f.endswith("_idx.npy") for f in files), files
    assert sum(f.startswith("books_a_") for f in files) == sum(f.startswith("books_b_") for f in files) == 6


def test_second_run_hits_the_cache(blend_runs):
    cache, ((out0, _), (out1, proc)) = blend_runs
    assert "sample-index cache: 4 hit, 0 built" in proc.stdout, proc.stdout
    assert len(list(cache.iterdir())) == 12
    # same data order: the same losses (same seed, same indices)
    first = read_scalars(str(out0 / "tensorboard"))["train/loss"]
    second = read_scalars(str(out1 / "tensorboard"))["train/loss"]
    assert second == pytest.approx(first, rel=1e-4)
