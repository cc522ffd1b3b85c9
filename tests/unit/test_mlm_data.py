"""RoBERTa's data path (megaformer.data.mlm) on real text: blocks that tile the document stream, masking
rates, special tokens never masked, masks keyed by (seed, epoch, block) alone, the vocabulary rows."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from data_tools.indexed_dataset import DataFormatError, IndexedDataset
from megaformer.data.gpt_dataset import BlendedSamples, build_train_valid
from megaformer.data.loader import MicroBatchSampler
from megaformer.data.mlm import (
    BOS_ID,
    EOD_ID,
    GPT2_VOCAB_SIZE,
    IGNORE_INDEX,
    MASK_ID,
    MLM_VOCAB_SIZE,
    PAD_ID,
    MaskedLMSamples,
    MaskingConfig,
    as_masked_lm,
    build_mlm_samples,
    collate_mlm,
    mask_block,
    mlm_vocab_rows,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
SPECIALS = [BOS_ID, EOD_ID, PAD_ID]
SEED = 1234


@pytest.fixture(scope="module")
def novels(tmp_path_factory) -> str:
    """Three Gutenberg novels, one document per paragraph block, GPT-2 BPE + EOD (175k tokens), as
    ``data_tools.preprocess`` writes them (the same build as tests/distributed's ``gutenberg_prefix``)."""
    out = tmp_path_factory.mktemp("mlm") / "novels"
    books = [DATA / "gutenberg-novels" / name for name in ("pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz")]
    cmd = [
        sys.executable, "-m", "data_tools.preprocess",
        "--input", *map(str, books),
        "--output-prefix", str(out),
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(DATA / "gpt2-bpe" / "encoder.json"),
        "--merge-file", str(DATA / "gpt2-bpe" / "vocab.bpe"),
        "--append-eod", "--text-split-blank-lines", "--skip-bad-records", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    return f"{out}_text_document"


@pytest.fixture(scope="module")
def big(novels) -> MaskedLMSamples:
    """2,000 RoBERTa-size blocks (512 tokens): about 6 passes over the novels."""
    return build_mlm_samples(IndexedDataset(novels), seq_len=512, num_samples=2000, seed=SEED)


def _documents(dataset: IndexedDataset) -> list[np.ndarray]:
    """Every document's tokens, read straight from the ``.bin`` (independent of the sample reader)."""
    tokens = np.fromfile(dataset.bin_path, dtype=dataset.dtype).astype(np.int64)
    lengths = dataset.document_lengths(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [tokens[s : s + n] for s, n in zip(starts, lengths)]


def _originals(input_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The unmasked tokens, recovered from a sample: labels where chosen, the input elsewhere."""
    return np.where(labels != IGNORE_INDEX, labels, input_ids)


def test_blocks_tile_the_stream_each_token_once_per_epoch(novels):
    ds = IndexedDataset(novels)
    docs = _documents(ds)
    assert all(d[-1] == EOD_ID for d in docs)  # preprocess --append-eod: EOD is RoBERTa's </s>
    seq_len = 64
    stride = seq_len - 1  # text tokens per block (one slot is <s>)
    per_epoch = sum(len(d) for d in docs)
    n = -(-per_epoch // stride)  # the blocks starting in the first pass: its shuffled chunk
    samples = build_mlm_samples(ds, seq_len=seq_len, num_samples=n, seed=SEED)
    # the first pass is served first, each of its blocks once, in shuffled order
    ids = [samples.block_id(i) for i in range(n)]
    assert sorted(ids) == list(range(n)) and ids != sorted(ids)
    stream = np.concatenate([docs[d] for d in np.asarray(samples.blocks.doc_idx)])
    got = np.empty(n * stride, dtype=np.int64)
    for i in range(n):
        input_ids, labels = samples[i]
        assert input_ids.shape == labels.shape == (seq_len,)
        assert input_ids.dtype == labels.dtype == np.int64
        block = _originals(input_ids, labels)
        assert block[0] == BOS_ID
        j = ids[i]
        got[j * stride : (j + 1) * stride] = block[1:]
    # Blocks do not overlap (unlike causal samples, which share one token for the label shift) and
    # leave no gap: together they are the stream's first n * stride tokens.
    np.testing.assert_array_equal(got, stream[: n * stride])
    # So every token of the first pass appears exactly once; the last block runs on into the
    # second pass by fewer than `stride` tokens (the next pass's blocks start there).
    assert 0 <= n * stride - per_epoch < stride
    first_pass = np.bincount(got[:per_epoch], minlength=GPT2_VOCAB_SIZE)
    corpus = np.bincount(np.concatenate(docs), minlength=GPT2_VOCAB_SIZE)
    np.testing.assert_array_equal(first_pass, corpus)
    # The EOD separators are where the documents end, inside blocks as well as across them.
    assert int((got[:per_epoch] == EOD_ID).sum()) == len(docs)


def test_masking_rates_over_2000_blocks(big):
    rows = [big[i] for i in range(len(big))]
    x = np.stack([r[0] for r in rows])  # (2000, 512)
    y = np.stack([r[1] for r in rows])
    orig = np.stack([big.tokens(i) for i in range(len(big))])
    np.testing.assert_array_equal(_originals(x, y), orig)  # labels carry the original ids
    special = np.isin(orig, SPECIALS)
    chosen = y != IGNORE_INDEX
    assert (orig[:, 0] == BOS_ID).all()
    # Never a special token chosen, nor changed; <mask> only at chosen positions.
    assert not (chosen & special).any()
    np.testing.assert_array_equal(x[special], orig[special])
    assert not ((x == MASK_ID) & ~chosen).any()
    np.testing.assert_array_equal(x[~chosen], orig[~chosen])
    # 15% of the non-special tokens, rounded per block as fairseq does: int(0.15 n + u).
    n = (~special).sum(axis=1)
    k = chosen.sum(axis=1)
    assert ((k == np.floor(0.15 * n)) | (k == np.floor(0.15 * n) + 1)).all()
    rate = chosen.sum() / (~special).sum()
    assert abs(rate - 0.15) < 0.005, rate
    # Of the chosen: 80% <mask>, 10% random, 10% unchanged (a random draw equal to the original,
    # p = 1/50256, counts as unchanged).
    masked = (x == MASK_ID) & chosen
    replaced = (x != orig) & (x != MASK_ID) & chosen
    kept = (x == orig) & chosen
    total = chosen.sum()
    assert total > 100_000
    for name, got, want in [("mask", masked, 0.8), ("random", replaced, 0.1), ("unchanged", kept, 0.1)]:
        assert abs(got.sum() / total - want) < 0.005, (name, got.sum() / total)
    # Random replacements are real GPT-2 symbols, never a special id or <|endoftext|>.
    drawn = x[replaced]
    assert drawn.min() >= 0 and drawn.max() < EOD_ID
    assert not np.isin(drawn, [*SPECIALS, MASK_ID]).any()
    # Uniform over the 50256 symbols: as many distinct ids as k uniform draws give, N (1 - e^(-k/N)),
    # and a mean of (N - 1) / 2 within 5 standard errors.
    symbols = EOD_ID
    distinct = symbols * (1 - np.exp(-drawn.size / symbols))
    assert abs(len(np.unique(drawn)) / distinct - 1) < 0.01
    assert abs(drawn.mean() - (symbols - 1) / 2) < 5 * symbols / np.sqrt(12 * drawn.size)


def _all(samples, order) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {i: samples[i] for i in order}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        np.testing.assert_array_equal(a[i][0], b[i][0])
        np.testing.assert_array_equal(a[i][1], b[i][1])


def test_same_masks_in_any_order_at_any_dp_size_and_after_a_restart(novels):
    ds = IndexedDataset(novels)
    samples = build_mlm_samples(ds, seq_len=128, num_samples=64, seed=SEED)
    in_order = _all(samples, range(64))
    _assert_same(in_order, _all(samples, reversed(range(64))))
    # A restart: the index rebuilt and a new object; nothing carried over.
    again = build_mlm_samples(IndexedDataset(novels), seq_len=128, num_samples=64, seed=SEED)
    _assert_same(in_order, _all(again, range(64)))
    # Data-parallel ranks read micro-batches dealt round-robin (megaformer.data.loader); at dp 1
    # and dp 2 (and with loader workers) every sample gets the same mask.
    gbs, mbs, steps = 16, 2, 4
    for dp_size in (1, 2):
        seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for rank in range(dp_size):
            sampler = MicroBatchSampler(
                global_batch_size=gbs,
                micro_batch_size=mbs,
                dp_rank=rank,
                dp_size=dp_size,
                start_step=0,
                end_step=steps,
                num_samples=len(samples),
            )
            for batch in sampler:
                for i in batch:
                    assert i not in seen
                    seen[i] = samples[i]
        _assert_same(in_order, seen)
    sampler = MicroBatchSampler(
        global_batch_size=gbs,
        micro_batch_size=mbs,
        dp_rank=1,
        dp_size=2,
        start_step=0,
        end_step=steps,
        num_samples=len(samples),
    )
    loader = DataLoader(
        samples,
        batch_sampler=sampler,
        collate_fn=collate_mlm,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    for batch, (input_ids, labels) in zip(sampler, loader):
        assert input_ids.shape == labels.shape == (mbs, 128)
        for row, i in enumerate(batch):
            np.testing.assert_array_equal(input_ids[row].numpy(), in_order[i][0])
            np.testing.assert_array_equal(labels[row].numpy(), in_order[i][1])


def test_masks_are_keyed_by_seed_epoch_and_block(novels):
    ds = IndexedDataset(novels)
    samples = build_mlm_samples(ds, seq_len=128, num_samples=32, seed=SEED)
    for i in range(32):
        want = mask_block(samples.tokens(i), seed=SEED, epoch=0, index=samples.block_id(i))
        np.testing.assert_array_equal(samples[i][0], want[0])
        np.testing.assert_array_equal(samples[i][1], want[1])
    base = [samples[i][1] for i in range(32)]
    # Another epoch (fairseq's set_epoch) or another seed: the same blocks, other masks.
    other_epoch = MaskedLMSamples(samples.blocks, seed=SEED, epoch=1)
    other_seed = MaskedLMSamples(samples.blocks, seed=SEED + 1)
    for other in (other_epoch, other_seed):
        for i in range(32):
            np.testing.assert_array_equal(other.tokens(i), samples.tokens(i))
        assert sum(np.array_equal(other[i][1], base[i]) for i in range(32)) == 0
    # Block ids, not serving positions, key the draw: two blocks never share a mask pattern.
    patterns = {tuple(np.flatnonzero(y != IGNORE_INDEX)) for y in base}
    assert len(patterns) == 32
    # The same key on the same tokens is the same draw, in any process.
    tokens = samples.tokens(0)
    a = mask_block(tokens, seed=7, epoch=3, index=11)
    b = mask_block(tokens.copy(), seed=7, epoch=3, index=11)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not np.array_equal(a[1], mask_block(tokens, seed=7, epoch=3, index=12)[1])
    assert not np.array_equal(a[1], mask_block(tokens, seed=7, epoch=3, index=11, part=1)[1])


def test_train_valid_and_blends_wrap_the_causal_builder(novels):
    seq_len = 128
    train, valid, _ = build_train_valid(novels, seq_len - 1, 40, 8, 0.05, SEED)
    mtrain, mvalid = as_masked_lm(train, seed=SEED), as_masked_lm(valid, seed=SEED)
    assert isinstance(mtrain, MaskedLMSamples) and mtrain.seq_len == seq_len and len(mtrain) == 40
    assert [mvalid.block_id(i) for i in range(8)] == list(range(8))  # validation: stream order
    for s in (mtrain, mvalid):
        x, y = s[3]
        assert x.shape == y.shape == (seq_len,) and x[0] == BOS_ID
    # Validation masks are a function of the block: the same every evaluation.
    np.testing.assert_array_equal(mvalid[5][1], as_masked_lm(valid, seed=SEED)[5][1])
    # A blend is wrapped part by part; each part keys its masks apart.
    blend = BlendedSamples([train, train], np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1]))
    mblend = as_masked_lm(blend, seed=SEED)
    assert isinstance(mblend, BlendedSamples) and [p.part for p in mblend.parts] == [0, 1]
    np.testing.assert_array_equal(_originals(*mblend[0]), _originals(*mblend[1]))  # the same block
    assert not np.array_equal(mblend[0][1], mblend[1][1])  # masked apart


def test_vocabulary_ids_and_rows(gpt2_files):
    encoder = json.loads(Path(gpt2_files[0]).read_text(encoding="utf-8"))
    ids = set(encoder.values())
    assert max(ids) == EOD_ID == GPT2_VOCAB_SIZE - 1 and encoder["<|endoftext|>"] == EOD_ID
    for special in (MASK_ID, BOS_ID, PAD_ID):
        assert special not in ids and GPT2_VOCAB_SIZE <= special < MLM_VOCAB_SIZE
    assert len({MASK_ID, BOS_ID, PAD_ID}) == 3
    # RoBERTa-base's 50265 rows at tp 1 without padding; megaformer's padding rule otherwise.
    assert mlm_vocab_rows() == MLM_VOCAB_SIZE == 50265
    assert mlm_vocab_rows(tp_size=2) == 50266
    assert mlm_vocab_rows(make_vocab_size_divisible_by=128) == 50304
    assert mlm_vocab_rows(tp_size=8, make_vocab_size_divisible_by=128) == 51200
    with pytest.raises(ValueError, match="tp_size=0"):
        mlm_vocab_rows(tp_size=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mask_id": 100}, "mask_id=100 is inside the data's vocabulary"),
        ({"mask_id": EOD_ID}, "mask_id=50256"),
        ({"mask_token_prob": 0.7}, r"mask_token_prob=0\.7 .* must sum to 1"),
        ({"random_token_prob": 0.2, "leave_unmasked_prob": 0.2}, "random_token_prob=0.2"),
        ({"mask_prob": 0.0}, r"mask_prob=0\.0"),
        ({"mask_prob": 1.5}, r"mask_prob=1\.5"),
        ({"leave_unmasked_prob": -0.1, "mask_token_prob": 1.0}, r"leave_unmasked_prob=-0\.1"),
        ({"mask_id": BOS_ID}, "also listed in special_ids"),
    ],
)
def test_bad_masking_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MaskingConfig(**kwargs)


def test_bad_input_names_the_value(novels):
    ds = IndexedDataset(novels)
    for seq_len in (1, 0):
        with pytest.raises(ValueError, match=f"seq_len={seq_len}"):
            build_mlm_samples(ds, seq_len=seq_len, num_samples=4, seed=SEED)
    with pytest.raises(ValueError, match="seed=-1"):
        mask_block(np.array([BOS_ID, 5, 6]), seed=-1, epoch=0, index=0)
    # A token the GPT-2 vocabulary does not hold (e.g. data tokenized with a larger vocabulary).
    with pytest.raises(DataFormatError, match="token id 50257"):
        mask_block(np.array([BOS_ID, 5, MASK_ID, 6]), seed=0, epoch=0, index=3)
    samples = build_mlm_samples(ds, seq_len=16, num_samples=4, seed=SEED)
    with pytest.raises(ValueError, match="bos_id=7"):
        MaskedLMSamples(samples.blocks, seed=SEED, bos_id=7)


def test_split_seed_fixes_the_held_out_masks_across_training_seeds(novels, tmp_path):
    """With data.split_seed set, two training seeds score the same held-out blocks with the same
    masked positions (the masks follow the held-out set's seed); the training blocks differ."""
    from data_tools.stats import read_stats
    from megaformer.config import load_config
    from megaformer.training.builders import _build_data

    def data(seed: int, split_seed: int):
        cfg = load_config(
            "configs/mlm-quickstart.yaml",
            [f"data.prefix={novels}", f"train.seed={seed}", f"data.split_seed={split_seed}",
             f"output.dir={tmp_path / str(seed)}", "train.steps=4", "train.warmup_steps=2",
             "train.eval_batches=2", "data.valid_fraction=0.1"],
        )  # fmt: skip
        return _build_data(cfg, [read_stats(novels)], [(1.0, novels)])

    a, b = data(1, 7), data(2, 7)
    for i in range(4):
        for x, y in zip(a.valid[i], b.valid[i]):
            np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(a.train[i][1], b.train[i][1]) for i in range(4))
    own = data(2, -1)  # split_seed -1: seed 2 holds out (and masks) its own
    assert any(not np.array_equal(a.valid[i][1], own.valid[i][1]) for i in range(4))
