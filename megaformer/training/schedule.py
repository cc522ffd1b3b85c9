"""Learning-rate schedule: linear warmup, then cosine or linear decay to min_lr (Megatron-LM's shape).

The decay ends at the run's last step. That is ``train.steps``, or, under a compute budget
(``budget.device_hours``), the step count the run fixes once it has measured its step time
(:mod:`megaformer.training.budget`): the schedule's length can be set once, before the decay starts.
"""

from __future__ import annotations

import math

import torch

from megaformer.config import RunConfig, TrainConfig


def lr_at(step: int, t: TrainConfig, total_steps: int | None = None) -> float:
    """Learning rate of the optimizer update number ``step`` (0-based).

    Warmup: ``lr · (step + 1) / warmup_steps`` for the first ``warmup_steps`` updates, so the first
    update is not wasted at lr 0. Decay over the remaining updates, reaching ``min_lr`` at the last
    (update ``total_steps - 1``; default ``t.steps``): cosine
    ``min_lr + (lr - min_lr) · ½(1 + cos(π·progress))`` or linear. ``lr_decay='ramp'``:
    ``(step + 1) · lr_ramp`` (the learning-rate stability test; ``lr`` and warmup unused).
    """
    total = t.steps if total_steps is None else total_steps
    if t.lr_decay == "ramp":  # the stability test (Shleifer et al. 2021, Fig. 5): no warmup, no decay
        return (step + 1) * t.lr_ramp
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_decay == "constant":
        return t.lr
    span = max(1, total - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return t.min_lr + (t.lr - t.min_lr) * factor


class Schedule:
    """:func:`lr_at` with a run length that may be fixed after the start (see the module docstring).

    Args:
        t: the training config.
        total_steps: the run's length (default ``t.steps``).
    """

    def __init__(self, t: TrainConfig, total_steps: int | None = None) -> None:
        self.t = t
        self.total_steps = t.steps if total_steps is None else total_steps

    def lr(self, step: int) -> float:
        """The learning rate of update ``step`` (0-based)."""
        return lr_at(step, self.t, self.total_steps)

    def resume_decay_end(self, total_steps: int) -> None:
        """Decay toward ``total_steps`` as the saved run did (a budget's length, decided before the
        resume and read from the checkpoint): no guard, since the saved run already decayed toward it."""
        self.total_steps = total_steps

    def set_total_steps(self, total_steps: int, step: int) -> None:
        """Fix the run's length at ``total_steps``, at update ``step``.

        Raises:
            ValueError: after warmup (the decay has begun toward another end), or a length not
                greater than ``step``.
        """
        if step > self.t.warmup_steps and self.t.lr_decay != "constant":
            raise ValueError(
                f"the run length is fixed at step {step}, after train.warmup_steps="
                f"{self.t.warmup_steps}: the decay already started toward step {self.total_steps}"
            )
        if total_steps <= step:
            raise ValueError(f"total_steps={total_steps} must exceed the current step {step}")
        self.total_steps = total_steps


def build_scheduler(
    optimizer: torch.optim.Optimizer, t: TrainConfig, schedule: Schedule | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following ``schedule`` (default: :func:`lr_at` over ``t.steps``); DeepSpeed steps
    it once per optimizer update.

    Every param group is created with ``lr = t.lr`` so the lambda's factor is ``lr / t.lr``.
    """
    schedule = schedule or Schedule(t)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.lr(step) / t.lr)


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> float:
    """Set every param group's learning rate to what the scheduler's lambda gives at its position
    (``last_epoch``: the updates it has stepped), as ``LambdaLR.step`` would; return the first
    group's.

    A resumed run gets its param groups' ``lr`` back from the checkpoint's optimizer state, as the
    saved run's schedule computed it for the next update. Where the schedule changed since (an
    extension: ``train.extend_steps``), that stale rate would drive the first new update; after this
    the next update takes the current schedule's rate, as an uninterrupted run would. Idempotent
    where nothing changed. The position, not the step counter: after fp16 overflows the scheduler
    lags the steps in the uninterrupted run too.
    """
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    # reach-in: LambdaLR has no public setter; get_last_lr() and the next checkpoint report this,
    # as step() sets it
    scheduler._last_lr = lrs
    return lrs[0]


def extension_rule(cfg: RunConfig, step: int, old_steps: int) -> str:
    """The log line that states the learning-rate rule of an extension from ``old_steps`` to
    ``cfg.train.steps`` and its effect on the update after ``step`` (the checkpoint's): given to
    :func:`megaformer.checkpoint.resume_rules.check_resume_config` by the trainer."""
    t = cfg.train
    old_lr, new_lr = lr_at(step, t, old_steps), lr_at(step, t)
    return (
        f"extending the run from {old_steps} to {t.steps} steps (train.extend_steps=true): the "
        f"learning-rate schedule is recomputed over {t.steps} steps (warmup {t.warmup_steps} unchanged, "
        f"{t.lr_decay} decay to min_lr {t.min_lr:g} now ending at step {t.steps}); the next update "
        f"(step {step + 1}) takes lr {new_lr:.3e} where the old schedule had {old_lr:.3e}"
    )
