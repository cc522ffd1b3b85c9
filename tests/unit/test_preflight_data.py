"""Preflight data checks of issue 12: token ids the sidecar does not vouch for (a .bin rewritten
after its sidecar), ids in the embedding's padding rows or past them at TP = 2, and a held-out
split smaller than one evaluation, all refused before any process group starts."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data_tools.stats import compute_stats, write_stats
from megaformer.config import load_config
from megaformer.training.preflight import run_preflight

EOD = 50256


def _dataset(prefix, n_docs: int = 40, doc_len: int = 50) -> str:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(n_docs):
            w.add_document(np.asarray([*rng.integers(0, 1000, size=doc_len), EOD], dtype=np.uint16))
    write_stats(prefix, compute_stats(prefix, eod_token=EOD))
    return str(prefix)


def _overwrite_token(prefix: str, position: int, value: int) -> None:
    """Write one id into .bin in place (same size: the sidecar's counts still match), with a
    modification time after the sidecar's."""
    with open(prefix + ".bin", "r+b") as f:
        f.seek(position * 2)
        f.write(np.uint16(value).tobytes())
    later = os.stat(prefix + ".stats.json").st_mtime_ns + 1_000_000_000
    os.utime(prefix + ".bin", ns=(later, later))


def _cfg(prefix: str, *extra: str):
    small_eval = ["model.seq_len=4", "train.eval_batches=1"]
    return load_config("configs/normformer-quickstart.yaml", [f"data.prefix={prefix}", *small_eval, *extra])


@pytest.mark.parametrize(
    ("token", "tp", "needle"),
    [
        (50300, 1, "inside the embedding's padding rows 50257..50303"),
        (50300, 2, "inside the embedding's padding rows 50257..50431"),
        (60000, 2, "past the embedding's 50432 rows (at parallel.tp_size > 1 such ids are masked"),
    ],
)
def test_ids_written_after_the_sidecar_are_found(tmp_path, token, tp, needle):
    prefix = _dataset(tmp_path / "data")
    run_preflight(_cfg(prefix, f"parallel.tp_size={tp}"), world_size=tp)  # clean before the edit
    _overwrite_token(prefix, 123, token)
    with pytest.raises(DataFormatError) as info:
        run_preflight(_cfg(prefix, f"parallel.tp_size={tp}"), world_size=tp)
    message = str(info.value)
    assert f"{prefix}.bin holds token id {token}" in message and "newer than its sidecar" in message
    assert needle in message and "retokenize" in message


def test_a_copied_dataset_with_a_clean_scan_passes(tmp_path):
    prefix = _dataset(tmp_path / "data")
    later = os.stat(prefix + ".stats.json").st_mtime_ns + 1_000_000_000
    os.utime(prefix + ".bin", ns=(later, later))  # as a copy that wrote .bin after the sidecar
    assert run_preflight(_cfg(prefix), world_size=1).stats[0].max_token_id == EOD


def test_sidecar_of_a_bigger_tokenizer_is_refused(tmp_path):
    prefix = _dataset(tmp_path / "data")
    tokenizer = {"type": "SentencePieceTokenizer", "vocab_size": 64000}
    stats = compute_stats(prefix, eod_token=EOD, tokenizer=tokenizer)
    write_stats(prefix, stats)
    with pytest.raises(DataFormatError, match=r"of 64000 entries .* set model.vocab_size=64000"):
        run_preflight(_cfg(prefix), world_size=1)


def test_heldout_split_smaller_than_one_evaluation(tmp_path):
    prefix = _dataset(tmp_path / "data")
    overrides = [f"data.prefix={prefix}", "model.seq_len=16", "train.eval_batches=2"]
    cfg = load_config("configs/normformer-quickstart.yaml", overrides)
    with pytest.raises(DataFormatError) as info:
        run_preflight(cfg, world_size=1)
    message = str(info.value)
    assert prefix in message and "2 of 40 documents, 102 tokens" in message and "makes 6 samples" in message
    assert "one evaluation reads 32" in message and "raise data.valid_fraction" in message
    assert len(IndexedDataset(prefix)) == 40


def _check_config(*args: str) -> tuple[int, str]:
    """``python -m megaformer.train --check-config ARGS`` (launch/pretrain.sh's check before any
    worker): (exit status, stderr ending in whether torch or DeepSpeed was imported)."""
    import subprocess
    import sys

    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('imported:', 'torch' in sys.modules or 'deepspeed' in sys.modules,"
        " file=sys.stderr))\n"
        "from megaformer.train import main\n"
        f"main({list(args)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_the_launchers_check_refuses_the_files_and_the_layout_before_any_worker(tmp_path):
    """Issue 38's suite and issue 39's new user: a missing or damaged dataset, a held-out split too
    small, an unwritable output.dir and a layout the job's processes cannot make are refused by
    ``--check-config`` (exit 2, the key and the fix named) without importing torch or DeepSpeed;
    a good config passes."""
    config = "configs/normformer-quickstart.yaml"
    good = _dataset(tmp_path / "good_text_document")
    base = ["model.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.eval_batches=1", f"output.dir={tmp_path / 'run'}"]  # fmt: skip
    check = ("--check-config", "--check-files")
    code, err = _check_config(*check, "--world-size", "2", config, *base, f"data.prefix={good}")
    assert code == 0 and err.strip().endswith("imported: False"), err
    cases = {
        "missing": ([f"data.prefix={tmp_path / 'none_text_document'}"], "none_text_document.bin"),
        "held-out": ([f"data.prefix={good}", "train.eval_batches=400"], "held-out"),
        "output.dir": ([f"data.prefix={good}", f"output.dir={good}.bin/run"], "output.dir="),
    }
    for name, (extra, needle) in cases.items():
        code, err = _check_config(*check, config, *base, *extra)
        assert code == 2 and needle in err and err.strip().endswith("imported: False"), (name, err)
    # the layout, with the job's process count: 4 samples per step cannot split over 3 ranks
    code, err = _check_config("--check-config", "--world-size", "3", config, *base, f"data.prefix={good}")
    assert code == 2 and "train.global_batch_size=4 is not divisible" in err, err
