"""Dataset statistics sidecars (``{prefix}.stats.json``): equal to a brute-force count on real text,
written by preprocess / merge / split, read back with clear errors, and the ``data_tools.stats`` CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import data_tools.stats as st
from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data_tools.stats import (
    DatasetStats,
    compute_stats,
    describe_tokenizer,
    mixture_unigram_entropy,
    read_stats,
    stats_path,
    write_stats,
)

EOD = 50256
BOOKS = ("pg42.txt.xz", "pg2097.txt.xz", "244-0.txt.xz")


def _inputs(shared_data: Path) -> list[Path]:
    """Real text of three kinds: three novels (one document per paragraph block), Dolma CC, C4."""
    books = [shared_data / "gutenberg-novels" / name for name in BOOKS]
    return [*books, shared_data / "dolma-cc-sample-jsonl", shared_data / "c4-sample-jsonl"]


def _brute_force(prefix: str, eod: int | None) -> dict:
    """The sidecar's facts by the simplest code: the whole .bin in memory, a loop over documents."""
    ds = IndexedDataset(prefix)
    tokens = np.fromfile(ds.bin_path, dtype=ds.dtype).astype(np.int64)
    counts = np.bincount(tokens) if tokens.size else np.zeros(0, np.int64)
    docs = [
        np.concatenate([ds.get(s) for s in ds.document_sequences(d)] or [[]]) for d in range(ds.num_documents)
    ]
    p = counts[counts > 0] / max(tokens.size, 1)
    return {
        "num_tokens": int(tokens.size),
        "num_documents": ds.num_documents,
        "unigram_counts": tuple(counts.tolist()),
        "max_token_id": int(tokens.max()) if tokens.size else -1,
        "min_token_id": int(tokens.min()) if tokens.size else -1,
        "documents_end_with_eod": None if eod is None else all(len(d) and d[-1] == eod for d in docs),
        "unigram_entropy": float(-(p * np.log(p)).sum()),
    }


def _assert_matches(stats: DatasetStats, expected: dict) -> None:
    for key, value in expected.items():
        if key == "unigram_entropy":
            assert stats.unigram_entropy == pytest.approx(value, rel=1e-12)
        else:
            assert getattr(stats, key) == value, key


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, gpt2_flags, run_cli, shared_data) -> str:
    """Real text preprocessed with 2 workers (GPT-2 BPE, --append-eod): ~2,500 documents."""
    out = tmp_path_factory.mktemp("corpus") / "real"
    r = run_cli(
        "data_tools.preprocess", "--input", *_inputs(shared_data), "--output-prefix", out, *gpt2_flags,
        "--append-eod", "--text-split-blank-lines", "--workers", 2,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"{out}_text_document.stats.json" in r.stdout
    return f"{out}_text_document"


def test_preprocess_sidecar_equals_brute_force_on_real_text(corpus, gpt2_files):
    stats = read_stats(corpus)
    expected = _brute_force(corpus, EOD)
    _assert_matches(stats, expected)
    assert stats.eod_token == EOD and stats.documents_end_with_eod is True
    assert stats.num_documents > 2000 and stats.max_token_id == EOD
    vocab, merges = gpt2_files
    assert stats.tokenizer == {
        "type": "GPT2BPETokenizer",
        "vocab_size": 50257,
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (vocab, merges)},
    }
    # The scan of an existing dataset gives the very same statistics as counting while writing.
    assert compute_stats(corpus, eod_token=EOD, tokenizer=stats.tokenizer) == stats
    # ... also when chunks and document blocks are tiny (document ends on every kind of boundary)
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(st, "_SCAN_TOKENS", 977)
        m.setattr(st, "_DOC_BLOCK", 13)
        assert compute_stats(corpus, eod_token=EOD, tokenizer=stats.tokenizer) == stats
    # and the file holds what it says, for people too
    obj = json.loads(Path(stats_path(corpus)).read_text())
    assert obj["unigram_entropy"] == pytest.approx(expected["unigram_entropy"])
    assert obj["format_version"] == 1 and len(obj["unigram_counts"]) == EOD + 1


def test_one_worker_and_no_eod_and_several_keys(tmp_path, shared_data, gpt2_flags, run_cli):
    """Without --append-eod nothing is claimed about EODs; each --json-keys output has its own sidecar."""
    src = shared_data / "dolma-cc-sample-jsonl"
    jsonl = tmp_path / "two_keys.jsonl"
    with open(jsonl, "w", encoding="utf-8") as out:
        for path in sorted(src.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                text = json.loads(line)["text"]
                out.write(json.dumps({"text": text, "title": text[:80]}) + "\n")
    r = run_cli(
        "data_tools.preprocess", "--input", jsonl, "--output-prefix", tmp_path / "k", *gpt2_flags,
        "--json-keys", "text", "title",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for key in ("text", "title"):
        prefix = f"{tmp_path}/k_{key}_document"
        stats = read_stats(prefix)
        assert stats.eod_token is None and stats.documents_end_with_eod is None
        _assert_matches(stats, _brute_force(prefix, None))
    assert (
        read_stats(f"{tmp_path}/k_title_document").num_tokens
        < read_stats(f"{tmp_path}/k_text_document").num_tokens
    )


def _write(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> str:
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(np.array(doc, dtype=np.int64))
    return str(prefix)


@pytest.mark.parametrize("chunk, block", [(1 << 22, 1 << 20), (5, 3), (1, 1), (7, 1000)])
def test_eod_check_detects_a_document_not_ending_in_eod(tmp_path, monkeypatch, chunk, block):
    """Random documents, one of them without its EOD (or empty): the check agrees with a loop."""
    monkeypatch.setattr(st, "_SCAN_TOKENS", chunk)
    monkeypatch.setattr(st, "_DOC_BLOCK", block)
    rng = np.random.default_rng(chunk * 31 + block)
    for trial in range(6):
        docs = [
            [*rng.integers(0, 99, int(rng.integers(0, 9))).tolist(), 99]
            for _ in range(int(rng.integers(1, 40)))
        ]
        bad = int(rng.integers(len(docs)))
        if trial % 3 == 1:
            docs[bad] = docs[bad][:-1]  # the EOD dropped (possibly leaving an empty document)
        elif trial % 3 == 2:
            docs[bad] = []  # an empty document has no EOD
        prefix = _write(tmp_path / f"t{trial}", docs)
        stats = compute_stats(prefix, eod_token=99)
        expected = _brute_force(prefix, 99)
        _assert_matches(stats, expected)
        assert stats.documents_end_with_eod is (trial % 3 == 0)
        _, first_bad = st._scan(IndexedDataset(prefix), 99, progress=False)
        assert first_bad == (None if trial % 3 == 0 else bad)


def test_eod_check_with_multi_sequence_and_empty_documents(tmp_path, reference_writer):
    """Documents of several sequences (Megatron with --split-sentences) end where their last one does."""
    docs = [[[1, 2], [3, 9]], [[4], [], [9]], [[5, 9], []], [], [[9]]]
    reference_writer(tmp_path / "multi", docs)
    stats = compute_stats(tmp_path / "multi", eod_token=9)
    assert stats.documents_end_with_eod is False  # document 3 is empty
    assert st._scan(IndexedDataset(tmp_path / "multi"), 9, progress=False)[1] == 3
    reference_writer(tmp_path / "good", [d for d in docs if d])
    assert compute_stats(tmp_path / "good", eod_token=9).documents_end_with_eod is True
    reference_writer(tmp_path / "empty", [])
    stats = compute_stats(tmp_path / "empty", eod_token=9)
    assert (stats.num_tokens, stats.max_token_id, stats.min_token_id, stats.unigram_counts) == (0, -1, -1, ())
    assert stats.documents_end_with_eod is True and stats.unigram_entropy == 0.0
    write_stats(tmp_path / "empty", stats)
    assert read_stats(tmp_path / "empty") == stats


def test_int32_tokens_and_ids_outside_the_vocabulary(tmp_path):
    prefix = _write(tmp_path / "big", [[70000, 5, 1], [70000, 1]], dtype=np.int32)
    stats = compute_stats(prefix, eod_token=1)
    assert stats.max_token_id == 70000 and stats.unigram_counts[70000] == 2 and stats.documents_end_with_eod
    with pytest.raises(
        DataFormatError, match="token id 70000 is outside the tokenizer's vocabulary of 50257"
    ):
        compute_stats(prefix, tokenizer={"type": "GPT2BPETokenizer", "vocab_size": 50257, "files": {}})


def test_missing_stale_and_unreadable_sidecars_name_file_and_command(tmp_path):
    prefix = _write(tmp_path / "d_text_document", [[1, 2, EOD], [3, EOD]])
    path = stats_path(prefix)
    assert path == f"{tmp_path}/d_text_document.stats.json"
    command = f"python -m data_tools.stats --data-prefix {prefix}"
    with pytest.raises(DataFormatError) as e:
        read_stats(prefix)
    assert path in str(e.value) and "missing" in str(e.value) and command in str(e.value)
    assert "--eod-token 50256" in str(e.value)

    write_stats(prefix, compute_stats(prefix, eod_token=EOD))
    assert read_stats(prefix).documents_end_with_eod is True
    _write(tmp_path / "d_text_document", [[1, 2, EOD], [3, EOD], [4, EOD]])  # rewritten after its sidecar
    with pytest.raises(DataFormatError) as e:
        read_stats(prefix)
    assert path in str(e.value) and "stale" in str(e.value) and command in str(e.value)
    assert "5 tokens in 2 documents" in str(e.value) and "7 tokens in 3 documents" in str(e.value)

    good = json.loads(compute_stats(prefix).to_json_text())
    for broken, why in [
        ("{not json", "unreadable"),
        (json.dumps({**good, "format_version": 2}), "format_version"),
        (json.dumps({k: v for k, v in good.items() if k != "unigram_counts"}), "'unigram_counts'"),
        (json.dumps({**good, "unigram_counts": [*good["unigram_counts"][:-1], 0, 1]}), "unigram_counts"),
        (json.dumps({**good, "num_tokens": "7"}), "'num_tokens'"),
        (json.dumps({**good, "eod_token": 5}), "documents_end_with_eod"),
    ]:
        Path(path).write_text(broken)
        with pytest.raises(DataFormatError) as e:
            read_stats(prefix)
        assert path in str(e.value) and why in str(e.value) and command in str(e.value), broken[:40]
    with pytest.raises(DataFormatError, match=r"nope\.idx"):
        read_stats(tmp_path / "nope")


def test_samples_unigram_entropy_reads_the_sidecars_not_the_tokens(tmp_path):
    """The training path's entropy is the sidecar's: a sidecar with other (consistent) counts wins."""
    from megaformer.data.gpt_dataset import BlendedSamples, GPTSamples, samples_unigram_entropy

    def samples(prefix: str) -> GPTSamples:
        ds = IndexedDataset(prefix)
        n = ds.num_tokens // 2
        return GPTSamples(ds, np.arange(ds.num_documents), np.zeros((n + 1, 2), np.int64), np.arange(n), 1)

    a = _write(tmp_path / "a", [[1, 2, 3, 4], [5, 6, 7, 8]])  # uniform over 8 ids
    b = _write(tmp_path / "b", [[9, 9, 9, 9], [9, 9, 9, 9]])  # one id
    with pytest.raises(DataFormatError, match=r"python -m data_tools\.stats --data-prefix"):
        samples_unigram_entropy(samples(a))
    write_stats(a, compute_stats(a))
    write_stats(b, compute_stats(b))
    assert samples_unigram_entropy(samples(a)) == pytest.approx(np.log(8))
    assert samples_unigram_entropy(samples(b)) == 0.0
    blend = BlendedSamples([samples(a), samples(b)], np.array([0, 1, 1, 1]), np.array([0, 0, 1, 2]))
    # grouping rule: H = 1/4 log 8 + 3/4 * 0 + H(1/4, 3/4)
    expected = 0.25 * np.log(8) - 0.25 * np.log(0.25) - 0.75 * np.log(0.75)
    assert samples_unigram_entropy(blend) == pytest.approx(expected)
    fake = compute_stats(b)  # b's sidecar now claims 8 tokens spread like a's: read, not recounted
    counts = tuple([0, 1, 1, 1, 1, 1, 1, 1, 1])
    write_stats(b, DatasetStats(8, 2, 8, 1, None, None, fake.tokenizer, counts))
    assert samples_unigram_entropy(samples(b)) == pytest.approx(np.log(8))


def test_mixture_unigram_entropy():
    def stats(counts):
        counts = tuple(int(c) for c in counts)
        present = [i for i, c in enumerate(counts) if c]
        return DatasetStats(sum(counts), 1, present[-1], present[0], None, None, {"type": "unknown"}, counts)

    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50, size=int(n)) for n in (20, 35, 7)]
    shares = np.array([0.5, 0.3, 0.2])
    mix = np.zeros(35)
    for share, c in zip(shares, parts):
        mix[: c.size] += share * c / c.sum()
    p = mix[mix > 0]
    expected = float(-(p * np.log(p)).sum())
    got = mixture_unigram_entropy([stats(c) for c in parts], shares)
    assert got == pytest.approx(expected, rel=1e-12)
    assert mixture_unigram_entropy([stats(c) for c in parts], shares * 10) == pytest.approx(
        expected
    )  # normalised
    assert mixture_unigram_entropy([stats(parts[1])], [1.0]) == pytest.approx(stats(parts[1]).unigram_entropy)
    with pytest.raises(ValueError, match="shares"):
        mixture_unigram_entropy([stats(c) for c in parts], [0.5, 0.5])
    with pytest.raises(ValueError, match=">= 0"):
        mixture_unigram_entropy([stats(c) for c in parts[:2]], [1.5, -0.5])


def test_stats_cli(corpus, tmp_path, gpt2_flags, run_cli):
    """For a dataset made before sidecars: the command the error names writes the same sidecar."""
    for suffix in (".bin", ".idx"):
        shutil.copyfile(corpus + suffix, f"{tmp_path}/old{suffix}")
    old = f"{tmp_path}/old"
    with pytest.raises(DataFormatError):
        read_stats(old)
    r = run_cli("data_tools.stats", "--data-prefix", old, "--eod-token", EOD, *gpt2_flags)
    assert r.returncode == 0, r.stderr
    assert (
        f"wrote {old}.stats.json" in r.stdout
        and "done:" in r.stdout
        and "documents end with EOD: yes" in r.stdout
    )
    assert read_stats(old) == read_stats(corpus)
    assert Path(f"{old}.stats.json").read_text() == Path(f"{corpus}.stats.json").read_text()
    # without a tokenizer: recorded as unknown; a wrong EOD id: recorded as not ending in it, and said
    r = run_cli("data_tools.stats", "--data-prefix", old, "--eod-token", 13)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "document 0 is the first" in r.stderr
    stats = read_stats(old)
    assert stats.tokenizer == {"type": "unknown"} and stats.documents_end_with_eod is False
    # bad input: exit 2 with one error line
    r = run_cli("data_tools.stats", "--data-prefix", tmp_path / "nope")
    assert r.returncode == 2 and "error:" in r.stderr and "nope" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("data_tools.stats", "--data-prefix", old, "--eod-token", 70000, *gpt2_flags)
    assert r.returncode == 2 and "--eod-token 70000 is outside" in r.stderr


def test_shards_merge_and_split_write_correct_sidecars(corpus, tmp_path, shared_data, gpt2_flags, run_cli):
    # Three shards of the same inputs; merged, they give the single run's bytes and sidecar.
    for i in range(3):
        r = run_cli(
            "data_tools.preprocess", "--input", *_inputs(shared_data), "--output-prefix", tmp_path / "s",
            *gpt2_flags, "--append-eod", "--text-split-blank-lines", "--num-shards", 3, "--shard-index", i,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    shards = [f"{tmp_path}/s-{i:05d}-of-00003_text_document" for i in range(3)]
    for shard in shards:
        _assert_matches(read_stats(shard), _brute_force(shard, EOD))
    r = run_cli(
        "data_tools.merge",
        "--input",
        f"{tmp_path}/s-*-of-00003_text_document",
        "--output-prefix",
        tmp_path / "m",
    )
    assert r.returncode == 0, r.stderr
    assert Path(f"{tmp_path}/m.bin").read_bytes() == Path(f"{corpus}.bin").read_bytes()
    assert read_stats(tmp_path / "m") == read_stats(corpus)

    # A shard finished before sidecars existed: a rerun keeps it and writes its sidecar from a scan.
    before = Path(stats_path(shards[1])).read_text()
    Path(stats_path(shards[1])).unlink()
    r = run_cli(
        "data_tools.preprocess", "--input", *_inputs(shared_data), "--output-prefix", tmp_path / "s",
        *gpt2_flags, "--append-eod", "--text-split-blank-lines", "--num-shards", 3, "--shard-index", 1,
    )  # fmt: skip
    assert r.returncode == 0 and "already finished" in r.stdout and "missing" in r.stderr, r.stderr
    assert Path(stats_path(shards[1])).read_text() == before

    # Merge with an input without a sidecar: that input is counted (EOD id from the others' sidecars).
    Path(stats_path(shards[2])).unlink()
    r = run_cli("data_tools.merge", "--input", *shards, "--output-prefix", tmp_path / "m2")
    assert r.returncode == 0, r.stderr
    assert "counting the tokens of" in r.stderr and shards[2] in r.stderr
    merged = read_stats(tmp_path / "m2")
    # the counted shard's tokenizer is unknown, so the merge's is too; everything else is the single run's
    assert merged.tokenizer == {"type": "unknown"}
    for key in ("num_tokens", "num_documents", "unigram_counts", "eod_token", "documents_end_with_eod"):
        assert getattr(merged, key) == getattr(read_stats(corpus), key), key

    # Split: both outputs' sidecars are their own brute-force counts, with the input's EOD and tokenizer.
    r = run_cli(
        "data_tools.split", "--data-prefix", corpus, "--holdout-tokens", 50_000, "--seed", 3,
        "--holdout-prefix", tmp_path / "valid", "--train-prefix", tmp_path / "train",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    source = read_stats(corpus)
    parts = [read_stats(tmp_path / "valid"), read_stats(tmp_path / "train")]
    for name, stats in zip(("valid", "train"), parts):
        _assert_matches(stats, _brute_force(f"{tmp_path}/{name}", EOD))
        assert stats.tokenizer == source.tokenizer and stats.eod_token == EOD
    total = np.zeros(EOD + 1, np.int64)
    for stats in parts:
        total[: stats.max_token_id + 1] += stats.counts()
    assert tuple(total.tolist()) == source.unigram_counts


def test_describe_tokenizer_hashes_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "m.model").write_bytes(b"one")
    (tmp_path / "b" / "m.model").write_bytes(b"two")
    info = describe_tokenizer("SentencePieceTokenizer", 32000, [tmp_path / "a" / "m.model"])
    assert info == {
        "type": "SentencePieceTokenizer",
        "vocab_size": 32000,
        "files": {"m.model": hashlib.sha256(b"one").hexdigest()},
    }
    # two files of one name are told apart by their paths
    both = describe_tokenizer("X", 5, [tmp_path / "a" / "m.model", tmp_path / "b" / "m.model"])
    assert sorted(both["files"]) == [str(tmp_path / "a" / "m.model"), str(tmp_path / "b" / "m.model")]
