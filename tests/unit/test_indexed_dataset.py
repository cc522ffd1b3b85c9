"""The .bin/.idx writer and reader: Megatron's exact bytes, dtype rules, and every validation error."""

from __future__ import annotations

import os
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from data_tools.indexed_dataset import (
    DTYPE_CODES,
    DataFormatError,
    IndexedDataset,
    IndexedDatasetWriter,
    open_dataset,
    opened_once,
    optimal_dtype,
)

DOCS = [[1, 2, 3], [50256], [7] * 10, [65535, 0, 42]]


def _write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)


def test_dtype_codes_and_optimal_dtype():
    assert {c: d.name for c, d in DTYPE_CODES.items()} == {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }
    assert optimal_dtype(50257) == np.uint16  # GPT-2
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32  # Megatron's threshold, not 65536
    assert optimal_dtype(128256) == np.int32


def test_round_trip_and_exact_header(tmp_path, reference_writer):
    prefix = tmp_path / "ds"
    _write(prefix)
    idx = (tmp_path / "ds.idx").read_bytes()
    n = len(DOCS)
    # magic, u64 version 1, u8 dtype code 8 (uint16), u64 N, u64 D = N + 1
    assert idx[:34] == b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + b"\x08" + struct.pack("<QQ", n, n + 1)
    assert len(idx) == 34 + 4 * n + 8 * n + 8 * (n + 1)
    assert struct.unpack_from(f"<{n}i", idx, 34) == (3, 1, 10, 3)
    assert struct.unpack_from(f"<{n}q", idx, 34 + 4 * n) == (0, 6, 8, 28)  # byte offsets
    assert struct.unpack_from(f"<{n + 1}q", idx, 34 + 12 * n) == (0, 1, 2, 3, 4)

    reference_writer(tmp_path / "ref", [[d] for d in DOCS])
    assert idx == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "ds.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()

    ds = IndexedDataset(str(prefix))
    assert len(ds) == n and ds.num_documents == n and ds.num_tokens == 17
    assert ds.dtype == np.uint16
    assert ds.sequence_lengths.dtype == np.int32 and ds.sequence_pointers.dtype == np.int64
    for i, d in enumerate(DOCS):
        np.testing.assert_array_equal(ds.get(i), d)
    np.testing.assert_array_equal(ds.get(2, offset=3, length=4), [7] * 4)
    np.testing.assert_array_equal(ds.get(3, offset=1), [0, 42])
    np.testing.assert_array_equal(ds.get(-1), DOCS[-1])
    assert isinstance(ds.get(0), np.memmap) and not ds.get(0).flags.writeable  # a view, no copy
    np.testing.assert_array_equal(ds.document_lengths(), [3, 1, 10, 3])
    with pytest.raises(IndexError):
        ds.get(4)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_pickles_by_prefix_not_by_tokens(tmp_path):
    _write(tmp_path / "ds", [[5] * 100_000])
    ds = IndexedDataset(tmp_path / "ds")
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the 200 kB of tokens are not in it
    np.testing.assert_array_equal(pickle.loads(blob).get(0, 99_990), [5] * 10)


def test_int32_for_large_vocabularies(tmp_path, reference_writer):
    docs = [[70000, 1], [128255]]
    _write(tmp_path / "big", docs, optimal_dtype(128256))
    assert (tmp_path / "big.idx").read_bytes()[17] == 4  # dtype code int32
    reference_writer(tmp_path / "ref", [[d] for d in docs], np.int32)
    assert (tmp_path / "big.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "big.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype == np.int32
    np.testing.assert_array_equal(ds.get(0), [70000, 1])


def test_writer_refuses_ids_that_do_not_fit(tmp_path):
    with (
        pytest.raises(ValueError, match="do not fit uint16"),
        IndexedDatasetWriter(tmp_path / "w", np.uint16) as w,
    ):
        w.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []  # the failed writer removed its temporaries


def test_reads_multi_sequence_documents(tmp_path, reference_writer):
    # Megatron's --split-sentences output: several sequences per document.
    reference_writer(tmp_path / "s", [[[1, 2], [3]], [[4, 5, 6]], [[7], [8], [9, 9]]])
    ds = IndexedDataset(tmp_path / "s")
    assert len(ds) == 6 and ds.num_documents == 3
    assert ds.document_sequences(2) == range(3, 6)
    np.testing.assert_array_equal(ds.document_lengths(), [3, 3, 4])


def test_empty_dataset(tmp_path):
    _write(tmp_path / "e", [])
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.num_documents == 0


def test_temporaries_until_finalize_and_abort(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "t", np.uint16)
    w.add_document([1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin.tmp"]
    w.abort()
    assert list(tmp_path.iterdir()) == []

    w = IndexedDatasetWriter(tmp_path / "t", np.uint16)
    w.add_document([1, 2])
    w.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]

    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetWriter(tmp_path / "u", np.uint16) as w:
        w.add_document([3])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]


# --------------------------------------------------------------------------- validation


def _patch(path, offset, data: bytes):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.fixture
def good(tmp_path):
    _write(tmp_path / "ds")
    return tmp_path / "ds"


def _expect_error(prefix, *fragments):
    with pytest.raises(DataFormatError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_wrong_magic(good):
    _patch(good.with_suffix(".idx"), 0, b"TNTIDX\x00\x00\x00")
    _expect_error(good, "ds.idx", "expected magic b'MMIDIDX", "found b'TNTIDX")


def test_wrong_version(good):
    _patch(good.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    _expect_error(good, "ds.idx", "expected index version 1, found 2")


def test_bad_dtype_code(good):
    _patch(good.with_suffix(".idx"), 17, b"\x09")
    _expect_error(good, "ds.idx", "expected a dtype code in [1, 2, 3, 4, 5, 6, 7, 8], found 9")


def test_truncated_idx(good):
    idx = good.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    _expect_error(good, "ds.idx", "expected 122 bytes", "found 114 bytes")
    idx.write_bytes(b"MMIDIDX")
    _expect_error(good, "ds.idx", "expected a header of 34 bytes, found a file of 7 bytes")


def test_truncated_bin(good):
    bin_path = good.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    _expect_error(good, "ds.bin", "expected 34 bytes", "found 32 bytes", "truncated")
    bin_path.write_bytes(bin_path.read_bytes() + b"\x00" * 6)
    _expect_error(good, "ds.bin", "expected 34 bytes", "found 38 bytes")


def test_pointers_disagree_with_lengths(good):
    # pointer of sequence 2 (after lengths 3 and 1, uint16) must be 8; make it 10
    _patch(good.with_suffix(".idx"), 34 + 4 * 4 + 8 * 2, struct.pack("<q", 10))
    _expect_error(good, "ds.idx", "sequence 2", "expected byte pointer 8", "found 10")


def test_lengths_disagree_with_pointers(good):
    _patch(good.with_suffix(".idx"), 34 + 4 * 1, struct.pack("<i", 2))  # sequence 1: length 1 -> 2
    _expect_error(good, "ds.idx", "sequence 2", "expected byte pointer 10", "found 8")


def test_document_indices_not_monotone(good):
    _patch(good.with_suffix(".idx"), 34 + 12 * 4 + 8 * 2, struct.pack("<q", 0))  # 0 1 0 3 4
    _expect_error(good, "ds.idx", "expected non-decreasing document indices", "found 1 then 0")
    _patch(good.with_suffix(".idx"), 34 + 12 * 4 + 8 * 4, struct.pack("<q", 3))  # last 3 != N
    _expect_error(good, "ds.idx", "expected document indices from 0 to 4", "last 3")


def test_open_dataset_opens_once_per_block_and_afresh_outside(tmp_path, monkeypatch):
    """A run (trainer.train) opens each dataset once: inside ``opened_once`` every open_dataset of a
    prefix (however spelled) is the same checked dataset; outside, each call opens the files again,
    so a file rewritten between two calls is seen."""
    prefix = tmp_path / "d"
    _write(prefix)
    opened = []
    real_init = IndexedDataset.__init__

    def counted(self, p):
        opened.append(os.fspath(p))
        real_init(self, p)

    monkeypatch.setattr(IndexedDataset, "__init__", counted)
    assert open_dataset(prefix) is not open_dataset(prefix) and len(opened) == 2
    with opened_once():
        first = open_dataset(prefix)
        with opened_once():  # nested: the run's block
            assert open_dataset(str(prefix)) is first
        assert open_dataset(tmp_path / "." / "d") is first
    assert len(opened) == 3
    _patch(prefix.with_suffix(".idx"), 0, b"XXXX")  # damaged after the block: seen at once
    with pytest.raises(DataFormatError, match="magic"):
        open_dataset(prefix)


def test_the_training_code_opens_datasets_through_open_dataset():
    """Every open on a run's path goes through open_dataset, so ``opened_once`` covers all of them
    (the preflight, data checks, held-out split and sample indices reopened the index 11 times)."""
    root = Path(__file__).resolve().parents[2] / "megaformer"
    direct = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<![\w.])IndexedDataset\(", line)
    ]
    assert direct == []
