"""``data_tools.inspect`` and ``data_tools.train_tokenizer`` (a SentencePiece model that preprocess
then uses)."""

from __future__ import annotations

import lzma

import numpy as np
import pytest

from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data_tools.inspect import length_histogram
from data_tools.tokenizer import TokenizerError, build_tokenizer


def test_length_histogram_buckets():
    rows = length_histogram(np.array([0, 1, 1, 3, 4, 7, 8, 100]))
    assert rows[:5] == [(0, 1, 1), (1, 2, 2), (2, 4, 1), (4, 8, 2), (8, 16, 1)]
    assert rows[-1] == (64, 128, 1) and [r[2] for r in rows[5:-1]] == [0, 0]  # empty buckets kept
    assert length_histogram(np.array([], dtype=np.int64)) == []


def test_inspect_prints_counts_histogram_and_document(tmp_path, gpt2_files, gpt2_tokenizer, run_cli):
    texts = ["Hello world", "The second document.\nWith two lines.", "x" * 300]
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        for t in texts:
            w.add_document([*gpt2_tokenizer.encode(t), gpt2_tokenizer.eod])
    vocab, merges = gpt2_files
    result = run_cli(
        "data_tools.inspect", tmp_path / "ds", "--doc", "1", "--vocab-file", vocab, "--merge-file", merges
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    tokens = sum(len(gpt2_tokenizer.encode(t)) + 1 for t in texts)
    for line in ("dtype:     uint16", "sequences: 3", "documents: 3", f"tokens:    {tokens}"):
        assert line in out, out
    assert "document length histogram (tokens, log2 buckets):" in out
    assert "#" * 50 in out  # the fullest bucket's bar
    assert "The second document.\nWith two lines.<|endoftext|>" in out

    # the .idx path works as well; without tokenizer flags it decodes with data/gpt2-bpe (issue 13)
    result = run_cli("data_tools.inspect", f"{tmp_path / 'ds'}.idx", "--doc", "0")
    assert result.returncode == 0 and "Hello world<|endoftext|>" in result.stdout, result.stderr
    result = run_cli("data_tools.inspect", tmp_path / "missing")
    assert result.returncode == 2 and "no such file" in result.stderr


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, shared_data, run_cli):
    """A 1000-piece BPE model trained on ~1 MB of Tiny Shakespeare."""
    prefix = tmp_path_factory.mktemp("spm") / "shakespeare"
    result = run_cli(
        "data_tools.train_tokenizer",
        "--input",
        shared_data / "tinyshakespeare" / "input.txt.xz",
        "--model-prefix",
        prefix,
        "--vocab-size",
        "1000",
        "--sample-bytes",
        "1000000",
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote {prefix}.model" in result.stdout
    return prefix.with_suffix(".model")


def test_trained_model(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert tok.vocab_size == 1000 and tok.eod == 2
    texts = ["First Citizen:\nBefore we proceed any further, hear me speak.", "naïve 東京 🤗 42\ttab  two"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    for t in texts:  # identity normalisation + byte fallback: decoding gives the text back
        assert tok.decode(tok.encode(t)) == t
    assert len(tok.encode(texts[0])) < len(texts[0]) / 2  # it learnt merges


def test_preprocess_with_trained_model(tmp_path, shared_data, spm_model, run_cli):
    source = shared_data / "tinyshakespeare" / "input.txt.xz"
    result = run_cli(
        "data_tools.preprocess",
        "--input",
        source,
        "--output-prefix",
        tmp_path / "shk",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        spm_model,
        "--append-eod",
        "--text-split-blank-lines",
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(tmp_path / "shk_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert ds.dtype == np.uint16 and ds.num_documents > 7000
    with lzma.open(source, "rt", encoding="utf-8") as f:
        first_block = f.read().split("\n\n")[0]
    doc0 = ds.get(0)
    assert doc0[-1] == tok.eod
    assert tok.decode(doc0[:-1].tolist()) == first_block
    ends = ds.sequence_pointers // 2 + ds.sequence_lengths - 1  # last token of each document
    assert (np.asarray(np.memmap(tmp_path / "shk_text_document.bin", np.uint16, "r"))[ends] == 2).all()


def test_model_without_eos_is_refused(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "noeos"), vocab_size=30, eos_id=-1, minloglevel=2
    )
    with pytest.raises(TokenizerError, match="has no EOS piece"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "noeos.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"expected a SentencePiece \.model file"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "junk.model")


def test_inspect_truncates_long_documents_and_refuses_the_wrong_default(tmp_path, gpt2_tokenizer, run_cli):
    from data_tools.stats import compute_stats, write_stats

    text = " ".join(f"word{i}" for i in range(3000))
    ids = [*gpt2_tokenizer.encode(text), gpt2_tokenizer.eod]
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        w.add_document(ids)
    result = run_cli("data_tools.inspect", tmp_path / "ds", "--doc", "0", "--max-tokens", "100")
    assert result.returncode == 0, result.stderr
    assert gpt2_tokenizer.decode(ids[:100]) in result.stdout and "word2999" not in result.stdout
    assert f"[truncated: the first 100 of {len(ids):,} tokens; --full prints all of them]" in result.stdout
    result = run_cli("data_tools.inspect", tmp_path / "ds", "--doc", "0", "--full")
    assert "word2999<|endoftext|>" in result.stdout and "truncated" not in result.stdout
    # a dataset whose sidecar names another tokenizer is not decoded with GPT-2's files by default
    write_stats(tmp_path / "ds", compute_stats(tmp_path / "ds", tokenizer={"type": "SentencePieceTokenizer"}))
    result = run_cli("data_tools.inspect", tmp_path / "ds", "--doc", "0")
    assert result.returncode == 2 and "made with SentencePieceTokenizer" in result.stderr
