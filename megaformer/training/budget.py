"""Compute-matched run length: the number of steps that fills ``budget.device_hours``.

NormFormer is slower per step than its baselines, so at equal compute (equal GPU-hours, the
paper's comparison, Shleifer et al. 2021, Sec. 3 and Fig. 2) it takes fewer steps and sees fewer
tokens. A budget run therefore decides its own length, once:

1. it runs ``SKIP_STEPS`` warm-up steps (allocator, kernel selection and loader start-up are paid
   once and would inflate the estimate), then ``budget.measure_steps`` steps, timed between
   two device synchronisations, evaluations and checkpoints excluded; the slowest rank's time
   counts (all ranks wait for it at every step anyway);
2. it runs one evaluation, timed, since evaluations spend the budget too;
3. it takes the largest step count ``S <= train.steps`` whose remaining steps and evaluations fit in
   the wall-clock time left (``budget · 3600 / world_size`` minus the time already spent, a resumed
   run's earlier parts included), fixes the learning-rate schedule's end at ``S``, logs the
   decision and saves it in every later checkpoint, so a resumed run keeps it.

Checkpoint writes are not forecast (their cost depends on the filesystem); they are counted in the
device-hours spent, so a run that saves often ends slightly over its budget, and says so.

**Calibrated runs** (``budget.step_seconds`` > 0). A run that times itself is at the mercy of
its own 20-step window: on a shared machine the window can be 5-10% off the run's real speed, and
two configs timed in different windows get step counts that the machine's drift, not their cost,
decides. :mod:`megaformer.experiments.compare` therefore measures the step time of every config of
a comparison in one interleaved calibration (rounds in alternating order) and passes each run its
own figure: the run fixes its length before its first step from it (``done`` = the start step,
nothing spent), with the same rule 3, and does no timing of its own. The run's real spend is
still measured (device-hours of the loop) and enforced: past ``budget · (1 + budget.overrun)``
the run ends at that step (:data:`~megaformer.training.stopping.BUDGET_SPENT`), evaluated and
saved, and its summary records ``budget_stopped_at``. A comparison resumed on a slower or faster
machine than its calibration's passes ``budget.machine_factor`` (that machine's step time over
the calibrated one, re-measured by the experiment): the decided length stays, and the enforced
limit is scaled by it, so the budget stays in the calibration machine's device-hours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from megaformer.config import RunConfig
from megaformer.config.schema import BUDGET_SKIP_STEPS
from megaformer.parallel.comm import all_reduce_max, broadcast_int

SKIP_STEPS = BUDGET_SKIP_STEPS
"""Steps run before the timing starts (one-time costs of the first steps)."""


def evaluations_between(done: int, total: int, eval_interval: int) -> int:
    """Evaluations after step ``done`` up to step ``total``: every ``eval_interval``, and at the end."""
    regular = total // eval_interval - done // eval_interval
    return regular + (0 if total % eval_interval == 0 else 1)


def overspent(cfg: RunConfig, device_seconds: float, world_size: int, ahead_seconds: float = 0.0) -> bool:
    """Whether a budget run would end over ``budget.device_hours`` by more than
    ``budget.overrun`` if it took one more step and its final evaluation: its device-seconds
    so far (all ranks, resumed parts included) plus ``world_size × ahead_seconds`` (that step's and
    evaluation's wall-clock). False without a budget. This rank's clock:
    :class:`~megaformer.training.stopping.StopCheck` takes the maximum over ranks."""
    b = cfg.budget
    # budget.machine_factor: the budget is in the calibration machine's device-hours (see its doc).
    limit = b.device_hours * 3600.0 * b.machine_factor * (1.0 + b.overrun)
    return b.device_hours > 0 and device_seconds + world_size * ahead_seconds > limit


def run_seconds(done: int, total: int, step_seconds: float, eval_seconds: float, eval_interval: int) -> float:
    """Forecast wall-clock (s) of steps ``done+1 .. total`` and their evaluations:
    ``(total - done) · step_seconds + evaluations_between(done, total) · eval_seconds``."""
    return (total - done) * step_seconds + evaluations_between(done, total, eval_interval) * eval_seconds


def steps_for_budget(
    *,
    seconds_left: float,
    done: int,
    step_seconds: float,
    eval_seconds: float,
    eval_interval: int,
    max_steps: int,
) -> int:
    """The largest ``S`` in ``[done, max_steps]`` whose steps ``done+1 .. S`` and their evaluations
    fit in ``seconds_left`` of wall-clock (``done`` itself when not even one step fits).

    Cost of ``S``: ``(S - done) · step_seconds + evaluations_between(done, S) · eval_seconds``,
    non-decreasing in ``S``, so a binary search finds it.
    """

    def cost(total: int) -> float:
        return run_seconds(done, total, step_seconds, eval_seconds, eval_interval)

    lo, hi = done, max_steps
    if cost(hi) <= seconds_left:
        return hi
    while lo < hi:  # invariant: cost(lo) fits (or lo == done), cost(hi) does not
        mid = (lo + hi + 1) // 2
        if cost(mid) <= seconds_left:
            lo = mid
        else:
            hi = mid - 1
    return lo


class BudgetKeeper:
    """Times the measurement steps and fixes the run's length (see the module docstring).

    Args:
        cfg: the run config (``budget.device_hours`` > 0).
        world_size: devices in the job.
        start_step: the step this process starts at (timing starts ``SKIP_STEPS`` later).
    """

    def __init__(self, cfg: RunConfig, world_size: int, start_step: int) -> None:
        b = cfg.budget
        self.cfg = cfg
        self.budget_seconds = b.device_hours * 3600.0 / world_size  # wall-clock of the job
        self.calibrated = b.step_seconds > 0
        self.first = start_step + SKIP_STEPS
        self.last = self.first + b.measure_steps
        self.decided: int | None = None
        self.decided_at: int | None = None  # the step the length was fixed after
        self.spent_at_decision = 0.0  # job wall-clock (s) spent then, slowest rank's
        self._t0 = 0.0
        self._paused0 = 0.0
        # Wall-clock (s) of one step and one evaluation: measured outside the run (see the module
        # docstring), or NaN until this run has timed them (a run stopped before its decision
        # reports them as null in summary.json).
        self.step_seconds, self.eval_seconds = math.nan, math.nan
        if self.calibrated:
            self.step_seconds, self.eval_seconds = b.step_seconds, b.eval_seconds

    def after_step(self, done: int, sync: Callable[[], Any], paused_seconds: float) -> bool:
        """Call after every step; True when step ``done`` ends the measurement (decide now).

        ``sync`` waits for the device (e.g. reads the loss); ``paused_seconds`` is the loop's total
        time in evaluations and checkpoints so far, taken out of the measurement.
        """
        if self.calibrated or self.decided is not None or done not in (self.first, self.last):
            return False
        sync()
        if done == self.first:
            self._t0, self._paused0 = time.perf_counter(), paused_seconds
            return False
        elapsed = time.perf_counter() - self._t0 - (paused_seconds - self._paused0)
        self.step_seconds = elapsed / (self.last - self.first)  # this rank's; decide() takes the max
        return True

    def decide(self, done: int, spent_seconds: float, eval_seconds: float) -> int:
        """Fix the run's length after step ``done``; return it.

        A collective: every rank's clock differs a little, so the slowest rank's step, evaluation
        and spent time are used, and rank 0's result is broadcast (every rank must stop at the same
        step, or the next collective would pair different operations).

        Args:
            spent_seconds: job wall-clock spent so far (resumed parts included), this rank's clock.
            eval_seconds: one evaluation's wall-clock, this rank's.
        """
        t = self.cfg.train
        self.step_seconds, self.eval_seconds, spent_seconds = all_reduce_max(
            [self.step_seconds, eval_seconds, spent_seconds]
        )
        decided = steps_for_budget(
            seconds_left=self.budget_seconds - spent_seconds,
            done=done,
            step_seconds=self.step_seconds,
            eval_seconds=self.eval_seconds,
            eval_interval=t.eval_interval,
            max_steps=t.steps,
        )
        self.decided = broadcast_int(decided, src=0)
        self.decided_at, self.spent_at_decision = done, spent_seconds
        return self.decided

    def forecast_device_hours(self, world_size: int) -> float:
        """What the decision forecast the run to spend in all, in device-hours of the machine whose
        times it used (a calibrated run's: the calibration machine's, ``machine_factor`` not
        applied): the job wall-clock spent when it was made (s) plus :func:`run_seconds` of the
        decided steps, times ``world_size`` (devices in the job). Beside the summary's measured
        ``device_hours``, their gap is the machine's drift since the decision plus what it does not
        count (checkpoint writes; the regular evaluation of the decision's step when it falls on
        ``train.eval_interval``).

        Raises:
            RuntimeError: before the length is decided (a caller's order is wrong; ``summary``
                asks only once :attr:`decided` is set).
        """
        if self.decided is None or self.decided_at is None:
            raise RuntimeError("BudgetKeeper.forecast_device_hours: called before the run length was decided")
        ahead = run_seconds(
            self.decided_at, self.decided, self.step_seconds, self.eval_seconds, self.cfg.train.eval_interval
        )
        return (self.spent_at_decision + ahead) * world_size / 3600.0

    def describe(self, done: int, world_size: int) -> str:
        """The decision, for the log."""
        t, b = self.cfg.train, self.cfg.budget
        capped = (
            " (capped by train.steps: the data is built for that many)" if self.decided == t.steps else ""
        )
        if self.calibrated:
            return (
                f"budget: {b.device_hours:g} device-hours = {self.budget_seconds:,.1f} s on "
                f"{world_size} devices | calibrated step {self.step_seconds:.4f} s, evaluation "
                f"{self.eval_seconds:.3f} s "
                f"(budget.step_seconds / budget.eval_seconds) | run length fixed at {self.decided} "
                f"steps{capped}; the learning rate decays to step {self.decided}; the run ends early if its "
                f"device-hours pass the budget by more than {b.overrun:.0%}"
                + (
                    ""
                    if b.machine_factor == 1.0
                    else f" (× budget.machine_factor={b.machine_factor:g}: slower than the calibration's)"
                )
            )
        return (
            f"budget: {b.device_hours:g} device-hours = {self.budget_seconds:,.1f} s on {world_size} "
            f"devices | step {self.step_seconds:.4f} s (steps {self.first + 1}..{self.last}, slowest rank), "
            f"evaluation {self.eval_seconds:.3f} s | run length fixed at {self.decided} steps{capped}; "
            f"the learning rate decays to step {self.decided}"
        )
