"""Learning-rate schedule: linear warmup, then cosine or linear decay to min_lr (Megatron-LM's shape)."""

from __future__ import annotations

import math

import torch

from megaformer.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of the optimizer update number ``step`` (0-based).

    Warmup: ``lr · (step + 1) / warmup_steps`` for the first ``warmup_steps`` updates, so the first
    update is not wasted at lr 0. Decay over the remaining updates, reaching ``min_lr`` at the last:
    cosine ``min_lr + (lr - min_lr) · ½(1 + cos(π·progress))`` or linear.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_decay == "constant":
        return t.lr
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return t.min_lr + (t.lr - t.min_lr) * factor


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following :func:`lr_at`; DeepSpeed steps it once per optimizer update.

    Every param group is created with ``lr = t.lr`` so the lambda's factor is ``lr_at / t.lr``.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, t) / t.lr)
