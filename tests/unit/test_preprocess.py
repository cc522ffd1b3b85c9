"""``python -m data_tools.preprocess``: Megatron's bytes, independence from --workers, every input
format, and a clear error (with no output left behind) for every kind of bad input."""

from __future__ import annotations

import gzip
import json
import lzma
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_tools.indexed_dataset import IndexedDataset

REPO_ROOT = Path(__file__).resolve().parents[2]


def _outputs(prefix, key="text"):
    return f"{prefix}_{key}_document"


def _read_docs(prefix, tokenizer) -> list[str]:
    ds = IndexedDataset(prefix)
    return [tokenizer.decode(ds.get(i).tolist()) for i in range(len(ds))]


def _c4_texts(shared_data) -> list[str]:
    texts = []
    for path in sorted((shared_data / "c4-sample-jsonl").glob("*.json.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def _no_outputs_left(directory):
    left = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".idx", ".tmp"))
    assert left == [], left


def test_bytes_identical_to_megatron_layout(
    tmp_path, shared_data, gpt2_flags, hf_gpt2, run_cli, reference_writer
):
    """Megatron's preprocess_data.py with --append-eod: per JSON line, tokenize(text) + [eod] as one
    sequence, a document index after each. The reference here tokenizes with HF tokenizers and
    writes with struct/numpy, sharing no code with ours."""
    jsonl_dir = shared_data / "dolma-cc-sample-jsonl"
    out = tmp_path / "dolma"
    result = run_cli(
        "data_tools.preprocess", "--input", jsonl_dir, "--output-prefix", out, *gpt2_flags, "--append-eod"
    )
    assert result.returncode == 0, result.stderr
    assert "done: 20 documents" in result.stdout

    documents = []
    for path in sorted(jsonl_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            documents.append([hf_gpt2.encode(json.loads(line)["text"]).ids + [50256]])
    reference_writer(tmp_path / "ref", documents, np.uint16)
    assert (tmp_path / "ref.idx").read_bytes() == Path(_outputs(out) + ".idx").read_bytes()
    assert (tmp_path / "ref.bin").read_bytes() == Path(_outputs(out) + ".bin").read_bytes()


def test_same_bytes_for_any_number_of_workers(tmp_path, shared_data, gpt2_flags, run_cli):
    # Blank-line blocks of three books give ~2.4k documents, ten chunks: the order of results matters.
    books = [
        shared_data / "gutenberg-novels" / name for name in ("pg42.txt.xz", "pg2097.txt.xz", "244-0.txt.xz")
    ]
    inputs = [*books, shared_data / "dolma-cc-sample-jsonl", shared_data / "c4-sample-jsonl"]
    for workers in (1, 2):
        result = run_cli(
            "data_tools.preprocess",
            "--input",
            *inputs,
            "--output-prefix",
            tmp_path / f"w{workers}",
            *gpt2_flags,
            "--append-eod",
            "--text-split-blank-lines",
            "--workers",
            workers,
        )
        assert result.returncode == 0, result.stderr
    for suffix in (".bin", ".idx"):
        one = Path(_outputs(tmp_path / "w1") + suffix).read_bytes()
        two = Path(_outputs(tmp_path / "w2") + suffix).read_bytes()
        assert one == two, suffix
    assert IndexedDataset(_outputs(tmp_path / "w1")).num_documents > 2000


def test_every_input_format_gives_the_same_bytes(tmp_path, shared_data, gpt2_flags, gpt2_tokenizer, run_cli):
    """The 30 C4 documents as .json.gz (as shipped), .jsonl, .jsonl.zst, .jsonl.xz and Parquet."""
    texts = _c4_texts(shared_data)
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    (tmp_path / "c4.jsonl").write_bytes(lines)
    (tmp_path / "c4.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "c4.jsonl.xz").write_bytes(lzma.compress(lines))
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, tmp_path / "c4.parquet", row_group_size=7)  # 5 row groups
    assert pq.ParquetFile(tmp_path / "c4.parquet").num_row_groups == 5

    inputs = {
        "gz": sorted((shared_data / "c4-sample-jsonl").glob("*.json.gz")),
        "jsonl": [tmp_path / "c4.jsonl"],
        "zst": [tmp_path / "c4.jsonl.zst"],
        "xz": [tmp_path / "c4.jsonl.xz"],
        "parquet": [tmp_path / "c4.parquet"],
    }
    outputs = {}
    for name, paths in inputs.items():
        prefix = tmp_path / f"out-{name}"
        result = run_cli(
            "data_tools.preprocess", "--input", *paths, "--output-prefix", prefix, *gpt2_flags, "--append-eod"
        )
        assert result.returncode == 0, f"{name}: {result.stderr}"
        assert "done: 30 documents" in result.stdout
        outputs[name] = (
            Path(_outputs(prefix) + ".bin").read_bytes(),
            Path(_outputs(prefix) + ".idx").read_bytes(),
        )
    for name in inputs:
        assert outputs[name] == outputs["gz"], name
    assert _read_docs(_outputs(tmp_path / "out-parquet"), gpt2_tokenizer) == [
        t + "<|endoftext|>" for t in texts
    ]


def test_plain_text_one_document_per_file(tmp_path, gpt2_flags, gpt2_tokenizer, run_cli):
    (tmp_path / "in").mkdir()
    # BOM + CRLF, as Gutenberg ships them; text mode drops the BOM and turns \r\n (and \r) into \n.
    (tmp_path / "in" / "a.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nsecond line\r\n")
    (tmp_path / "in" / "b.txt.gz").write_bytes(gzip.compress("Zweite Datei: äöü\rend".encode()))
    (tmp_path / "in" / "c.txt.xz").write_bytes(lzma.compress(b"third\n\nfile\n"))
    (tmp_path / "in" / "README.md").write_text("not an input: ignored in a directory")
    result = run_cli(
        "data_tools.preprocess", "--input", tmp_path / "in", "--output-prefix", tmp_path / "t", *gpt2_flags
    )
    assert result.returncode == 0, result.stderr
    assert _read_docs(_outputs(tmp_path / "t"), gpt2_tokenizer) == [
        "First line\nsecond line\n",
        "Zweite Datei: äöü\nend",
        "third\n\nfile\n",
    ]


def test_plain_text_split_on_blank_lines(tmp_path, gpt2_flags, gpt2_tokenizer, run_cli):
    text = "\n\npara one\r\nline two\r\n\r\n  \t \r\n\r\npara two\n\nlast\nblock\n"
    (tmp_path / "doc.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        tmp_path / "doc.txt",
        "--output-prefix",
        tmp_path / "t",
        *gpt2_flags,
        "--append-eod",
        "--text-split-blank-lines",
    )
    assert result.returncode == 0, result.stderr
    eod = "<|endoftext|>"
    assert _read_docs(_outputs(tmp_path / "t"), gpt2_tokenizer) == [
        "para one\nline two" + eod,
        "para two" + eod,
        "last\nblock" + eod,
    ]


def test_several_json_keys(tmp_path, gpt2_flags, gpt2_tokenizer, run_cli):
    (tmp_path / "x.jsonl").write_text(
        json.dumps({"text": "body one", "title": "T1"})
        + "\n"
        + json.dumps({"text": "body two", "title": "T2"})
    )
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        tmp_path / "x.jsonl",
        "--output-prefix",
        tmp_path / "k",
        "--json-keys",
        "text",
        "title",
        *gpt2_flags,
    )
    assert result.returncode == 0, result.stderr
    assert _read_docs(_outputs(tmp_path / "k", "text"), gpt2_tokenizer) == ["body one", "body two"]
    assert _read_docs(_outputs(tmp_path / "k", "title"), gpt2_tokenizer) == ["T1", "T2"]


# --------------------------------------------------------------------------- bad inputs

GOOD = json.dumps({"text": "a good document"})
BAD_RECORDS = {
    "malformed JSON": '{"text": "unterminated',
    "missing key": json.dumps({"body": "no text key here"}),
    "not a string": json.dumps({"text": 42}),
    "empty document": json.dumps({"text": " \n\t "}),
    "invalid UTF-8": b'{"text": "caf\xe9"}',  # Latin-1, not UTF-8
}


def _jsonl(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


@pytest.mark.parametrize("reason", sorted(BAD_RECORDS))
def test_bad_record_stops_with_file_and_line(tmp_path, gpt2_flags, run_cli, reason):
    bad = _jsonl(tmp_path / "in.jsonl", [GOOD, GOOD, BAD_RECORDS[reason], GOOD])
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        bad,
        "--output-prefix",
        tmp_path / "out",
        *gpt2_flags,
        "--append-eod",
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {bad}:3: {reason}: "), result.stderr
    assert "--skip-bad-records" in result.stderr and "Traceback" not in result.stderr
    _no_outputs_left(tmp_path)


def test_skip_bad_records_counts_them(tmp_path, gpt2_flags, gpt2_tokenizer, run_cli):
    lines = [GOOD, *BAD_RECORDS.values(), BAD_RECORDS["missing key"], json.dumps({"text": "last"})]
    bad = _jsonl(tmp_path / "in.jsonl", lines)
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        bad,
        "--output-prefix",
        tmp_path / "out",
        *gpt2_flags,
        "--skip-bad-records",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "done: 2 documents, 4 tokens, skipped 6 bad records (empty document: 1, invalid UTF-8: 1, "
        "malformed JSON: 1, missing key: 2, not a string: 1)"
    ) in result.stdout
    assert f"skipping {bad}:4: not a string" in result.stderr
    assert _read_docs(_outputs(tmp_path / "out"), gpt2_tokenizer) == ["a good document", "last"]


def test_invalid_utf8_in_text_file_names_the_line(tmp_path, gpt2_flags, run_cli):
    bad = tmp_path / "book.txt"
    bad.write_bytes(b"line one\nline two\nline \xff three\n")
    for extra in ([], ["--text-split-blank-lines"]):
        result = run_cli(
            "data_tools.preprocess", "--input", bad, "--output-prefix", tmp_path / "o", *gpt2_flags, *extra
        )
        assert result.returncode == 2
        assert result.stderr.startswith(f"error: {bad}:3: invalid UTF-8: "), result.stderr
        _no_outputs_left(tmp_path)


def test_parquet_without_the_column(tmp_path, gpt2_flags, run_cli):
    bad = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": ["x", "y"]}), bad)
    result = run_cli("data_tools.preprocess", "--input", bad, "--output-prefix", tmp_path / "o", *gpt2_flags)
    assert result.returncode == 2
    assert (
        f"error: {bad}: expected column(s) ['text'] (from --json-keys), found columns ['content']"
        in result.stderr
    )
    assert "--json-keys" in result.stderr and "Traceback" not in result.stderr
    _no_outputs_left(tmp_path)


def test_vocabulary_file_that_is_not_one(tmp_path, gpt2_files, run_cli):
    vocab, merges = gpt2_files
    (tmp_path / "in.jsonl").write_text(GOOD + "\n")
    fake = tmp_path / "encoder.json"
    fake.write_text("this is not a vocabulary\n")
    for vocab_file, merge_file, expected in [
        (fake, merges, f"error: {fake}:1: expected a JSON vocabulary"),
        (merges, vocab, "did you swap --vocab-file and --merge-file?"),
    ]:
        result = run_cli(
            "data_tools.preprocess",
            "--input",
            tmp_path / "in.jsonl",
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab_file,
            "--merge-file",
            merge_file,
        )
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    _no_outputs_left(tmp_path)


def test_input_that_matches_nothing(tmp_path, gpt2_flags, run_cli):
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        str(tmp_path / "*.jsonl"),
        "--output-prefix",
        tmp_path / "o",
        *gpt2_flags,
    )
    assert result.returncode == 2 and "has no input files" in result.stderr


def test_interrupted_run_leaves_no_output(tmp_path, novels_corpus, gpt2_flags):
    """SIGTERM mid-run (a scheduler's kill): exit 130, temporaries removed, nothing that looks finished."""
    # The novels 20 times over: ~30 s of work at 2 workers, so the run is surely still going when
    # the signal comes once the .tmp files appear.
    inputs = novels_corpus(tmp_path / "inputs", 20)
    out = tmp_path / "gut"
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_tools.preprocess", "--input", str(inputs)]
        + ["--output-prefix", str(out), *gpt2_flags, "--append-eod", "--workers", "2"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tmp_bin = tmp_path / "gut_text_document.bin.tmp"
    deadline = time.monotonic() + 30
    while not tmp_bin.exists() and time.monotonic() < deadline:  # the writers are open: work has begun
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    _no_outputs_left(tmp_path)
