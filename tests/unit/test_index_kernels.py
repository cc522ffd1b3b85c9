"""The compiled sample-index build (numba, ``data_tools.index_kernels``) against the numpy reference
(``build_sample_index(..., compiled=False)``): the same three arrays bit for bit (values, dtypes,
shapes) over seeds, sequence lengths, document selections, run lengths from one sample to several
epochs (ending inside an epoch or at its end), shuffled or not; cache files written by one are hits
for the other; without numba the numpy build runs, after one note."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import data_tools.sample_index as si
from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data_tools.sample_index import build_sample_index, load_or_build

pytest.importorskip("numba")


def _assert_same(reference: tuple, compiled: tuple) -> None:
    for name, a, b in zip(("doc_idx", "sample_idx", "shuffle_idx"), reference, compiled):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert np.array_equal(a, b), name


def _both(*args, **kwargs) -> tuple[tuple, tuple]:
    """(numpy's arrays, the compiled build's arrays)."""
    reference = build_sample_index(*args, **kwargs, compiled=False)
    return reference, build_sample_index(*args, **kwargs, compiled=True)


@pytest.fixture
def small_paths(monkeypatch):
    """The large-size paths at small sizes: the keyed permutation above 64 elements (with cycle
    walking), order chunks of 2,000 samples, blocks of 37 documents in numpy's sample starts."""
    monkeypatch.setattr(si, "_PLAIN_SHUFFLE_MAX", 64)
    monkeypatch.setattr(si, "ORDER_CHUNK", 2000)
    monkeypatch.setattr(si, "_PERM_BLOCK", 50)
    monkeypatch.setattr(si, "_BLOCK", 37)


LENGTHS = np.random.default_rng(0).integers(1, 100, 3000).astype(np.int32)
TOKENS = int(LENGTHS.sum())


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 7])
@pytest.mark.parametrize("seq_len", [1, 5, 64, 2048])
@pytest.mark.parametrize("epochs", [None, 0.5, 1.0, 2.7])  # None: a single sample
def test_compiled_equals_numpy_all_documents(small_paths, seed, seq_len, epochs):
    num_samples = 1 if epochs is None else max(1, int(epochs * TOKENS) // seq_len)
    for doc_ids in (None, np.arange(LENGTHS.size)):
        for shuffle in (True, False):
            reference, compiled = _both(doc_ids, LENGTHS, seq_len, num_samples, seed, shuffle)
            _assert_same(reference, compiled)


@pytest.mark.parametrize(
    "selection",
    ["train-split", "unsorted", "repeated", "one-document"],
)
@pytest.mark.parametrize("epochs", [0.3, 1.0, 3.5])
def test_compiled_equals_numpy_selected_documents(small_paths, selection, epochs):
    rng = np.random.default_rng(5)
    doc_ids = {
        "train-split": si.split_documents(LENGTHS.size, 0.1, seed=3)[0],
        "unsorted": rng.permutation(LENGTHS.size)[:1700],
        "repeated": rng.integers(0, LENGTHS.size, 900),  # a document may be drawn twice
        "one-document": np.array([int(np.argmax(LENGTHS))]),
    }[selection]
    tokens = int(LENGTHS[doc_ids].sum())
    for seq_len in (3, 40):
        num_samples = max(1, int(epochs * tokens) // seq_len)
        for shuffle in (True, False):
            reference, compiled = _both(doc_ids, LENGTHS, seq_len, num_samples, seed=11, shuffle=shuffle)
            _assert_same(reference, compiled)


@pytest.mark.parametrize("doc_ids", [None, np.array([5, 9])])
def test_too_little_data_is_the_same_error(doc_ids):
    lengths = np.array([3, 4, 2, 5, 1, 6, 2, 2, 1, 7], dtype=np.int32)
    messages = []
    for compiled in (False, True):
        with pytest.raises(si.DataFormatError) as raised:
            build_sample_index(doc_ids, lengths, 33, 10, seed=0, compiled=compiled)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] and "fewer than one sample" in messages[0]


def test_compiled_equals_numpy_int64_and_int64_lengths(small_paths, monkeypatch):
    """Indices past 2**31 (here: int64 forced) and int64 document lengths (build_index's splits)."""
    monkeypatch.setattr(si, "_index_dtype", lambda n: np.int64)
    lengths = LENGTHS.astype(np.int64)
    for doc_ids in (None, si.split_documents(lengths.size, 0.2, seed=1)[0]):
        reference, compiled = _both(doc_ids, lengths, 50, 40_000, seed=2)
        assert reference[0].dtype == np.int64
        _assert_same(reference, compiled)


def test_compiled_equals_numpy_at_the_real_sizes():
    """The real constants: 1.2M documents (a keyed permutation, not rng.permutation), and an
    order of more than one 4M-sample chunk."""
    lengths = np.random.default_rng(1).integers(1, 12, 1_200_000).astype(np.int32)
    reference, compiled = _both(None, lengths, 1, 5_000_000, seed=9)
    assert compiled[2].size == 5_000_000 and si.ORDER_CHUNK < 5_000_000
    _assert_same(reference, compiled)


@pytest.mark.parametrize("n", [2**20 + 1, 3_000_017, 2**32 + 3, 2**33 + 5])
def test_the_bijection_matches_numpy_beyond_32_bits(n):
    """The compiled bijection (uint64 arithmetic) against numpy's (uint32 up to 2**32 elements,
    uint64 beyond) on stretches at the start, the middle and the end of very large ranges."""
    from data_tools import index_kernels

    keys = si._permutation_keys(n, np.random.default_rng(n))
    _, mask, shift, adds, muls = keys
    u64 = np.uint64
    for first in (0, n // 2 - 1000, n - 3000):
        count = min(3000, n - first)
        out = np.empty(count, dtype=np.int64)
        no_ids = np.zeros(0, dtype=np.int64)
        args = (u64(n), adds.astype(u64), muls.astype(u64), u64(mask), u64(shift), 0, no_ids)
        index_kernels.permutation(out, first, count, *args)
        np.testing.assert_array_equal(out, si._bijection(first, first + count, n, keys).astype(np.int64))


def _dataset(tmp_path):
    prefix = tmp_path / "c_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in LENGTHS[:500]:
            w.add_document(np.arange(n) % 50000)
    return IndexedDataset(prefix)


def test_cache_files_of_either_build_are_hits_for_the_other(tmp_path, monkeypatch):
    """Same cache key and file format: an index cached by the numpy build loads for the compiled
    one (and equals what the compiled build makes)."""
    ds = _dataset(tmp_path)
    kw = {"seq_len": 32, "num_samples": 3000, "seed": 8, "cache_dir": tmp_path / "cache"}
    monkeypatch.setattr(si, "_KERNELS", {})
    monkeypatch.setenv("MEGAFORMER_INDEX_NUMPY", "1")
    built = load_or_build(ds, **kw)
    assert not built.cache_hit and si.compiled_kernels() is None
    monkeypatch.setattr(si, "_KERNELS", {})
    monkeypatch.delenv("MEGAFORMER_INDEX_NUMPY")
    loaded = load_or_build(ds, **kw)
    assert loaded.cache_hit and loaded.paths == built.paths and si.compiled_kernels() is not None
    fresh = build_sample_index(None, ds.document_lengths(np.int32), 32, 3000, 8, compiled=True)
    _assert_same((loaded.doc_idx, loaded.sample_idx, loaded.shuffle_idx), fresh)


def test_cache_files_are_byte_identical_and_saved_while_building(tmp_path, monkeypatch, capsys):
    """load_or_build with the compiled build (its arrays saved on a thread as each is final) writes
    the same .npy bytes, under the same names, as with numpy; an unwritable cache directory gives
    the warning and the index from memory, on either path."""
    ds = _dataset(tmp_path)
    kw = {"seq_len": 16, "num_samples": 9000, "seed": 3}
    monkeypatch.setattr(si, "_COMPILED_FROM", 0)
    files = {}
    for path in ("numpy", "compiled"):
        monkeypatch.setattr(si, "_KERNELS", {})
        if path == "numpy":
            monkeypatch.setenv("MEGAFORMER_INDEX_NUMPY", "1")
        else:
            monkeypatch.delenv("MEGAFORMER_INDEX_NUMPY", raising=False)
        built = load_or_build(ds, **kw, cache_dir=tmp_path / path)
        assert not built.cache_hit and (si.compiled_kernels() is not None) == (path == "compiled")
        files[path] = {p.name: p.read_bytes() for p in built.paths}
        (tmp_path / f"{path}-file").write_text("a file, not a directory")
        unsaved = load_or_build(ds, **kw, cache_dir=tmp_path / f"{path}-file" / "cache")
        assert unsaved.paths is None and "warning: cannot save the sample index" in capsys.readouterr().err
        in_memory = (unsaved.doc_idx, unsaved.sample_idx, unsaved.shuffle_idx)
        _assert_same((built.doc_idx, built.sample_idx, built.shuffle_idx), in_memory)
    assert files["numpy"] == files["compiled"] and len(files["numpy"]) == 3


def test_small_indices_take_numpy_without_importing_numba(monkeypatch):
    monkeypatch.setattr(si, "_KERNELS", {})
    build_sample_index(None, LENGTHS, 16, 500, seed=1)
    assert si._KERNELS == {}  # not even looked for
    monkeypatch.setattr(si, "_COMPILED_FROM", 1000)
    build_sample_index(None, LENGTHS, 16, 500, seed=1)
    assert si._KERNELS["kernels"] is not None


def test_without_numba_the_numpy_build_runs_after_one_note(monkeypatch, capsys):
    monkeypatch.setattr(si, "_KERNELS", {})
    monkeypatch.setattr(si, "_COMPILED_FROM", 0)
    monkeypatch.setitem(sys.modules, "data_tools.index_kernels", None)  # import raises ImportError
    first = build_sample_index(None, LENGTHS, 16, 500, seed=1)
    second = build_sample_index(None, LENGTHS, 16, 500, seed=1)
    _assert_same(first, second)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith("note: numba is not usable here (ModuleNotFoundError")
    with pytest.raises(RuntimeError, match="numba is not usable"):
        build_sample_index(None, LENGTHS, 16, 500, seed=1, compiled=True)
