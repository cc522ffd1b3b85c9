"""Training samples: boundaries across documents, EOD placement, determinism, split by documents."""

from __future__ import annotations

import itertools
import lzma
from pathlib import Path

import numpy as np
import pytest

from data_tools.indexed_dataset import DataFormatError, IndexedDataset, IndexedDatasetWriter
from data_tools.stats import compute_stats, write_stats
from megaformer.data.gpt_dataset import (
    WHOLE_HELDOUT,
    BlendedSamples,
    GPTSamples,
    build_sample_index,
    build_train_valid,
    document_lengths,
    samples_unigram_entropy,
    split_documents,
    unigram_entropy,
)

EOD = 50256
REPO = Path(__file__).resolve().parents[2]


def _write(prefix: Path, docs: list[list[int]]) -> str:
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for doc in docs:
            writer.add_document(np.array(doc, dtype=np.int64))
    # the statistics sidecar preprocess writes beside every dataset (samples_unigram_entropy reads it)
    write_stats(prefix, compute_stats(prefix))
    return str(prefix)


@pytest.fixture
def synthetic(tmp_path) -> tuple[str, list[list[int]]]:
    # Document d holds tokens d*100 .. d*100+len-1 then EOD: every token tells where it came from.
    rng = np.random.default_rng(0)
    docs = [[d * 100 + k for k in range(int(rng.integers(1, 40)))] + [EOD] for d in range(30)]
    return _write(tmp_path / "syn_text_document", docs), docs


def test_samples_follow_the_document_stream(synthetic):
    prefix, docs = synthetic
    ds = IndexedDataset(prefix)
    lengths = document_lengths(ds)
    assert lengths.tolist() == [len(d) for d in docs]
    seq_len, n = 16, 50
    ids = np.arange(len(docs))
    doc_idx, sample_idx, shuffle_idx = build_sample_index(ids, lengths, seq_len, n, seed=3)
    stream = np.concatenate([docs[d] for d in doc_idx])
    samples = GPTSamples(ds, doc_idx, sample_idx, shuffle_idx, seq_len)
    assert len(samples) == n
    # every sample at most once; the order is drawn per chunk of the stream, so the n served are
    # the first n of that order (not always range(n)): data_tools.sample_index
    assert len(set(shuffle_idx.tolist())) == n and int(shuffle_idx.max()) < len(sample_idx) - 1
    for i in range(n):
        j = int(shuffle_idx[i])
        expected = stream[j * seq_len : j * seq_len + seq_len + 1]
        np.testing.assert_array_equal(samples[i], expected)
    # Consecutive samples (unshuffled order) share exactly one token: no token is dropped.
    natural = GPTSamples(ds, doc_idx, sample_idx, np.arange(n), seq_len)
    for j in range(n - 1):
        assert natural[j][-1] == natural[j + 1][0]


def test_eod_closes_every_document_inside_samples(synthetic):
    prefix, docs = synthetic
    ds = IndexedDataset(prefix)
    lengths = document_lengths(ds)
    seq_len = 8
    doc_idx, sample_idx, _ = build_sample_index(np.arange(len(docs)), lengths, seq_len, 60, seed=1)
    samples = GPTSamples(ds, doc_idx, sample_idx, np.arange(60), seq_len)
    for j in range(60):
        x = samples[j]
        for a, b in itertools.pairwise(x):
            if b != EOD and a != EOD:
                # inside one document, tokens are consecutive; a document change only after EOD
                assert b == a + 1, (j, x)
            if a == EOD:
                assert b % 100 == 0  # the next document starts at its first token


def test_epochs_reshuffle_documents_and_are_deterministic(synthetic):
    prefix, docs = synthetic
    lengths = document_lengths(IndexedDataset(prefix))
    ids = np.arange(len(docs))
    total = int(lengths.sum())
    n = (3 * total) // 8  # needs about 3 epochs at seq_len 8
    a = build_sample_index(ids, lengths, 8, n, seed=5)
    b = build_sample_index(ids, lengths, 8, n, seed=5)
    c = build_sample_index(ids, lengths, 8, n, seed=6)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    doc_idx = a[0]
    epochs = len(doc_idx) // len(docs)
    assert epochs >= 3
    for e in range(epochs):
        assert sorted(doc_idx[e * len(docs) : (e + 1) * len(docs)].tolist()) == list(range(len(docs)))
    assert not np.array_equal(doc_idx[: len(docs)], doc_idx[len(docs) : 2 * len(docs)])


def test_split_is_by_whole_documents_and_disjoint():
    train, valid = split_documents(100, 0.1, seed=9)
    assert len(valid) == 10 and len(train) == 90
    assert not set(train.tolist()) & set(valid.tolist())
    again = split_documents(100, 0.1, seed=9)
    np.testing.assert_array_equal(valid, again[1])
    with pytest.raises(DataFormatError):
        split_documents(1, 0.1, seed=0)


def test_train_and_valid_never_share_a_document(synthetic):
    prefix, _ = synthetic
    train, valid, info = build_train_valid(prefix, 8, 40, 4, valid_fraction=0.2, seed=2)
    assert info["valid_documents"] == 6 and info["train_documents"] == 24
    assert not set(train.doc_idx.tolist()) & set(valid.doc_idx.tolist())


def test_split_seed_holds_out_the_same_documents_for_every_training_seed(synthetic):
    """data.split_seed: runs of different train.seed evaluate on the same documents (and train on
    the same others, in another order); without it each seed holds out its own."""
    prefix, _ = synthetic
    runs = {s: build_train_valid(prefix, 8, 40, 4, valid_fraction=0.2, seed=s, split_seed=7) for s in (1, 2)}
    (train1, valid1, _), (train2, valid2, _) = runs[1], runs[2]
    assert set(valid1.doc_idx.tolist()) == set(valid2.doc_idx.tolist())
    assert [valid1[i].tolist() for i in range(4)] == [valid2[i].tolist() for i in range(4)]
    assert set(train1.doc_idx.tolist()) == set(train2.doc_idx.tolist())
    assert [train1[i].tolist() for i in range(8)] != [train2[i].tolist() for i in range(8)]
    # the held-out documents are split_seed's, as split_documents chooses them
    assert set(valid1.doc_idx.tolist()) == set(split_documents(30, 0.2, seed=7)[1].tolist())
    # default (None): the training seed chooses, so the two seeds hold out other documents
    own = [build_train_valid(prefix, 8, 40, 4, valid_fraction=0.2, seed=s)[1] for s in (1, 2)]
    assert set(own[0].doc_idx.tolist()) == set(split_documents(30, 0.2, seed=1)[1].tolist())
    assert set(own[0].doc_idx.tolist()) != set(own[1].doc_idx.tolist())


def test_the_whole_held_out_set_starts_with_the_sampled_validation(synthetic, tmp_path):
    """train.final_eval_batches=0: every sample the held-out documents hold, and the regular
    validations' samples are its first ones (so a run's curve is the same either way)."""
    prefix, docs = synthetic
    _, sampled, info = build_train_valid(prefix, 8, 40, 4, valid_fraction=0.2, seed=2, split_seed=7)
    _, whole, info_whole = build_train_valid(
        prefix, 8, 40, WHOLE_HELDOUT, valid_fraction=0.2, seed=2, split_seed=7
    )
    held = split_documents(30, 0.2, seed=7)[1]
    tokens = sum(len(docs[d]) for d in held)
    assert info_whole["valid_tokens"] == info["valid_tokens"] == tokens
    assert len(whole) == (tokens - 1) // 8 and len(sampled) == 4
    assert [whole[i].tolist() for i in range(4)] == [sampled[i].tolist() for i in range(4)]
    # every held-out token is read once, in order, but the last sample's final one (its label only)
    stream = [t for d in sorted(held.tolist(), key=whole.doc_idx.tolist().index) for t in docs[d]]
    read = [t for i in range(len(whole)) for t in whole[i].tolist()[:-1]]
    assert read == stream[: len(read)] and len(stream) - len(read) < 8 + 1
    # a blend: each dataset's whole held-out set, blended in proportion to their sizes
    other = _write(tmp_path / "other_text_document", docs[:20])
    blend = f"0.5 {prefix} 0.5 {other}"
    _, mixed, _ = build_train_valid(
        "", 8, 40, WHOLE_HELDOUT, valid_fraction=0.2, seed=2, split_seed=7, blend=blend
    )
    parts = [build_train_valid(p, 8, 40, WHOLE_HELDOUT, 0.2, 2, split_seed=7)[1] for p in (prefix, other)]
    assert len(mixed) == sum(len(p) for p in parts)


def test_too_little_validation_data_is_a_clear_error(synthetic):
    prefix, _ = synthetic
    with pytest.raises(DataFormatError) as info:
        build_train_valid(prefix, 64, 10, 1000, valid_fraction=0.05, seed=2)
    assert "data.valid_fraction" in str(info.value)


def test_missing_prefix_is_a_clear_error(tmp_path):
    with pytest.raises(DataFormatError) as info:
        build_train_valid(str(tmp_path / "nope_text_document"), 8, 1, 1, 0.1, 0)
    assert "data_tools.preprocess" in str(info.value)


def test_real_text_samples_match_tokenizer_stream(tmp_path):
    """Real novel text through our GPT-2 tokenizer: samples are the token stream with EOD per doc."""
    from data_tools.tokenizer import build_tokenizer

    tok = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(REPO / "data/gpt2-bpe/encoder.json"),
        merge_file=str(REPO / "data/gpt2-bpe/vocab.bpe"),
    )
    with lzma.open(REPO / "data/gutenberg-novels/pg42.txt.xz", "rt", encoding="utf-8-sig") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()][:200]
    docs = [tok.encode(p) + [tok.eod] for p in paragraphs]
    prefix = _write(tmp_path / "jekyll_text_document", docs)
    ds = IndexedDataset(prefix)
    lengths = document_lengths(ds)
    seq_len = 32
    n = (int(lengths.sum()) - 1) // seq_len
    doc_idx, sample_idx, _ = build_sample_index(
        np.arange(len(docs)), lengths, seq_len, n, seed=0, shuffle=False
    )
    samples = GPTSamples(ds, doc_idx, sample_idx, np.arange(n), seq_len)
    stream = np.concatenate([s[:-1] for s in (samples[i] for i in range(n))])
    flat = np.concatenate(docs)
    np.testing.assert_array_equal(stream, flat[: len(stream)])
    assert tok.decode(samples[0][:-1].tolist()).startswith(paragraphs[0][:20])
    h = unigram_entropy(ds)
    counts = np.bincount(flat)
    p = counts[counts > 0] / counts.sum()
    assert h == pytest.approx(float(-(p * np.log(p)).sum()))


def test_blend_unigram_entropy_is_the_mixtures(tmp_path):
    """Two parts on disjoint token ids, drawn 1:3: H(mix) = sum f_i H_i + H(f) (grouping rule)."""
    rng = np.random.default_rng(1)
    parts, entropies = [], []
    for k, low in enumerate((10, 500)):
        docs = [list(rng.integers(low, low + 50 * (k + 1), size=int(rng.integers(5, 30)))) for _ in range(40)]
        ds = IndexedDataset(_write(tmp_path / f"part{k}", docs))
        seq_len = 8
        n = (int(document_lengths(ds).sum()) - 1) // seq_len
        doc_idx, sample_idx, _ = build_sample_index(np.arange(40), document_lengths(ds), seq_len, n, seed=0)
        parts.append(GPTSamples(ds, doc_idx, sample_idx, np.arange(n), seq_len))
        entropies.append(unigram_entropy(ds))
    dataset_index = np.array([0, 1, 1, 1] * 10, dtype=np.int16)
    blend = BlendedSamples(parts, dataset_index, np.arange(40, dtype=np.int64) // 4)
    f = np.array([0.25, 0.75])
    expected = float((f * entropies).sum() - (f * np.log(f)).sum())
    assert samples_unigram_entropy(blend) == pytest.approx(expected, rel=1e-9)
    assert samples_unigram_entropy(parts[1]) == pytest.approx(entropies[1])
    assert abs(expected - entropies[0]) > 0.5  # the first part alone would be far off


def test_sample_order_does_not_depend_on_the_run_length():
    """The first N samples served are the same for any number of samples asked for, so a run
    extended from 20 to 30 steps serves in steps 21-30 no sample it served in steps 1-20 (within an
    epoch); the old order, one permutation of all samples, reshuffled on every change of length."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 200, 400).astype(np.int64)
    ids = np.arange(400)
    seq_len, batch = 16, 8
    per_epoch = int(lengths.sum()) // seq_len
    short = build_sample_index(ids, lengths, seq_len, 20 * batch, seed=3)
    long = build_sample_index(ids, lengths, seq_len, 30 * batch, seed=3)
    np.testing.assert_array_equal(long[2][: 20 * batch], short[2])  # the first 20 steps unchanged
    assert 30 * batch < per_epoch  # one epoch: no sample may repeat
    served = set(short[2].tolist())
    assert not served & set(long[2][20 * batch :].tolist())
    # and the samples themselves are the same stream positions (doc_idx, sample_idx agree)
    for i in range(20 * batch):
        j = int(short[2][i])
        np.testing.assert_array_equal(short[1][j], long[1][j])
    np.testing.assert_array_equal(short[0][: len(short[0])], long[0][: len(short[0])])
    # beyond one epoch too: 3 epochs asked, the first epoch's order is the 1-epoch run's
    three = build_sample_index(ids, lengths, seq_len, 3 * per_epoch, seed=3)
    one = build_sample_index(ids, lengths, seq_len, per_epoch - 5, seed=3)
    np.testing.assert_array_equal(three[2][: per_epoch - 5], one[2])
