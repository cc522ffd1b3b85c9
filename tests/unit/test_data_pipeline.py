"""Issue 4's data pipeline on real text: shards + merge, resume, held-out split, blends, index cache."""

from __future__ import annotations

import json
import lzma
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest

from data_tools.blend import apportion, blend_indices, parse_blend
from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import IndexedDataset
from data_tools.sample_index import build_sample_index, load_or_build

REPO = Path(__file__).resolve().parents[2]
BPE = REPO / "data" / "gpt2-bpe"
BOOKS = sorted((REPO / "data" / "gutenberg-novels").glob("*.txt.xz"))
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(BPE / "encoder.json")]
GPT2 += ["--merge-file", str(BPE / "vocab.bpe"), "--append-eod"]


def _cli(module: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def jsonl_dir(tmp_path_factory) -> Path:
    """Four JSONL files of ~4 KB paragraph-bounded documents from three novels (~1,000 documents)."""
    out = tmp_path_factory.mktemp("jsonl")
    docs: list[str] = []
    for book in BOOKS[:3]:
        text = lzma.decompress(book.read_bytes()).decode("utf-8-sig").replace("\r\n", "\n")
        current = ""
        for para in (p.strip() for p in text.split("\n\n") if p.strip()):
            current = f"{current}\n\n{para}" if current else para
            if len(current) > 4000:
                docs.append(current)
                current = ""
    for k in range(4):
        with open(out / f"part-{k}.jsonl", "w", encoding="utf-8") as f:
            for d in docs[k::4]:
                f.write(json.dumps({"text": d}) + "\n")
    return out


@pytest.fixture(scope="module")
def single_run(jsonl_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("single") / "all"
    r = _cli("data_tools.preprocess", "--input", jsonl_dir, "--output-prefix", out, *GPT2, "--workers", 2)
    assert r.returncode == 0, r.stderr
    return f"{out}_text_document"


def test_shards_then_merge_give_the_single_run_bytes(jsonl_dir, single_run, tmp_path):
    for i in range(3):
        r = _cli(
            "data_tools.preprocess", "--input", jsonl_dir, "--output-prefix", tmp_path / "c4", *GPT2,
            "--num-shards", 3, "--shard-index", i,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    shards = sorted(p.name for p in tmp_path.glob("*.idx"))
    assert shards == [f"c4-{i:05d}-of-00003_text_document.idx" for i in range(3)]
    r = _cli(
        "data_tools.merge",
        "--input",
        f"{tmp_path}/c4-*-of-00003_text_document",
        "--output-prefix",
        tmp_path / "m",
    )
    assert r.returncode == 0, r.stderr
    for suffix in (".bin", ".idx"):
        assert Path(f"{tmp_path}/m{suffix}").read_bytes() == Path(single_run + suffix).read_bytes(), suffix
    # a rerun of a finished shard is skipped
    r = _cli(
        "data_tools.preprocess", "--input", jsonl_dir, "--output-prefix", tmp_path / "c4", *GPT2,
        "--num-shards", 3, "--shard-index", 1,
    )  # fmt: skip
    assert r.returncode == 0 and "already finished; skipping" in r.stdout


def test_shard_is_redone_when_its_inputs_change_or_its_manifest_is_missing(jsonl_dir, tmp_path):
    """A finished shard is kept only for the inputs and settings that made it (its .shard.json)."""
    inputs = tmp_path / "in"
    shutil.copytree(jsonl_dir, inputs)
    args = ["--input", inputs, "--output-prefix", tmp_path / "c4", *GPT2]
    args += ["--num-shards", 3, "--shard-index", 1]
    prefix = tmp_path / "c4-00001-of-00003_text_document"
    manifest = tmp_path / "c4-00001-of-00003.shard.json"
    assert _cli("data_tools.preprocess", *args).returncode == 0
    before = IndexedDataset(prefix).num_documents
    part1 = str((inputs / "part-1.jsonl").resolve())
    assert json.loads(manifest.read_text())["inputs"] == [[part1, ANY, ANY]]  # path, size, mtime
    with open(inputs / "part-1.jsonl", "a", encoding="utf-8") as f:  # shard 1 of 3 = part-1 only
        f.write(json.dumps({"text": "One more document, appended after the shard was written."}) + "\n")
    r = _cli("data_tools.preprocess", *args)
    assert r.returncode == 0 and "done:" in r.stdout, r.stderr
    assert "redoing shard 1 of 3: its inputs changed" in r.stderr
    assert IndexedDataset(prefix).num_documents == before + 1
    manifest.unlink()  # as if killed after the last .idx rename, before the manifest
    r = _cli("data_tools.preprocess", *args)
    assert r.returncode == 0 and "done:" in r.stdout and "c4-00001-of-00003.shard.json" in r.stderr
    r = _cli("data_tools.preprocess", *args, "--json-keys", "text")  # same settings: kept
    assert "already finished; skipping" in r.stdout


def test_killed_shard_looks_unfinished_and_reruns(tmp_path):
    """SIGKILL (no chance to clean up) mid-shard: only .tmp files remain, and a rerun completes it."""
    args = ["--input", *BOOKS, "--output-prefix", tmp_path / "g", *GPT2, "--text-split-blank-lines"]
    args += ["--num-shards", 2, "--shard-index", 0]
    proc = subprocess.Popen([sys.executable, "-m", "data_tools.preprocess", *map(str, args)], cwd=REPO)
    tmp_bin = tmp_path / "g-00000-of-00002_text_document.bin.tmp"
    deadline = time.monotonic() + 60
    while not tmp_bin.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the shard finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not list(tmp_path.glob("*.idx")), "a killed shard must not look finished"
    r = _cli("data_tools.preprocess", *args)
    assert r.returncode == 0 and "done:" in r.stdout, r.stderr
    assert IndexedDataset(tmp_path / "g-00000-of-00002_text_document").num_documents > 1000


def test_bad_shard_flags_and_corrupt_merge_input(jsonl_dir, single_run, tmp_path):
    r = _cli(
        "data_tools.preprocess",
        "--input",
        jsonl_dir,
        "--output-prefix",
        tmp_path / "x",
        *GPT2,
        "--num-shards",
        9,
    )
    assert r.returncode == 2 and "--shard-index" in r.stderr
    r = _cli(
        "data_tools.preprocess", "--input", jsonl_dir, "--output-prefix", tmp_path / "x", *GPT2,
        "--num-shards", 9, "--shard-index", 0,
    )  # fmt: skip
    assert r.returncode == 2 and "more than the 4 input files" in r.stderr
    bad = tmp_path / "bad_text_document"
    Path(f"{bad}.idx").write_bytes(Path(single_run + ".idx").read_bytes())
    Path(f"{bad}.bin").write_bytes(Path(single_run + ".bin").read_bytes()[:-2])  # truncated .bin
    r = _cli("data_tools.merge", "--input", single_run, bad, "--output-prefix", tmp_path / "m")
    assert r.returncode == 2 and f"{bad}.bin" in r.stderr and "truncated" in r.stderr
    assert not list(tmp_path.glob("m.*"))


def test_split_holds_out_whole_documents_by_seed(single_run, tmp_path):
    src = IndexedDataset(single_run)
    n = 100_000
    r = _cli(
        "data_tools.split", "--data-prefix", single_run, "--holdout-tokens", n, "--seed", 5,
        "--holdout-prefix", tmp_path / "valid", "--train-prefix", tmp_path / "train",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    valid, train = IndexedDataset(tmp_path / "valid"), IndexedDataset(tmp_path / "train")
    longest = int(src.sequence_lengths.max())
    assert n <= valid.num_tokens < n + longest  # at least N, by whole documents, not more than needed
    assert valid.num_tokens + train.num_tokens == src.num_tokens
    assert valid.num_documents + train.num_documents == src.num_documents
    # every document survives unchanged on exactly one side, in the input's order
    docs = [bytes(src.get(i)) for i in range(len(src))]
    got_valid = [bytes(valid.get(i)) for i in range(len(valid))]
    got_train = [bytes(train.get(i)) for i in range(len(train))]
    assert sorted(got_valid + got_train) == sorted(docs)
    assert got_train == [d for d in docs if d not in set(got_valid)]
    again = _cli(
        "data_tools.split", "--data-prefix", single_run, "--holdout-tokens", n, "--seed", 5,
        "--holdout-prefix", tmp_path / "v2", "--train-prefix", tmp_path / "t2",
    )  # fmt: skip
    assert again.returncode == 0
    assert Path(f"{tmp_path}/v2.bin").read_bytes() == Path(f"{tmp_path}/valid.bin").read_bytes()
    too_many = _cli(
        "data_tools.split", "--data-prefix", single_run, "--holdout-tokens", src.num_tokens, "--seed", 5,
        "--holdout-prefix", tmp_path / "v3", "--train-prefix", tmp_path / "t3",
    )  # fmt: skip
    assert too_many.returncode == 2 and "--holdout-tokens" in too_many.stderr


@pytest.mark.parametrize("total", [1, 7, 1000, 123_457])
def test_apportion_within_one_sample_and_interleave_evenly(total):
    rng = np.random.default_rng(total)
    for _ in range(20):
        w = rng.random(int(rng.integers(1, 6)))
        counts = apportion(w, total)
        assert counts.sum() == total
        assert np.all(np.abs(counts - w / w.sum() * total) < 1)
        which, k = blend_indices(counts)
        np.testing.assert_array_equal(np.bincount(which, minlength=w.size), counts)
        for d in range(w.size):  # each dataset's samples in order 0..n_d-1
            np.testing.assert_array_equal(k[which == d], np.arange(counts[d]))
        # every prefix of the blend is within 2 samples of its weights' share
        prefix_counts = np.cumsum(np.eye(w.size, dtype=np.int64)[which], axis=0)
        expected = np.outer(np.arange(1, total + 1), counts / total)
        assert np.abs(prefix_counts - expected).max() < 2


def test_blend_in_build_train_valid(single_run, tmp_path):
    """Two real datasets (the corpus and its held-out split) blended 0.7/0.3 with an index cache."""
    from megaformer.data.gpt_dataset import build_train_valid

    other = tmp_path / "other"
    r = _cli(
        "data_tools.split", "--data-prefix", single_run, "--holdout-tokens", 300_000, "--seed", 1,
        "--holdout-prefix", other, "--train-prefix", tmp_path / "rest",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    blend = f"0.7 {single_run} 0.3 {other}"
    cache = tmp_path / "cache"
    train, valid, info = build_train_valid("", 128, 1001, 20, 0.05, seed=3, blend=blend, cache_dir=str(cache))
    assert [b["train_samples"] for b in info["blend"]] == [701, 300]
    assert [b["valid_samples"] for b in info["blend"]] == [14, 6]
    assert len(train) == 1001 and np.bincount(train.dataset_index).tolist() == [701, 300]
    assert train[0].shape == (129,) and valid[19].shape == (129,)
    again, _, info2 = build_train_valid("", 128, 1001, 20, 0.05, seed=3, blend=blend, cache_dir=str(cache))
    assert all(b["index_cache_hit"] for b in info2["blend"])
    np.testing.assert_array_equal(
        np.stack([again[i] for i in range(50)]), np.stack([train[i] for i in range(50)])
    )
    with pytest.raises(DataFormatError, match="nope_text_document"):
        build_train_valid(
            "", 128, 10, 2, 0.05, seed=3, blend=f"0.5 {single_run} 0.5 {tmp_path}/nope_text_document"
        )


def test_negative_weight_is_a_config_error():
    """Refused by the preflight, before any process group starts (config loading reads only YAML)."""
    from megaformer.config import ConfigError
    from megaformer.config.load import load_config
    from megaformer.training.data_checks import data_prefixes

    with pytest.raises(ConfigError, match=r"data\.blend.*'b'.*-0\.3"):
        data_prefixes(load_config(None, ["data.blend=0.7 a -0.3 b"]))
    with pytest.raises(ConfigError, match="pairs of weight and prefix"):
        data_prefixes(load_config(None, ["data.blend=0.7 a 0.3"]))
    assert parse_blend("2 a 6 b") == [(0.25, "a"), (0.75, "b")]


def test_index_cache_hit_miss_and_build_index_cli(single_run, tmp_path):
    ds = IndexedDataset(single_run)
    kw = {"seq_len": 64, "num_samples": 500, "seed": 7, "cache_dir": tmp_path}
    first = load_or_build(ds, **kw)
    assert not first.cache_hit and all(p.is_file() for p in first.paths)
    second = load_or_build(ds, **kw)
    assert second.cache_hit and isinstance(second.sample_idx, np.memmap)
    for a, b in zip(
        (first.doc_idx, first.sample_idx, first.shuffle_idx),
        (second.doc_idx, second.sample_idx, second.shuffle_idx),
    ):
        np.testing.assert_array_equal(a, b)
    assert first.doc_idx.dtype == np.int32 and first.sample_idx.dtype == np.int32
    # each parameter that shapes the indices is in the key
    for change in ({"seed": 8}, {"seq_len": 65}, {"num_samples": 501}, {"shuffle": False}):
        assert not load_or_build(ds, **{**kw, **change}).cache_hit, change
    # the values equal a direct build
    direct = build_sample_index(np.arange(ds.num_documents), ds.document_lengths(), 64, 500, 7)
    np.testing.assert_array_equal(direct[1], first.sample_idx)
    # the CLI builds ahead; the run's call then hits
    r = _cli(
        "data_tools.build_index", "--data-prefix", single_run, "--seq-len", 64, "--seed", 9,
        "--num-epochs", 1, "--output-dir", tmp_path / "ahead",
    )  # fmt: skip
    assert r.returncode == 0 and "built" in r.stdout, r.stderr
    n = (ds.num_tokens - 1) // 64
    hit = load_or_build(ds, seq_len=64, num_samples=n, seed=9, cache_dir=tmp_path / "ahead")
    assert hit.cache_hit
    # held-out documents chosen by another seed (data.split_seed): the CLI builds what the run reads
    r = _cli(
        "data_tools.build_index", "--data-prefix", single_run, "--seq-len", 64, "--seed", 9,
        "--valid-fraction", 0.1, "--split-seed", 3, "--num-samples", 300, "--output-dir", tmp_path / "split",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    from megaformer.data.gpt_dataset import build_train_valid

    _, _, info = build_train_valid(
        single_run, 64, 300, 1, 0.1, 9, split_seed=3, cache_dir=str(tmp_path / "split")
    )
    assert (info["index_cache_hits"], info["index_cache_builds"]) == (1, 1)  # training hit, held-out built
    _, _, info = build_train_valid(
        single_run, 64, 300, 1, 0.1, 9, split_seed=4, cache_dir=str(tmp_path / "split")
    )
    assert info["index_cache_hits"] == 0  # other held-out documents: another training index
    # --split-seed -1 (a config's default) is --seed, as data.split_seed=-1 is train.seed
    r = _cli(
        "data_tools.build_index", "--data-prefix", single_run, "--seq-len", 64, "--seed", 9,
        "--valid-fraction", 0.1, "--split-seed", -1, "--num-samples", 300, "--output-dir", tmp_path / "own",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    _, _, info = build_train_valid(single_run, 64, 300, 1, 0.1, 9, cache_dir=str(tmp_path / "own"))
    assert info["index_cache_hits"] == 1


def test_concurrent_builders_agree(single_run, tmp_path):
    """Two processes building the same index into one directory at once: both succeed, one result."""
    cmd = [sys.executable, "-m", "data_tools.build_index", "--data-prefix", single_run, "--seq-len", "32"]
    cmd += ["--seed", "1", "--num-samples", "200000", "--output-dir", str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3 and all(f.suffix == ".npy" for f in files), files  # no temporaries left
    ds = IndexedDataset(single_run)
    ref = build_sample_index(np.arange(ds.num_documents), ds.document_lengths(), 32, 200000, 1)
    for f, a in zip(
        sorted(files, key=lambda p: ["doc", "sample", "shuffle"].index(p.stem.split("_")[-2])), ref
    ):
        np.testing.assert_array_equal(np.load(f), a)


def test_blockwise_permutation_and_sample_starts_at_scale(monkeypatch):
    """The large-size path (keyed permutation, blocked sample starts) forced at small sizes: doc,
    sample and shuffle indices agree with a brute-force walk of the document stream."""
    import data_tools.sample_index as si

    monkeypatch.setattr(si, "_PLAIN_SHUFFLE_MAX", 0)
    monkeypatch.setattr(si, "_PERM_BLOCK", 1000)
    monkeypatch.setattr(si, "_BLOCK", 777)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 5000).astype(np.int32)
    ids = np.sort(rng.choice(5000, 3001, replace=False))  # a subset, e.g. a train split
    seq_len, n = 48, 30000  # about 2.8 epochs
    doc_idx, sample_idx, shuffle_idx = build_sample_index(ids, lengths, seq_len, n, seed=4)
    epochs = doc_idx.size // ids.size
    assert epochs * ids.size == doc_idx.size and epochs >= 3
    for e in range(epochs):  # each epoch is a fresh permutation of the selected documents
        part = doc_idx[e * ids.size : (e + 1) * ids.size]
        np.testing.assert_array_equal(np.sort(part), ids)
        assert not np.array_equal(part, ids)
    # each chunk of the order (here: each epoch) is a permutation of its own samples, in stream order
    chunks = list(si.order_chunks(n, int(lengths[ids].sum()), seq_len))
    np.testing.assert_array_equal(np.sort(shuffle_idx[: chunks[-1][1]]), np.arange(chunks[-1][1]))
    assert len(np.unique(shuffle_idx)) == n and shuffle_idx[chunks[-1][1] :].min() >= chunks[-1][1]
    ends = np.cumsum(lengths[doc_idx], dtype=np.int64)
    starts = np.arange(len(sample_idx), dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts, side="right")  # brute force: the document holding each start
    np.testing.assert_array_equal(sample_idx[:, 0], pos)
    np.testing.assert_array_equal(sample_idx[:, 1], starts - (ends[pos] - lengths[doc_idx[pos]]))
    again = build_sample_index(ids, lengths, seq_len, n, seed=4)
    for a, b in zip((doc_idx, sample_idx, shuffle_idx), again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(build_sample_index(ids, lengths, seq_len, n, seed=5)[2], shuffle_idx)


def test_random_permutation_is_a_uniform_looking_bijection():
    from data_tools.sample_index import random_permutation

    n = 3_000_017  # above the plain-permutation size, not a power of two (cycle walking)
    p = random_permutation(n, np.random.default_rng(1), np.int32)
    assert p.dtype == np.int32 and np.bincount(p, minlength=n).max() == 1
    # where the first 100k ids land: spread evenly over 100 bins (chi-square, 99 dof, p ~ 1e-6 at 170)
    counts = np.bincount(p[:100_000] * 100 // n, minlength=100)
    assert ((counts - 1000) ** 2 / 1000).sum() < 170
    # neighbours are not kept together
    assert np.median(np.abs(np.diff(p[:100_000].astype(np.int64)))) > n // 5
    assert not np.array_equal(p, random_permutation(n, np.random.default_rng(2), np.int32))
