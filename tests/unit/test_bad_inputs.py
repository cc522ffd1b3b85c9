"""Bad inputs and failing writes in the data tools (issue 12): each ends in an error naming the file
and the fix, and leaves nothing under a final name, nor any temporary.

Full disks are simulated two ways: a real ``ENOSPC`` from a 96 KiB tmpfs mounted in a private
user + mount namespace (``unshare -rm``; skipped where the machine does not allow user
namespaces), and ``EFBIG`` from a file-size limit (``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored),
which works for any user. A read-only output directory is a read-only tmpfs in such a namespace.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_tools.errors import PreprocessError, TokenizerError
from data_tools.preprocess import build_parser, preprocess

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [json.dumps({"text": f"Document number {i}. It has a few words in it."}) + "\n" for i in range(200)]


def _preprocess(inputs, out, gpt2_flags, *extra):
    args = build_parser().parse_args(
        ["--input", *map(str, inputs), "--output-prefix", str(out), *gpt2_flags, "--append-eod", *extra]
    )
    return preprocess(args)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("out"))


def _compressed(kind: str, data: bytes) -> bytes:
    if kind == "zst":  # four frames, as a parallel compressor (pzstd, zstd -T) writes them
        c = zstandard.ZstdCompressor()
        q = len(data) // 4
        return b"".join(c.compress(data[i * q : (i + 1) * q if i < 3 else None]) for i in range(4))
    return {"gz": gzip, "xz": lzma, "bz2": bz2}[kind].compress(data)


@pytest.mark.parametrize("kind", ["gz", "xz", "bz2", "zst"])
@pytest.mark.parametrize("damage", ["truncated", "fake"])
def test_damaged_compressed_input_names_the_file(tmp_path, gpt2_flags, kind, damage):
    data = _compressed(kind, "".join(DOCS).encode())
    # Truncated: 5/8 of the file, inside the third of the four zstd frames (two frames decode fine,
    # which zstandard's multi-frame reader used to accept silently, losing the rest).
    payload = data[: len(data) * 5 // 8] if damage == "truncated" else b'{"text": "not compressed"}\n'
    path = tmp_path / f"in.jsonl.{kind}"
    path.write_bytes(payload)
    with pytest.raises(PreprocessError, match="truncated or damaged") as err:
        _preprocess([path], tmp_path / "out", gpt2_flags)
    assert str(path) in str(err.value) and "re-copy" in str(err.value)
    assert _leftovers(tmp_path) == []


def test_complete_multiframe_zst_reads_every_document(tmp_path, gpt2_flags):
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(_compressed("zst", "".join(DOCS).encode()))
    assert _preprocess([path], tmp_path / "out", gpt2_flags).documents == len(DOCS)


def test_deeply_nested_json_is_a_bad_record(tmp_path, gpt2_flags):
    path = tmp_path / "deep.jsonl"
    path.write_text(DOCS[0] + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(PreprocessError, match=rf"{path}:2: malformed JSON: nested more than"):
        _preprocess([path], tmp_path / "out", gpt2_flags)
    summary = _preprocess([path], tmp_path / "out", gpt2_flags, "--skip-bad-records")
    assert summary.documents == 1 and summary.skipped == {"malformed JSON": 1}


def test_corrupt_parquet_page_names_the_file(tmp_path, gpt2_flags):
    path = tmp_path / "c.parquet"
    table = pa.table({"text": [f"some words, row {i} " * 20 for i in range(2000)]})
    pq.write_table(table, path, compression="snappy", row_group_size=500)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 200):  # inside a data page, footer intact
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(PreprocessError, match="damaged Parquet data") as err:
        _preprocess([path], tmp_path / "out", gpt2_flags)
    assert str(path) in str(err.value)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_input_file_is_named(tmp_path, gpt2_flags, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(PreprocessError, match="no documents to write") as err:
        _preprocess([path], tmp_path / "out", gpt2_flags)
    assert str(path) in str(err.value)


def test_merges_file_cut_at_a_line_boundary(tmp_path, gpt2_files):
    from data_tools.tokenizer import build_tokenizer

    vocab, merges = gpt2_files
    half = tmp_path / "vocab.bpe"
    half.write_text("".join(merges.read_text(encoding="utf-8").splitlines(keepends=True)[:25001]))
    with pytest.raises(TokenizerError, match=r"25000 merges .* 25000 more tokens that no merge produces"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=half)


# ----------------------------------------------------------------------------- failing writes


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "mkdir -p /tmp/.mf-probe && mount -t tmpfs -o size=64k tmpfs /tmp/.mf-probe"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _can_unshare(), reason="needs unprivileged user + mount namespaces (unshare -rm) for a tmpfs"
)


def _preprocess_command(out: Path, gpt2_flags) -> list[str]:
    books = [REPO_ROOT / "data" / "gutenberg-novels" / name for name in ("pg42.txt.xz", "pg2097.txt.xz")]
    return [sys.executable, "-m", "data_tools.preprocess", "--input", *map(str, books)] + [
        "--text-split-blank-lines",
        "--output-prefix",
        str(out),
        *gpt2_flags,
        "--append-eod",
    ]


def _in_tmpfs(directory: Path, options: str, command: list[str]) -> subprocess.CompletedProcess:
    """Runs ``command`` with a fresh tmpfs mounted on ``directory`` (in a private namespace);
    lists the directory afterwards on stdout's last line."""
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(directory))} && "
        f"{shlex.join(command)}; rc=$?; echo; echo LEFT: $(ls -A {shlex.quote(str(directory))}); exit $rc"
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@needs_namespaces
@pytest.mark.parametrize("size", ["96k", "300k"])
def test_full_disk_removes_everything_and_says_so(tmp_path, gpt2_flags, size):
    """ENOSPC in the .bin (96k) and in the statistics sidecar after the .bin is renamed (300k)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    result = _in_tmpfs(disk, f"size={size}", _preprocess_command(disk / "out", gpt2_flags))
    assert result.returncode == 2, result.stderr
    assert "No space left on device" in result.stderr and "removed" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LEFT:", result.stdout


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_file_size_limit_removes_everything_and_says_so(tmp_path, gpt2_flags):
    result = subprocess.run(
        _preprocess_command(tmp_path / "out", gpt2_flags),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_file_size_limit(64 * 1024),
    )
    assert result.returncode == 2, result.stderr
    assert "File too large" in result.stderr and "removed" in result.stderr
    assert "Traceback" not in result.stderr
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("below", ["out", "sub/deeper/out"])  # the output itself, or directories to create
def test_read_only_output_directory(tmp_path, gpt2_flags, below):
    out_dir = tmp_path / "ro"
    out_dir.mkdir()
    command = _preprocess_command(out_dir / below, gpt2_flags)
    if os.geteuid() != 0:
        out_dir.chmod(0o555)
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        out_dir.chmod(0o755)
    elif _can_unshare():
        result = _in_tmpfs(out_dir, "ro,size=64k", command)
    else:
        pytest.skip("root ignores directory permissions, and no user namespace for a read-only mount")
    assert result.returncode == 2, result.stderr
    assert "cannot write" in result.stderr and str(out_dir) in result.stderr
    assert "Traceback" not in result.stderr


def test_merge_removes_its_temporaries_on_sigterm(tmp_path, gpt2_flags):
    """SIGTERM while merge writes the sidecar (its .bin already renamed, its .idx.tmp written):
    exit 130, no .tmp and no .bin without .idx left."""
    doc = tmp_path / "in.jsonl"
    doc.write_text("".join(DOCS))
    _preprocess([doc], tmp_path / "a", gpt2_flags)
    out = tmp_path / "out"
    # The sidecar write is made to block, so that the signal surely comes in the middle.
    argv = ["--input", str(tmp_path / "a_text_document"), "--output-prefix", str(out)]
    script = (
        "import sys, time, data_tools.merge as m; "
        "m.write_stats = lambda *a, **k: time.sleep(60); "
        f"sys.exit(m.main({argv!r}))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not Path(f"{out}.idx.tmp").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert _leftovers(tmp_path) == []


def test_unwritable_index_cache_dir_warns_and_builds_in_memory(tmp_path, gpt2_flags, capsys):
    """A cache directory that cannot be written (read-only for a non-root user; for root, which
    ignores permissions, a path below a regular file) costs the cache, not the run."""
    import numpy as np

    from data_tools.indexed_dataset import IndexedDataset
    from data_tools.sample_index import build_sample_index, load_or_build

    doc = tmp_path / "in.jsonl"
    doc.write_text("".join(DOCS))
    _preprocess([doc], tmp_path / "a", gpt2_flags)
    ds = IndexedDataset(tmp_path / "a_text_document")
    if os.geteuid() != 0:
        cache = tmp_path / "ro"
        cache.mkdir(mode=0o555)
    else:
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    index = load_or_build(ds, seq_len=16, num_samples=50, seed=1, cache_dir=cache)
    assert not index.cache_hit and index.paths is None
    assert f"cannot save the sample index in the cache directory {cache}" in capsys.readouterr().err
    expected = build_sample_index(np.arange(ds.num_documents), ds.document_lengths(), 16, 50, 1)
    np.testing.assert_array_equal(expected[2], index.shuffle_idx)


def test_split_under_a_file_size_limit_removes_its_outputs(tmp_path, gpt2_flags):
    doc = tmp_path / "in.jsonl"
    doc.write_text("".join(DOCS * 5))
    _preprocess([doc], tmp_path / "a", gpt2_flags)
    command = [sys.executable, "-m", "data_tools.split", "--data-prefix", str(tmp_path / "a_text_document")]
    command += ["--holdout-tokens", "500", "--holdout-prefix", str(tmp_path / "out_v")]
    command += ["--train-prefix", str(tmp_path / "out_t")]
    result = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, preexec_fn=_file_size_limit(8192)
    )
    assert result.returncode == 2, result.stderr
    assert "File too large" in result.stderr and "Traceback" not in result.stderr
    assert _leftovers(tmp_path) == []


def test_build_index_into_an_unwritable_directory(tmp_path, gpt2_flags):
    doc = tmp_path / "in.jsonl"
    doc.write_text("".join(DOCS))
    _preprocess([doc], tmp_path / "a", gpt2_flags)
    (tmp_path / "file").write_text("")  # a directory below a regular file cannot be created
    command = [
        sys.executable,
        "-m",
        "data_tools.build_index",
        "--data-prefix",
        str(tmp_path / "a_text_document"),
    ]
    command += [
        "--seq-len",
        "16",
        "--seed",
        "1",
        "--num-samples",
        "50",
        "--output-dir",
        str(tmp_path / "file" / "c"),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert (
        "cannot save the sample index" in result.stderr and "choose a writable --output-dir" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_stats_sidecar_under_a_file_size_limit(tmp_path, gpt2_flags):
    doc = tmp_path / "in.jsonl"
    doc.write_text("".join(DOCS))
    _preprocess([doc], tmp_path / "a", gpt2_flags)
    sidecar = tmp_path / "a_text_document.stats.json"
    sidecar.unlink()
    command = [sys.executable, "-m", "data_tools.stats", "--data-prefix", str(tmp_path / "a_text_document")]
    result = subprocess.run(
        [*command, "--eod-token", "50256"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_file_size_limit(1024),
    )
    assert result.returncode == 2, result.stderr
    assert f"writing {sidecar} failed: File too large" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("a_text_document.stats")) == []
