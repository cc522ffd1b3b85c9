"""Megatron ``tools/preprocess_data.py`` flags (issue 13): ``--split-sentences``, ``--keep-newlines``,
``--partitions``, ``--log-interval``, ``--tokenizer-type HuggingFaceTokenizer``, and an
``--output-prefix`` that already ends in ``_text_document``.

The expected outputs come from the tests' reference (``conftest.write_reference``: Megatron's
MMIDIDX layout written literally with struct/numpy, ids from Hugging Face ``tokenizers``), sharing
no code with ``data_tools.preprocess``, fed with Megatron's semantics read from its
``tools/preprocess_data.py`` (NVIDIA/Megatron-LM at d98e8a64, 2026-08-22): per JSON line, the
sentences of the text (or the whole text), each tokenized, zero-token sentences dropped, the EOD
added to the last one, a document index entry after each line; with ``--partitions P``, line i
goes to partition ``i mod P`` and the partitions are concatenated in order.

The sha256 sums below were obtained by ``tests/support/megatron_reference_hashes.py``, which writes
the same datasets with Megatron's own ``IndexedDatasetBuilder`` (its file loaded from a Megatron-LM
checkout at d98e8a64) and prints their sums; the literal reference gives the same sums. Megatron's
script as a whole cannot run here: ``import megatron.core`` needs triton and Transformer Engine,
and ``--split-sentences`` needs NLTK's Punkt model, downloaded from NLTK's server; so the
sentences are ours (:mod:`data_tools.sentences`) and only the ``--keep-newlines`` case without
``--split-sentences`` (where the flag changes nothing and Megatron's output is fully defined) is
Megatron's output end to end.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from data_tools.errors import TokenizerError
from data_tools.indexed_dataset import IndexedDataset
from data_tools.preprocess import build_parser, preprocess
from data_tools.sentences import split_sentences

DOLMA = Path(__file__).resolve().parents[2] / "data" / "dolma-cc-sample-jsonl"
# sha256 of .bin / .idx of the Dolma sample (20 documents), GPT-2 BPE, --append-eod, written by
# Megatron's IndexedDatasetBuilder (see the module docstring).
KEEP_NEWLINES_BIN_SHA256 = "5341809a37e9e3e8a64aa2b0ef2f55b10ff94ad5030c3732f1f96dc693cff54b"
KEEP_NEWLINES_IDX_SHA256 = "cd1770434923679981bdceeb159a60caf501dbdb5795e8569b9ce43317d9ec68"
# --keep-newlines --split-sentences --partitions 2 (sentences from data_tools.sentences)
SENTENCES_P2_BIN_SHA256 = "e93df2166e65c1a4392046c343ad6992d4eeddbb9f30febb060a83006200adc8"
SENTENCES_P2_IDX_SHA256 = "d2882b94c25d81176643cd91cf7e0a1942d65a5a4ad3f051f45117d997248676"


def _texts() -> list[str]:
    return [
        json.loads(line)["text"] for p in sorted(DOLMA.glob("*.jsonl")) for line in p.open(encoding="utf-8")
    ]


def _run(out, gpt2_flags, *extra):
    args = build_parser().parse_args(
        ["--input", str(DOLMA), "--output-prefix", str(out), *gpt2_flags, "--append-eod", *extra]
    )
    return preprocess(args)


def _reference(path, hf_gpt2, reference_writer, texts, *, split=None, partitions=1):
    """Megatron's output for ``texts`` (see the module docstring); ``split`` is keep_newlines."""
    docs = []
    for text in texts:
        pieces = [text] if split is None else split_sentences(text, keep_newlines=split)
        seqs = [ids for s in pieces if (ids := hf_gpt2.encode(s).ids)]
        seqs[-1] = [*seqs[-1], 50256]
        docs.append(seqs)
    order = [i for k in range(partitions) for i in range(k, len(docs), partitions)]
    reference_writer(path, [docs[i] for i in order], np.uint16)
    return Path(f"{path}.bin").read_bytes(), Path(f"{path}.idx").read_bytes()


def _bytes(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_keep_newlines_alone_is_megatron_bytes_and_suffix_is_not_doubled(
    tmp_path, gpt2_flags, hf_gpt2, reference_writer
):
    _run(tmp_path / "dolma_text_document", gpt2_flags, "--keep-newlines")
    out = tmp_path / "dolma_text_document"  # not dolma_text_document_text_document
    assert not Path(f"{out}_text_document.bin").exists()
    ref = _reference(tmp_path / "ref", hf_gpt2, reference_writer, _texts())
    assert _bytes(out) == ref
    assert (_sha(ref[0]), _sha(ref[1])) == (KEEP_NEWLINES_BIN_SHA256, KEEP_NEWLINES_IDX_SHA256)


def test_megatron_command_line_with_sentences_partitions_and_log_interval(
    tmp_path, gpt2_flags, hf_gpt2, reference_writer, run_cli
):
    """The proof command line of issue 13: it runs, names its output as Megatron does, logs
    progress lines (stderr is not a terminal here; they are printed on one too when the flag is
    given), and its bytes are Megatron's for the sentences the offline splitter finds."""
    result = run_cli(
        "data_tools.preprocess", "--input", DOLMA, "--output-prefix", tmp_path / "dolma", *gpt2_flags,
        "--append-eod", "--keep-newlines", "--split-sentences", "--partitions", "2",
        "--log-interval", "100", "--workers", "2", "--dataset-impl", "mmap",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = tmp_path / "dolma_text_sentence"
    assert f"wrote {out}.bin" in result.stdout
    ref = _reference(tmp_path / "ref", hf_gpt2, reference_writer, _texts(), split=True, partitions=2)
    assert _bytes(out) == ref
    assert (_sha(ref[0]), _sha(ref[1])) == (SENTENCES_P2_BIN_SHA256, SENTENCES_P2_IDX_SHA256)
    ds = IndexedDataset(out)
    assert ds.num_documents == 20 and len(ds) > 200  # hundreds of sentences in 20 documents
    result = run_cli(
        "data_tools.preprocess", "--input", DOLMA, "--output-prefix", tmp_path / "log", *gpt2_flags,
        "--log-interval", "5",
    )  # fmt: skip
    # A line at every multiple of 5 documents, though they arrive 10 at a time (one file's block):
    # the count is of documents, as Megatron's, not of work units.
    lines = [line.split(",")[0] for line in result.stderr.splitlines()]
    expected = [f"processed {n} documents" for n in (5, 10, 15, 20)]
    assert lines == expected, result.stderr


def test_split_without_keep_newlines_drops_the_whitespace(tmp_path, gpt2_flags, hf_gpt2, reference_writer):
    _run(tmp_path / "s", gpt2_flags, "--split-sentences")
    ref = _reference(tmp_path / "ref", hf_gpt2, reference_writer, _texts(), split=False)
    assert _bytes(tmp_path / "s_text_sentence") == ref


@pytest.mark.parametrize("partitions", [2, 3])
def test_partitions_give_megatron_order(tmp_path, gpt2_flags, hf_gpt2, reference_writer, partitions):
    _run(tmp_path / "p", gpt2_flags, "--partitions", str(partitions))
    ref = _reference(tmp_path / "ref", hf_gpt2, reference_writer, _texts(), partitions=partitions)
    assert _bytes(tmp_path / "p_text_document") == ref
    _run(tmp_path / "q", gpt2_flags, "--partitions", str(partitions), "--keep-sequential-samples")
    assert _bytes(tmp_path / "q_text_document") == _reference(
        tmp_path / "ref1", hf_gpt2, reference_writer, _texts()
    )


def test_huggingface_tokenizer_json(tmp_path, gpt2_files, gpt2_flags):
    """A tokenizer.json (GPT-2's BPE saved by Hugging Face tokenizers, with a tokenizer_config.json
    naming the EOS, as save_pretrained writes) gives the bytes of GPT2BPETokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = gpt2_files
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf_flags = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(folder / "tokenizer.json"),
    ]
    _run(tmp_path / "hf", hf_flags)
    _run(tmp_path / "bpe", gpt2_flags)
    assert _bytes(tmp_path / "hf_text_document") == _bytes(tmp_path / "bpe_text_document")
    stats = json.loads(Path(tmp_path / "hf_text_document.stats.json").read_text())
    assert stats["tokenizer"]["type"] == "HuggingFaceTokenizer" and stats["eod_token"] == 50256
    # a bare tokenizer.json (no config beside it): the EOS is found by its usual name
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    tok.save(str(bare))
    _run(tmp_path / "bare", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bare)])
    assert _bytes(tmp_path / "bare_text_document") == _bytes(tmp_path / "bpe_text_document")
    # a hub name is not downloaded
    with pytest.raises(TokenizerError, match="nothing is downloaded"):
        _run(tmp_path / "hub", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"])


def test_sentence_splitter_rules():
    text = (
        "Mr. Smith met J. R. R. Tolkien in the U.S. on Jan. 3. Was it raining? Yes!\n\n"
        '"Quite so." Then it ended... and began again... Later, e.g. at 5 p.m. he left.'
    )
    assert split_sentences(text) == [
        "Mr. Smith met J. R. R. Tolkien in the U.S. on Jan. 3.",
        "Was it raining?",
        "Yes!",
        '"Quite so."',
        "Then it ended... and began again...",
        "Later, e.g. at 5 p.m. he left.",
    ]
    kept = split_sentences(text, keep_newlines=True)
    assert "".join(kept) == text and kept[2] == "Yes!\n\n"


def test_log_interval_prints_on_a_terminal(tmp_path, gpt2_flags):
    """With stderr on a terminal (a pseudo-terminal here), --log-interval prints its lines instead of
    the progress bar (they used to be printed only when stderr was not a terminal)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    command = [sys.executable, "-m", "data_tools.preprocess", "--input", str(DOLMA), "--output-prefix"]
    command += [str(tmp_path / "t"), *gpt2_flags, "--log-interval", "10"]
    proc = subprocess.Popen(command, cwd=DOLMA.parents[1], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    os.close(master)
    text = b"".join(chunks).decode()
    assert "processed 10 documents" in text and "processed 20 documents" in text, text
    assert "tokenizing" not in text  # no bar


@pytest.mark.parametrize("block_tokens", [50, 1 << 22])  # many copy blocks, or one
def test_round_robin_writer_order_with_sentences(tmp_path, monkeypatch, block_tokens):
    """Documents of several sequences, added in 7 batches: the output holds documents 0, 3, 6, ...,
    then 1, 4, ..., then 2, 5, ..., each with its sequences, whatever the copy block size."""
    import data_tools.partitions as partitions
    from data_tools.indexed_dataset import IndexedDatasetWriter

    monkeypatch.setattr(partitions, "_COPY_TOKENS", block_tokens)
    rng = np.random.default_rng(0)
    docs = [
        [rng.integers(0, 50000, size=rng.integers(1, 30)) for _ in range(rng.integers(1, 4))]
        for _ in range(40)
    ]
    writer = partitions.RoundRobinWriter(tmp_path / "rr", np.uint16, 3)
    for batch in np.array_split(np.arange(len(docs)), 7):
        seqs = [s for i in batch for s in docs[i]]
        tokens = np.concatenate(seqs).astype(np.uint16)
        writer.add_documents(tokens, [len(s) for s in seqs], [len(docs[i]) for i in batch])
    writer.finalize()
    with IndexedDatasetWriter(tmp_path / "expected", np.uint16) as expected:
        for i in [i for k in range(3) for i in range(k, len(docs), 3)]:
            tokens = np.concatenate(docs[i]).astype(np.uint16)
            expected.add_documents(tokens, [len(s) for s in docs[i]], [len(docs[i])])
    assert _bytes(tmp_path / "rr") == _bytes(tmp_path / "expected")
    assert not list(tmp_path.glob("*partition*"))
