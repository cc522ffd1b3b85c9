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
