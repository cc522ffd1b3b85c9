"""Fixtures of the data-tool tests: the shared data files, a CLI runner, a reference .bin/.idx writer,
a corpus large enough to interrupt."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# The project's own copies of the shared data (data/, each set with its SOURCE.md), so a clone
# runs every test without ../shared beside it.
SHARED_DATA = REPO_ROOT / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``data/`` of the project: GPT-2 BPE files, Gutenberg novels, C4 / Dolma samples, Tiny Shakespeare."""
    names = ("gpt2-bpe/encoder.json", "gutenberg-novels", "c4-sample-jsonl", "tinyshakespeare/input.txt.xz")
    for name in names:
        if not (SHARED_DATA / name).exists():
            raise FileNotFoundError(f"{SHARED_DATA / name} is missing: restore it with git checkout data/")
    return SHARED_DATA


@pytest.fixture(scope="session")
def gpt2_files(shared_data: Path) -> tuple[Path, Path]:
    """GPT-2's (encoder.json, vocab.bpe)."""
    return shared_data / "gpt2-bpe" / "encoder.json", shared_data / "gpt2-bpe" / "vocab.bpe"


@pytest.fixture(scope="session")
def gpt2_flags(gpt2_files: tuple[Path, Path]) -> list[str]:
    """Tokenizer flags of ``data_tools.preprocess`` for GPT-2 BPE."""
    vocab, merges = gpt2_files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files: tuple[Path, Path]):
    """Our GPT-2 tokenizer, built once."""
    from data_tools.tokenizer import build_tokenizer

    vocab, merges = gpt2_files
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


@pytest.fixture(scope="session")
def hf_gpt2(gpt2_files: tuple[Path, Path]):
    """The reference: Hugging Face ``tokenizers`` BPE from the same files, GPT-2 byte-level
    pre-tokenizer without a prefix space, no special-token handling."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab, merges = gpt2_files
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def _run(module: str, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """``run_cli("data_tools.preprocess", *args)``: runs ``python -m`` from the repo root, output captured."""
    return _run


def write_reference(prefix: Path, documents: Sequence[Sequence[Sequence[int]]], dtype=np.uint16) -> None:
    """Writes ``prefix.bin/.idx`` by following Megatron's layout literally, independent of our writer.

    ``documents[d][s]`` is the token list of sequence ``s`` of document ``d``.
    """
    dtype = np.dtype(dtype)
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[dtype]
    lengths, pointers, doc_index = [], [], [0]
    offset = 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                np.array(seq, dtype=dtype).tofile(f)
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * dtype.itemsize
            doc_index.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        np.array(lengths, dtype="<i4").tofile(f)
        np.array(pointers, dtype="<i8").tofile(f)
        np.array(doc_index, dtype="<i8").tofile(f)


@pytest.fixture(scope="session")
def reference_writer() -> Callable[..., None]:
    """``reference_writer(prefix, documents, dtype=np.uint16)``, see ``write_reference``."""
    return write_reference


@pytest.fixture(scope="session")
def novels_corpus(shared_data: Path) -> Callable[[Path, int], Path]:
    """``novels_corpus(directory, copies)``: the Gutenberg novels ``copies`` times over in the new
    ``directory`` (hard links, or copies across file systems), returned; about ``copies`` seconds
    of preprocessing at 2 workers, for tests that stop a run in the middle."""

    def make(directory: Path, copies: int) -> Path:
        directory.mkdir()
        for k in range(copies):
            for book in sorted((shared_data / "gutenberg-novels").glob("*.txt.xz")):
                target = directory / f"{k:02d}-{book.name}"
                try:
                    os.link(book, target)
                except OSError:
                    shutil.copyfile(book, target)
        return directory

    return make
