"""Issue 24's faster preprocessing gives what the plain reader gives: orjson's fast path, workers
reading byte ranges of uncompressed JSONL themselves (bad records numbered by their line in the
file, across ranges), the pool's read-ahead. The reference is each line decoded by ``json`` alone
and numbered from the start of its file, as before: the same documents, tokens, skip counts and
messages, for every kind of record json and orjson disagree on, with 1 and 2 workers, compressed or
not, with orjson or not.
Also the cache of checked GPT-2 vocabularies (``data_tools.bpe_cache``): the same ranks and
tokenizer, a damaged cache file ignored, bad files failing as before and never cached."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_tools import bpe_cache, fastjson, preprocess
from data_tools.indexed_dataset import IndexedDataset
from data_tools.tokenizer import TokenizerError, build_tokenizer, load_gpt2_bpe

# One line each: records on which json and orjson differ, or that are bad in some way.
ODD_LINES = [
    b'{"text": "NaN elsewhere is fine for json", "score": NaN}',  # orjson refuses NaN
    b'{"text": "a huge number elsewhere", "n": 123456789012345678901234567890}',
    b'{"text": 123456789012345678901234567890}',  # not a string: an int for json, a float for orjson
    b'{"text": "lone \\ud800 surrogate"}',  # invalid UTF-8 once encoded
    b'{"text": "a pair \\ud83d\\ude00 is fine"}',
    b'{"text": "bad bytes \xff\xfe here"}',
    b'{"text": "   \\n\\t "}',  # blank text
    b'{"text": ""}',
    b'{"txt": "missing key"}',
    b'{"text": null}',
    b'["not", "an", "object"]',
    b'{"text": "truncated',
    b'{"text": "duplicate", "text": "keys: the last one counts"}',
    b'{"text": "deep", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # past orjson's depth limit
    b'{"text": "caf\xc3\xa9 na\xc3\xafve \xe2\x80\x94 non-ASCII"}',
    b"   ",  # a blank line
    b"",
    b'{"text": "carriage return line"}\r',
]


def _corpus(path: Path, long_line: bool = True) -> None:
    """~40 KB of JSONL: ordinary documents with the odd lines spread through it (so that they fall
    in different ranges of a few KB), a BOM first, a line longer than a range, no final newline."""
    rng = np.random.default_rng(0)
    words = ["the", "Sea", "of", "ships", "’tis", "naïve", "42", "!", "\t", "end."]
    lines = []
    for i in range(300):
        text = " ".join(rng.choice(words, int(rng.integers(3, 30))))
        lines.append(json.dumps({"text": text, "i": i}, ensure_ascii=bool(i % 2)).encode())
        if i % 16 == 5:
            lines.append(ODD_LINES[(i // 16) % len(ODD_LINES)])
    lines[40:40] = ODD_LINES  # every odd line at least once
    if long_line:
        lines.insert(150, json.dumps({"text": "long " * 3000}).encode())
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))


def _expected(paths: list[Path], tokenizer) -> tuple[list[list[int]], list, int]:
    """(tokens + EOD per document, bad records, text bytes) as the run before issue 24 made them:
    each line (split at b"\\n") decoded by ``json`` alone, numbered from the file's first line."""
    docs, bad, text_bytes = [], [], 0
    for path in paths:
        for k, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            record = preprocess._parse_jsonl_line(path, k, raw, ["text"])
            if record is None:
                continue
            if isinstance(record, preprocess.BadRecord):
                bad.append(record)
            else:
                docs.append([*tokenizer.encode(record.texts[0]), tokenizer.eod])
                text_bytes += record.num_bytes
    return docs, bad, text_bytes


@pytest.fixture(scope="module")
def tokenizer(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json-only"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("compressed", [False, True], ids=["ranges", "gzip-blocks"])
def test_same_documents_and_bad_records_as_the_plain_reader(
    tmp_path, monkeypatch, capsys, gpt2_flags, tokenizer, orjson, workers, compressed
):
    if not orjson:
        monkeypatch.setattr(fastjson, "orjson", None)
    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 3000)  # ~15 ranges / blocks per file
    monkeypatch.setattr(preprocess, "_PROBE_BYTES", 700)  # and more than one probe per cut
    monkeypatch.setattr(preprocess, "_MAX_REPORTED_SKIPS", 1000)  # every skip named on stderr
    plain = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    _corpus(plain[0])
    _corpus(plain[1], long_line=False)
    docs, bad, _ = _expected(plain, tokenizer)
    assert len(bad) > 30 and len(docs) > 500
    inputs = plain
    if compressed:
        inputs = [p.with_name(p.name + ".gz") for p in plain]
        for p, gz in zip(plain, inputs):
            gz.write_bytes(gzip.compress(p.read_bytes()))
            p.unlink()
        bad = [
            preprocess.BadRecord(b.where.replace(".jsonl:", ".jsonl.gz:"), b.reason, b.detail) for b in bad
        ]
    out = tmp_path / "out"
    argv = ["--input", *map(str, inputs), "--output-prefix", str(out), *gpt2_flags, "--append-eod"]
    argv += ["--workers", str(workers), "--log-interval", "0", "--skip-bad-records"]
    assert preprocess.main(argv) == 0
    captured = capsys.readouterr()
    skipped = [
        line.removeprefix("skipping ") for line in captured.err.splitlines() if line.startswith("skipping")
    ]
    assert skipped == [b.message() for b in bad]
    counts = Counter(b.reason for b in bad)
    assert f"skipped {len(bad)} bad records" in captured.out
    assert all(f"{reason}: {n}" in captured.out for reason, n in counts.items())
    assert f"done: {len(docs):,} documents" in captured.out
    ds = IndexedDataset(f"{out}_text_document")
    assert [ds.get(i).tolist() for i in range(len(ds))] == docs

    # Without --skip-bad-records: the first bad record stops the run, named by file and line.
    argv.remove("--skip-bad-records")
    assert preprocess.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad[0].message()}; fix the input")


def test_summary_counts_the_bytes_of_the_plain_reader(tmp_path, monkeypatch, gpt2_flags, tokenizer):
    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 2000)
    path = tmp_path / "a.jsonl"
    _corpus(path)
    _, _, text_bytes = _expected([path], tokenizer)
    args = preprocess.build_parser().parse_args(
        ["--input", str(path), "--output-prefix", str(tmp_path / "o"), *gpt2_flags, "--append-eod"]
        + ["--workers", "2", "--log-interval", "0", "--skip-bad-records"]
    )
    assert preprocess.preprocess(args).text_bytes == text_bytes


@pytest.mark.parametrize("bytes_after", [None, 0, 500])
def test_ranges_cover_the_file_and_end_after_newlines(tmp_path, monkeypatch, bytes_after):
    monkeypatch.setattr(preprocess, "_CHUNK_BYTES", 100)
    monkeypatch.setattr(preprocess, "_PROBE_BYTES", 7)
    path = tmp_path / "x.jsonl"
    for data in (b"", b"no newline at all", b"a\n" * 500, b"x" * 1000 + b"\n" + b"y\n" * 90 + b"tail"):
        path.write_bytes(data)
        ranges = list(preprocess._jsonl_ranges(path, bytes_after, tail_bytes=700))
        assert b"".join(data[a:b] for a, b in ranges) == data
        assert all(data[b - 1 : b] == b"\n" for _, b in ranges[:-1])
        for a, b in ranges[:-1]:  # a range ends at the first newline from its minimum size on
            in_tail = bytes_after is not None and len(data) - a + bytes_after <= 700
            assert (
                b - a >= (12 if in_tail else 100) and b"\n" not in data[a + (11 if in_tail else 99) : b - 1]
            )
        if bytes_after == 0 and data == b"a\n" * 500:  # the last 700 bytes in ranges of 12 bytes
            sizes = [b - a for a, b in ranges]
            assert sizes[:3] == [100, 100, 100] and sizes[-5:-1] == [12] * 4 and sizes[-1] <= 12


def test_a_file_that_shrinks_while_read_is_an_error(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"text": "a"}\n' * 10)
    with pytest.raises(preprocess.PreprocessError, match="changed while it was being read"):
        preprocess._read_range(str(path), 0, 1000)


def test_cached_vocabulary_equals_the_checked_build(tmp_path, monkeypatch, gpt2_files):
    monkeypatch.setenv("MEGAFORMER_CACHE", str(tmp_path / "cache"))
    checked = load_gpt2_bpe(*gpt2_files)
    first = bpe_cache.load_gpt2_bpe_cached(*gpt2_files)  # builds and writes the cache file
    (cached_file,) = (tmp_path / "cache" / "tokenizers").iterdir()
    monkeypatch.setattr(bpe_cache, "load_gpt2_bpe", lambda *a: pytest.fail("not read from the cache"))
    second = bpe_cache.load_gpt2_bpe_cached(*gpt2_files)
    for got in (first, second):
        assert list(got[0].items()) == list(checked[0].items()) and got[1] == checked[1]
    tok = bpe_cache.CachedGPT2BPETokenizer(*gpt2_files)
    ref = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    text = "Hello <|endoftext|> wörld\n\n  tabs\tand 1234 numbers"
    assert (tok.vocab_size, tok.eod) == (ref.vocab_size, ref.eod) and tok.encode(text) == ref.encode(text)
    # a damaged cache file is not used, and is written again
    monkeypatch.undo()
    monkeypatch.setenv("MEGAFORMER_CACHE", str(tmp_path / "cache"))
    data = bytearray(cached_file.read_bytes())
    data[-5] ^= 0xFF
    cached_file.write_bytes(bytes(data[:-1]))
    assert bpe_cache._read(cached_file) is None
    again = bpe_cache.load_gpt2_bpe_cached(*gpt2_files)
    assert list(again[0].items()) == list(checked[0].items())
    assert bpe_cache._read(cached_file) is not None


def test_bad_files_fail_as_before_and_are_not_cached(tmp_path, monkeypatch, gpt2_files):
    monkeypatch.setenv("MEGAFORMER_CACHE", str(tmp_path / "cache"))
    vocab, merges = gpt2_files
    lines = merges.read_text(encoding="utf-8").split("\n")
    lines[100], lines[101] = lines[101], lines[100]  # merges 98 and 99 swapped
    bad = tmp_path / "merges.txt"
    bad.write_text("\n".join(lines), encoding="utf-8")
    for load in (load_gpt2_bpe, bpe_cache.load_gpt2_bpe_cached):
        with pytest.raises(TokenizerError, match=r"merges.txt:101: merge 99 .* should produce token id 355"):
            load(vocab, bad)
    with pytest.raises(TokenizerError, match="merges file not found"):
        bpe_cache.load_gpt2_bpe_cached(vocab, tmp_path / "missing.bpe")
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch, gpt2_files):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("MEGAFORMER_CACHE", str(tmp_path / "file"))
    ranks, special = bpe_cache.load_gpt2_bpe_cached(*gpt2_files)
    assert len(ranks) == 50256 and special == {"<|endoftext|>": 50256}
