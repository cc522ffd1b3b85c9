"""The prefetching loaders (``data.num_workers``): the trainer's index plan, bitwise the same with and
without workers, exact resume, and validation that reads the same micro-batches at any dp size."""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megaformer.data.gpt_dataset import GPTSamples, build_sample_index, document_lengths
from megaformer.data.loader import train_loader, valid_loader, valid_num_samples

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 32


@pytest.fixture(scope="module")
def samples(tmp_path_factory, gpt2_tokenizer) -> GPTSamples:
    """Shuffled samples of real text: paragraphs of a novel, GPT-2 BPE + EOD."""
    with lzma.open(REPO / "data/gutenberg-novels/pg42.txt.xz", "rt", encoding="utf-8-sig") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()][:400]
    prefix = str(tmp_path_factory.mktemp("loader") / "jekyll_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for p in paragraphs:
            writer.add_document(np.array([*gpt2_tokenizer.encode(p), gpt2_tokenizer.eod]))
    ds = IndexedDataset(prefix)
    lengths = document_lengths(ds)
    n = 400
    assert (int(lengths.sum()) - 1) // SEQ_LEN >= n
    index = build_sample_index(np.arange(ds.num_documents), lengths, SEQ_LEN, n, seed=7)
    return GPTSamples(ds, *index, SEQ_LEN)


def _expected(samples, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer read before the loader: the samples stacked, shifted by one."""
    rows = torch.from_numpy(np.stack([samples[i] for i in range(first, first + count)]))
    return rows[:, :-1], rows[:, 1:]


def _as_list(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t.clone(), y.clone()) for t, y in loader]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_index_plan_shapes_and_the_same_bits_with_workers(samples, dp_size):
    gbs, mbs, steps = 8, 2, 5
    gas = gbs // (mbs * dp_size)
    for rank in range(dp_size):
        kw = {"global_batch_size": gbs, "micro_batch_size": mbs, "dp_rank": rank, "dp_size": dp_size}
        inline = _as_list(train_loader(samples, **kw, start_step=0, end_step=steps, num_workers=0))
        workers = _as_list(train_loader(samples, **kw, start_step=0, end_step=steps, num_workers=2))
        assert len(inline) == len(workers) == steps * gas
        k = 0
        for step in range(steps):
            for micro in range(gas):
                first = step * gbs + (micro * dp_size + rank) * mbs
                tokens, labels = inline[k]
                assert tokens.shape == labels.shape == (mbs, SEQ_LEN)
                assert tokens.dtype == labels.dtype == torch.int64
                assert tokens.is_contiguous() and labels.is_contiguous() and tokens.device.type == "cpu"
                exp_tokens, exp_labels = _expected(samples, first, mbs)
                assert torch.equal(tokens, exp_tokens) and torch.equal(labels, exp_labels), (step, micro)
                assert torch.equal(workers[k][0], tokens) and torch.equal(workers[k][1], labels)
                k += 1


def test_start_step_resumes_at_exactly_the_right_batch(samples):
    kw = {"global_batch_size": 12, "micro_batch_size": 3, "dp_rank": 1, "dp_size": 2, "num_workers": 0}
    gas = 2
    full = _as_list(train_loader(samples, **kw, start_step=0, end_step=9))
    for start in (1, 4, 8, 9):
        resumed = train_loader(samples, **kw, start_step=start, end_step=9)
        assert len(resumed) == (9 - start) * gas
        got = _as_list(resumed)
        assert len(got) == len(full[start * gas :])
        for (a, b), (c, d) in zip(got, full[start * gas :]):
            assert torch.equal(a, c) and torch.equal(b, d)
    with_workers = _as_list(train_loader(samples, **{**kw, "num_workers": 2}, start_step=4, end_step=9))
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(with_workers, full[4 * gas :]))


def _valid_micro_batches(samples, dp_size: int, num_workers: int = 0) -> list[bytes]:
    """Every rank's validation micro-batches, as bytes, sorted: the multiset one evaluation reads."""
    out = []
    for rank in range(dp_size):
        loader = valid_loader(
            samples, eval_batches=3, global_batch_size=8, micro_batch_size=2, dp_rank=rank,
            dp_size=dp_size, num_workers=num_workers,
        )  # fmt: skip
        batches = _as_list(loader)
        assert len(batches) == 3 * 8 // (2 * dp_size)
        again = _as_list(loader)  # one pass per evaluation: re-iterable, the same every time
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(batches, again))
        out += [t.numpy().tobytes() + y.numpy().tobytes() for t, y in batches]
    return sorted(out)


def test_validation_reads_the_same_micro_batches_at_any_dp_size(samples):
    one = _valid_micro_batches(samples, 1)
    assert len(one) == 12 and len(set(one)) == 12
    assert _valid_micro_batches(samples, 2) == one
    assert _valid_micro_batches(samples, 4) == one
    assert _valid_micro_batches(samples, 2, num_workers=2) == one
    assert valid_num_samples(3, 8) == 24
    # they are the first 24 validation samples, in micro-batches of consecutive samples
    expected = sorted(
        b"".join(x.numpy().tobytes() for x in _expected(samples, first, 2)) for first in range(0, 24, 2)
    )
    assert one == expected


class _ThreadProbe:
    """Samples whose every token is the number of torch threads of the process that read it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(5, torch.get_num_threads(), dtype=np.int64)


def test_workers_use_one_thread_each():
    loader = train_loader(
        _ThreadProbe(), global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1,
        start_step=0, end_step=4, num_workers=2,
    )  # fmt: skip
    assert all(int(t.max()) == 1 for t, _ in loader)


def test_bad_sizes_are_clear_errors(samples):
    kw = {"micro_batch_size": 2, "dp_rank": 0, "start_step": 0, "num_workers": 0}
    with pytest.raises(
        ValueError, match=r"global_batch_size=10 is not a multiple of micro_batch_size=2 x dp_size=2"
    ):
        train_loader(samples, global_batch_size=10, dp_size=2, end_step=1, **kw)
    with pytest.raises(ValueError, match=r"need 408 samples .* but there are 400"):
        train_loader(samples, global_batch_size=8, dp_size=1, end_step=51, **kw)
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside"):
        train_loader(samples, global_batch_size=8, dp_size=2, end_step=1, **{**kw, "dp_rank": 2})
    with pytest.raises(ValueError, match="start_step"):
        train_loader(samples, global_batch_size=8, dp_size=1, end_step=1, **{**kw, "start_step": 2})
    with pytest.raises(ValueError, match="eval"):
        valid_loader(
            samples,
            eval_batches=60,
            global_batch_size=8,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
            num_workers=0,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_batches_on_cuda(samples):
    loader = train_loader(
        samples, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, start_step=0,
        end_step=2, num_workers=2, pin_memory=True,
    )  # fmt: skip
    for tokens, labels in loader:
        assert tokens.is_pinned() and labels.is_pinned()
        assert torch.equal(tokens.to("cuda", non_blocking=True).cpu(), tokens)
