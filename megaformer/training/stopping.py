"""Stopping a run early and cleanly: preemption signals and a wall-clock limit.

A signal of ``train.exit_signals`` (SIGTERM, what Slurm sends before it kills a job, and SIGUSR1,
what ``sbatch --signal=USR1@120`` sends, by default) only sets a flag; after every optimizer step
the ranks agree (an all-reduce of the flags on the communication device: a signal that reached one
rank stops them all at the same step), save a checkpoint at that step and exit with
:data:`EXIT_CODE_STOPPED`. ``train.exit_duration_mins`` (Megatron's ``--exit-duration-in-mins``)
does the same once that many minutes have passed since the process started training; the ranks'
clocks are reduced with a maximum, so one slow rank is enough.

A compute-budget run adds a third flag: its device-hours so far past the budget (and its
``budget.overrun`` tolerance), on any rank; the run then ends at that step as complete
(:data:`BUDGET_SPENT`).

The check is one all-reduce of three numbers per step (a host round trip), only when a signal, a
time limit or a budget is configured.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from megaformer.parallel.comm import all_reduce_max

EXIT_CODE_STOPPED = 75
"""Exit code of a run stopped early with its checkpoint saved (EX_TEMPFAIL: resume to continue)."""


class StopCheck:
    """Install the signal handlers; :meth:`__call__` says, the same on every rank, whether to stop.

    Args:
        signals: comma-separated signal names (``"SIGTERM,SIGUSR1"``; empty: none).
        exit_duration_mins: minutes after ``started`` at which to stop (0: never).
        started: ``time.monotonic()`` at the run's start (default: now).
    """

    def __init__(self, signals: str, exit_duration_mins: float, started: float | None = None) -> None:
        self.received: str | None = None
        self.over_budget: Any = None  # () -> bool, set by a budget run (TrainLoop): a third flag
        self.started = time.monotonic() if started is None else started
        self.limit_s = exit_duration_mins * 60.0
        self.names = [n.strip() for n in signals.split(",") if n.strip()]
        for name in self.names:
            signal.signal(getattr(signal, name), self._on_signal)
        # A rank started with them blocked (a launcher's parent inside a ``pthread_sigmask`` block)
        # would never see its stop signal; one already pending sets the flag here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, name) for name in self.names])

    @property
    def enabled(self) -> bool:
        return bool(self.names) or self.limit_s > 0 or self.over_budget is not None

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the step in flight finishes, the checkpoint is written at its boundary.
        self.received = signal.Signals(signum).name

    def __call__(self) -> str | None:
        """The reason to stop after this step (``"SIGTERM"``, ``"exit_duration_mins=30"``), or
        None; a collective: every rank calls it after every step."""
        if not self.enabled:
            return None

        over = self.limit_s > 0 and time.monotonic() - self.started >= self.limit_s
        values = [1.0 if self.received else 0.0, 1.0 if over else 0.0]
        if self.over_budget is not None:  # a third flag only for a budget run: one host read fewer
            values.append(1.0 if self.over_budget() else 0.0)
        flags = all_reduce_max(values)
        if flags[0]:
            return f"signal {self.received or 'received by another rank'}"
        if flags[1]:
            return f"train.exit_duration_mins={self.limit_s / 60:g} reached"
        if len(flags) > 2 and flags[2]:
            return BUDGET_SPENT
        return None


BUDGET_SPENT = "budget spent"
""":class:`StopCheck`'s reason when a budget run's device-hours passed the budget (and
``budget.overrun``): the run ends there complete, not preempted."""
