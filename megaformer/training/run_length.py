"""The run's length as a policy: how many steps, and when to stop early.

:class:`RunLength` holds everything that decides where a run ends, so that the training loop only
asks it, after each step, whether to go on:

* ``train.steps`` (an extension's new length on resume, ``train.extend_steps``: the schedule was
  rebuilt for it before the loop starts);
* a compute budget (the ``budget`` section, :mod:`.budget`): the length fixed once, from calibrated
  times before the first step or from the run's own timing after its measurement steps, and the
  spend guard that ends a run whose device-hours pass the budget by more than ``budget.overrun``;
* the time limit and preemption signals (``train.exit_duration_mins``, ``train.exit_signals``;
  :class:`~.stopping.StopCheck`);
* an early end the loop reports (divergence, an exhausted fp16 loss scale): :meth:`RunLength.end_at`.

Its state (the budget's decision) goes into every checkpoint's client state
(:meth:`RunLength.state_dict`) and comes back on resume (the constructor's ``client_state``), so a
resumed run keeps the length it fixed. Stopping rules follow Megatron-LM's ``--train-iters`` /
``--exit-duration-in-mins`` / ``--exit-signal-handler``; the budget is the paper's comparison at
equal GPU-hours (Shleifer et al. 2021, Sec. 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megaformer.config import RunConfig
from megaformer.parallel.layout import Layout, log
from megaformer.training.budget import BudgetKeeper, overspent
from megaformer.training.stopping import BUDGET_SPENT, StopCheck


@dataclass(frozen=True)
class Verdict:
    """The policy's answer after a step.

    Attributes:
        stop: end the loop after this step.
        reason: why (``"signal SIGTERM"``, ``"train.exit_duration_mins=30 reached"``,
            :data:`~.stopping.BUDGET_SPENT`), None when the run goes on or reached its length.
        preempted: the run stops before its end and resumes later (exit code 75); False for a
            budget that is spent, which completes the run.
    """

    stop: bool
    reason: str | None = None
    preempted: bool = False


GO_ON = Verdict(stop=False)


class RunLength:
    """Where the run ends (see the module docstring), for one rank; collective where it says so.

    Args:
        cfg: the run config (``train.steps``, ``train.exit_*``, the ``budget`` section).
        layout: this rank's layout (its world size; rank 0 logs).
        schedule: the learning-rate :class:`~.schedule.Schedule`; a fixed length ends its decay.
        start_step: the step the run starts from (0, a resume's, an ``init_from``'s).
        client_state: the resumed checkpoint's client state (``budget_steps``: a length decided
            before), ``{}`` on a fresh start.
        stop: the run's :class:`~.stopping.StopCheck` (signals, time limit), made first thing at
            start-up so that a signal during it counts, or any collective ``() -> reason or None``
            (the fake-CUDA dry run's, which ends after its steps); None: no early stop.
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: Layout,
        schedule: Any,
        start_step: int,
        client_state: dict,
        stop: StopCheck | Callable[[], str | None] | None = None,
    ) -> None:
        self.cfg, self.layout, self.schedule, self.stop_check = cfg, layout, schedule, stop
        self.budget: BudgetKeeper | None = None
        if "budget_steps" in client_state:  # decided before a resume: kept
            schedule.resume_decay_end(int(client_state["budget_steps"]))
            log(layout, f"budget: run length {schedule.total_steps} steps, as decided before the resume")
        elif cfg.budget.device_hours > 0:
            self.budget = BudgetKeeper(cfg, layout.world_size, start_step)
        # The run's last step: train.steps (an extension's new length), a budget's decision, or the
        # step where it ended early (divergence, an exhausted loss scale, a budget spent).
        self.total: int = schedule.total_steps
        self.stopped_at: int | None = None  # the step a budget run ended at, over budget
        self.planned: int | None = None  # its decided length, when it ended before it

    @property
    def calibrated(self) -> bool:
        """Whether the budget's length comes from calibrated times (``budget.step_seconds``)."""
        return self.budget is not None and self.budget.calibrated

    def begin(
        self, start_step: int, spent_seconds: Callable[[], float], ahead_seconds: Callable[[], float]
    ) -> None:
        """Before the first step (collective under a budget): a calibrated budget fixes the length
        now, from the whole budget less ``budget.fixed_seconds``; a budget run's spend guard is
        armed with the run's device-seconds so far (``spent_seconds``, all ranks) and the wall-clock
        of one more step and the final evaluation (``ahead_seconds``)."""
        if self.calibrated:
            self._fix(
                self.budget.decide(start_step, self.cfg.budget.fixed_seconds, self.budget.eval_seconds),
                start_step,
            )
            log(self.layout, self.budget.describe(start_step, self.layout.world_size))
        if isinstance(self.stop_check, StopCheck) and self.cfg.budget.device_hours > 0:
            world = self.layout.world_size
            self.stop_check.over_budget = lambda: overspent(self.cfg, spent_seconds(), world, ahead_seconds())

    def wants_timing(self, done: int, sync: Callable[[], Any], paused_seconds: float) -> bool:
        """Whether step ``done`` ends a self-timed budget's measurement: the loop then times one
        evaluation and calls :meth:`decide`. ``sync`` waits for the device; ``paused_seconds`` is
        the loop's time in evaluations and checkpoints so far (not charged to the steps)."""
        return self.budget is not None and self.budget.after_step(done, sync, paused_seconds)

    def decide(self, done: int, spent_seconds: float, eval_seconds: float) -> int:
        """Fix a self-timed budget's length after step ``done`` (collective; see
        :meth:`~.budget.BudgetKeeper.decide`); log it; return it."""
        total = self.budget.decide(done, spent_seconds, eval_seconds)
        self._fix(total, done)
        log(self.layout, self.budget.describe(done, self.layout.world_size))
        return total

    def calibrated_eval_seconds(self) -> float:
        """One evaluation's calibrated wall-clock (``budget.eval_seconds``), 0 without one."""
        return self.budget.eval_seconds if self.calibrated else 0.0

    def after_step(self, done: int, device_hours: float) -> Verdict:
        """Whether to stop after step ``done`` (collective: every rank calls it after every step
        before the last; the answer is the same on all). A spent budget ends the run here, complete
        (:attr:`total` becomes ``done``; the loop evaluates this step if it was not); a signal or the
        time limit stops it to be resumed. ``device_hours``: the run's so far, for the log."""
        if self.stop_check is None or done >= self.total:
            return GO_ON
        reason = self.stop_check()
        if reason == BUDGET_SPENT:
            self._budget_spent(done, device_hours)
            return Verdict(stop=True, reason=None)
        if reason:
            return Verdict(stop=True, reason=reason, preempted=True)
        return GO_ON

    def end_at(self, step: int) -> None:
        """End the run at ``step`` (divergence, an exhausted fp16 loss scale): it is the last one."""
        self.total = step

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of the policy: the budget's length once decided (a resumed run
        keeps it rather than deciding again)."""
        if self.cfg.budget.device_hours > 0 and (self.budget is None or self.budget.decided is not None):
            return {"budget_steps": self.total}
        return {}

    def missing_reasons(self) -> dict[str, str]:
        """Why a figure of :meth:`summary` may be NaN (made null in ``summary.json``, named under
        ``missing``): a self-timed budget stopped before it timed its steps."""
        why = "the run stopped before its budget timed its steps (budget.measure_steps)"
        return {"budget_step_seconds": why}

    def summary(self) -> dict[str, Any]:
        """The ``budget_*`` fields of ``summary.json`` ({} without a budget)."""
        b = self.cfg.budget
        if b.device_hours <= 0:
            return {}
        out: dict[str, Any] = {
            "budget_device_hours": b.device_hours,
            "budget_steps": self.planned or self.total,  # the decision, reached or not
            "budget_stopped_at": self.stopped_at,
        }
        if self.budget is not None:
            out["budget_step_seconds"] = self.budget.step_seconds  # the decision's input
            out["budget_calibrated"] = self.budget.calibrated
            if self.budget.decided is not None:  # the decision's other inputs and its forecast
                out["budget_decided_at"] = self.budget.decided_at
                out["budget_eval_seconds"] = self.budget.eval_seconds
                out["budget_spent_at_decision_seconds"] = self.budget.spent_at_decision
                world = self.layout.world_size
                out["budget_forecast_device_hours"] = self.budget.forecast_device_hours(world)
        out["budget_machine_factor"] = b.machine_factor
        return out

    def _fix(self, total: int, step: int) -> None:
        """Fix the length at ``total`` at step ``step``: the loop ends there, and the learning rate
        decays to its minimum there. ``total <= step``: not one more step fits, the run ends at
        ``step`` (the schedule is left as it was: no update follows)."""
        if total > step:
            self.schedule.set_total_steps(total, step)
        self.total = max(total, step)

    def _budget_spent(self, done: int, device_hours: float) -> None:
        b = self.cfg.budget
        self.planned, self.stopped_at, self.total = self.total, done, done
        log(
            self.layout,
            f"budget spent at step {done} of {self.planned} planned: {device_hours:.4g} device-hours, and "
            f"one more step with the final evaluation would pass {b.device_hours:g} × budget.machine_factor="
            f"{b.machine_factor:g} × (1 + budget.overrun={b.overrun:g}); the machine ran slower than the "
            "step time the length was fixed from. Ending the run here (summary: budget_stopped_at)",
        )
