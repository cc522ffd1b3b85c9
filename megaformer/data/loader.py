"""Prefetching loaders of training and validation micro-batches (``data.num_workers``).

Which samples a data-parallel rank reads is fixed by one formula, the one the trainer has always
used, so that runs stay bitwise identical whatever the number of workers: at optimizer step ``s``,
micro-batch ``m`` in ``range(gas)`` with ``gas = global_batch_size // (micro_batch_size * dp_size)``,
data-parallel rank ``r`` reads the ``micro_batch_size`` consecutive samples starting at::

    first = s * global_batch_size + (m * dp_size + r) * micro_batch_size

One step thus reads samples ``[s * global_batch_size, (s + 1) * global_batch_size)``, cut into
micro-batches of consecutive samples dealt round-robin to the ranks. Validation uses the same cut on
steps ``0 .. eval_batches - 1`` of the validation samples, so one evaluation reads the same
micro-batches (the same samples in each) at any data-parallel size, only spread over the ranks.

The loaders are ``torch.utils.data.DataLoader`` s over the sample objects of
:mod:`megaformer.data.gpt_dataset` with a batch sampler that yields these index lists; with
``num_workers > 0`` worker processes (forked, so the memory maps are shared, not copied) read and
stack the samples ahead of the training loop.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from megaformer.data.mlm import collate_mlm

__all__ = [
    "MicroBatchSampler",
    "Samples",
    "collate_for",
    "collate_samples",
    "micro_batch_first",
    "train_loader",
    "valid_loader",
    "valid_num_samples",
]


class Samples(Protocol):
    """What the loaders read: ``len(samples)`` samples, ``samples[i]`` an int64[seq_len + 1] array."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> np.ndarray: ...


def _gas(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step and rank; raises ValueError when the sizes do not divide."""
    if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
        raise ValueError(
            f"global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size} and "
            f"dp_size={dp_size} must all be >= 1"
        )
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
            f"{micro_batch_size} x dp_size={dp_size}; set train.global_batch_size to a multiple of "
            f"{micro_batch_size * dp_size}"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def micro_batch_first(
    step: int, micro: int, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> int:
    """Index of the first sample of micro-batch ``micro`` of step ``step`` on data-parallel rank
    ``dp_rank``: ``step * global_batch_size + (micro * dp_size + dp_rank) * micro_batch_size``."""
    return step * global_batch_size + (micro * dp_size + dp_rank) * micro_batch_size


class MicroBatchSampler(Sampler[list[int]]):
    """Batch sampler: the sample indices of each micro-batch of one data-parallel rank, for steps
    ``start_step .. end_step - 1``, step-major and micro-batch-minor (see the module docstring).

    ``len()`` is the number of micro-batches, ``(end_step - start_step) * gas``. Iterating again
    starts again at ``start_step``.

    Raises:
        ValueError: sizes that do not divide (``global_batch_size`` not a multiple of
            ``micro_batch_size * dp_size``), ``dp_rank`` outside ``[0, dp_size)``, steps out of
            order, or more samples needed than ``num_samples`` holds.
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_step: int,
        end_step: int,
        num_samples: int,
    ) -> None:
        self.gas = _gas(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if not 0 <= start_step <= end_step:
            raise ValueError(
                f"expected 0 <= start_step <= end_step, got start_step={start_step}, end_step={end_step}"
            )
        if end_step * global_batch_size > num_samples:
            raise ValueError(
                f"steps up to {end_step} need {end_step * global_batch_size} samples "
                f"({end_step} x global_batch_size {global_batch_size}), but there are {num_samples}; "
                "build the samples for at least that many"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.start_step, self.end_step = start_step, end_step

    def __len__(self) -> int:
        return (self.end_step - self.start_step) * self.gas

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            for micro in range(self.gas):
                first = micro_batch_first(
                    step,
                    micro,
                    global_batch_size=self.global_batch_size,
                    micro_batch_size=self.micro_batch_size,
                    dp_rank=self.dp_rank,
                    dp_size=self.dp_size,
                )
                yield list(range(first, first + self.micro_batch_size))


def collate_samples(rows: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks samples into ``(tokens, labels)``.

    Args:
        rows: ``micro_batch_size`` arrays of int64[seq_len + 1].

    Returns:
        ``tokens = x[:, :-1]`` and ``labels = x[:, 1:]``, each a contiguous CPU int64 tensor of
        shape ``[micro_batch_size, seq_len]``.
    """
    x = torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _worker_init(worker_id: int) -> None:
    # A worker only indexes memory maps and stacks arrays: one thread each, or every worker would
    # start a full-size intra-op pool and they would fight the training process for the cores.
    # (torch's worker loop does this too today; said here so it does not hang on that.)
    torch.set_num_threads(1)


def collate_for(objective: str) -> Callable[[Sequence[Any]], tuple[torch.Tensor, torch.Tensor]]:
    """The collate function of ``model.objective``: :func:`collate_samples` (``clm``: shifted
    next-token labels) or :func:`megaformer.data.mlm.collate_mlm` (``mlm``: ``(input_ids, labels)``
    samples, no shift)."""
    if objective == "mlm":

        return collate_mlm
    if objective != "clm":
        raise ValueError(f"objective={objective!r}: use 'clm' or 'mlm'")
    return collate_samples


def _loader(
    samples: Samples,
    sampler: MicroBatchSampler,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int,
    objective: str = "clm",
) -> DataLoader:
    if num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers}: must be >= 0")
    workers = {}
    if num_workers > 0:
        workers = {
            "worker_init_fn": _worker_init,
            "persistent_workers": True,  # validation is read once per evaluation: keep the workers
            "prefetch_factor": prefetch_factor,
            # Fork: the workers share the parent's memory maps of .bin/.idx and of the sample
            # indices. Under spawn each would be sent a pickled copy of the index arrays.
            "multiprocessing_context": multiprocessing.get_context("fork"),
        }
    return DataLoader(
        samples,  # map-style: __len__ and __getitem__ are all a DataLoader needs
        batch_sampler=sampler,
        collate_fn=collate_for(objective),
        num_workers=num_workers,
        pin_memory=pin_memory,
        **workers,
    )


def train_loader(
    samples: Samples,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start_step: int,
    end_step: int,
    num_workers: int,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    objective: str = "clm",
) -> DataLoader:
    """The training micro-batches of one data-parallel rank, steps ``start_step .. end_step - 1``.

    Args:
        samples: training samples (``GPTSamples`` / ``BlendedSamples``): ``samples[i]`` is
            int64[seq_len + 1].
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per micro-batch.
        dp_rank, dp_size: this rank's data-parallel index and the data-parallel size.
        start_step: first step (a resumed run's step): its first micro-batch comes first.
        end_step: one past the last step.
        num_workers: loader processes; 0 reads in this process, on demand.
        pin_memory: put batches in page-locked memory (pass ``device.type == "cuda"``), so that
            ``.to(device, non_blocking=True)`` overlaps the copy with compute.
        prefetch_factor: micro-batches each worker prepares ahead (``num_workers > 0`` only).
        objective: ``model.objective``: ``mlm`` reads masked-LM samples (``(input_ids, labels)``
            pairs, :mod:`megaformer.data.mlm`) and yields them unshifted (see :func:`collate_for`).

    Returns:
        A ``DataLoader`` yielding ``(tokens, labels)``, CPU int64 tensors ``[micro_batch_size,
        seq_len]``, step-major, micro-batch-minor: ``(end_step - start_step) * gas`` of them
        (``len()``), micro-batch ``m`` of step ``s`` holding samples ``first .. first +
        micro_batch_size - 1`` with ``first = s * global_batch_size + (m * dp_size + dp_rank) *
        micro_batch_size``.

    Raises:
        ValueError: sizes that do not divide, a bad ``dp_rank``, steps out of order, too few
            samples for ``end_step``, or ``num_workers < 0``.
    """
    sampler = MicroBatchSampler(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        start_step=start_step,
        end_step=end_step,
        num_samples=len(samples),
    )
    return _loader(samples, sampler, num_workers, pin_memory, prefetch_factor, objective)


def valid_num_samples(eval_batches: int, global_batch_size: int) -> int:
    """Validation samples one evaluation reads: ``eval_batches * global_batch_size`` (the same at
    any data-parallel size)."""
    return eval_batches * global_batch_size


def valid_loader(
    samples: Samples,
    *,
    eval_batches: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    objective: str = "clm",
) -> DataLoader:
    """One evaluation's micro-batches of one data-parallel rank; iterate it once per evaluation.

    Reads the first ``valid_num_samples(eval_batches, global_batch_size)`` validation samples, cut
    like training steps ``0 .. eval_batches - 1`` (see ``train_loader``): over all ranks, the same
    micro-batches of the same samples at any ``dp_size``; each rank gets ``eval_batches * gas`` of
    them. With ``num_workers > 0`` the workers persist from one evaluation to the next.

    Returns:
        A re-iterable ``DataLoader`` of ``(tokens, labels)``, CPU int64 ``[micro_batch_size, seq_len]``.

    Raises:
        ValueError: as ``train_loader``; too few validation samples for ``eval_batches``.
    """
    needed = valid_num_samples(eval_batches, global_batch_size)
    if needed > len(samples):
        raise ValueError(
            f"one evaluation reads eval_batches={eval_batches} x global_batch_size={global_batch_size} "
            f"= {needed} validation samples, but there are {len(samples)}; build the validation samples "
            f"with valid_num_samples({eval_batches}, {global_batch_size}) or lower train.eval_batches"
        )
    return train_loader(
        samples,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        start_step=0,
        end_step=eval_batches,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        objective=objective,
    )
