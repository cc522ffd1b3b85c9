"""The process ``launch/pretrain.sh`` leaves running: one signal to its PID stops every rank.

``launch/pretrain.sh`` used to ``exec`` DeepSpeed's runner, which on one node installs no signal
handler: a SIGTERM to the PID the shell returned (``kill PID``, ``timeout``, a container runtime
stopping PID 1) ended the runner with 143 and left both ranks training, unsaved. The script now
execs this supervisor, which keeps the PID and:

1. **checks the run directory** (node 0 only): a live run's ``output.dir`` refuses the launch
   before any worker starts (:func:`megaformer.training.run_lock.check_run_dir_free`, exit 2);
2. **starts the launcher command** (DeepSpeed's runner) **in a process group of its own**, and
   passes the supervisor's group in ``MEGAFORMER_LAUNCHER_PGID``: each rank joins that group as it
   starts (:func:`join_launcher_group`, from ``megaformer.train``). The runner and DeepSpeed's
   per-node ``launch.py`` are then out of the group a terminal, ``timeout`` or ``kill -- -PGID``
   signals, and the ranks are in it: a SIGKILL to the group (``kill -9 -- -PGID``) still ends every
   rank at once, as before, while a SIGTERM to the group no longer reaches ``launch.py`` (whose own
   handler would kill the ranks 30 s later, mid-save, and exit 1);
3. **forwards SIGTERM and SIGINT** (``kill PID``, Ctrl-C, ``timeout``) to every rank as the run's
   first ``train.exit_signals`` signal (SIGTERM by default; SIGUSR1 is forwarded as itself): the
   ranks agree on a step, save a checkpoint there and exit 75 (:mod:`.stopping`), DeepSpeed's
   launcher passes the 75 on, and so does the supervisor. The ranks ignore SIGINT themselves (a
   Ctrl-C reaches them with the terminal's group): the supervisor's forwarded signal stops them;
4. **bounds the wait**: if the ranks have not ended ``MEGAFORMER_STOP_TIMEOUT_S`` seconds (default
   600) after the first signal, it ends the launcher's group (DeepSpeed's launcher then ends the
   ranks), kills what is left 40 s later, and exits 1;
5. **outlives the runner**: it is the child subreaper of its descendants (Linux), so when the
   runner above them dies first (Slurm's ``scancel`` signals every process of the job step at once,
   and the runner installs no handler on one node), DeepSpeed's ``launch.py`` and the ranks are
   re-parented to the supervisor, not to init: it gives the ranks the stop signal if they do not
   have it yet and waits for them to save and exit (within the stop timeout) before it exits,
   because a batch script that ends takes the job's remaining processes with it;
6. **unblocks the stop signals** it forwards before it starts the launcher: a parent that started
   it inside a ``pthread_sigmask`` block would otherwise hide every stop from it, and from the
   launcher and ranks that inherit its mask.

Exit status: the launcher command's (0 complete, 75 stopped early with its checkpoint saved, 2 a
configuration, data or checkpoint error, other values a failure); 2 when the run directory is held
by another run; 1 when a stop did not end in time; 128 + N when the launcher was killed by signal N.

A signal that arrives before the ranks have started (DeepSpeed's launcher not yet running them)
ends the launcher's group (after ``UNSEEN_GRACE_S``, in which ranks that have just started get it
instead, and a launcher whose ranks have just exited ends with their code): nothing was trained,
nothing is saved. A SIGKILL to the supervisor alone
(``kill -9 PID``) cannot be forwarded: the ranks train on (the run directory stays theirs: rank 0
holds its lock) until they are signalled themselves (``kill -- -PGID`` reaches them).

Usage (what ``launch/pretrain.sh`` runs)::

    python -m megaformer.training.supervisor [CONFIG [key=value ...]] -- LAUNCHER [ARGS ...]

With no ``CONFIG`` (``MEGAFORMER_MODULE`` other than ``megaformer.train``) nothing is checked and
signals are forwarded as SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

# At the top, not in the handler: GNU timeout sends SIGTERM twice (its child, then its group), and a
# second signal arriving inside a lazy first import saw a half-imported psutil (a traceback, no
# forwarding).
import psutil

PGID_ENV = "MEGAFORMER_LAUNCHER_PGID"
"""Environment variable naming the supervisor's process group, which the ranks join."""

STOP_TIMEOUT_S = 600.0
"""Default of ``MEGAFORMER_STOP_TIMEOUT_S``: how long the ranks may take to save and exit."""

EXIT_CODE_STOP_TIMEOUT = 1
"""The supervisor's exit status when the ranks did not end within the stop timeout."""

UNSEEN_GRACE_S = 2.0
"""How long a stop signal that found no ranks waits before ending the launcher: the ranks may have
just exited (the launcher then ends on its own with their code) or may be about to start."""

LAUNCH_MODULE = "deepspeed.launcher.launch"
"""DeepSpeed's per-node launcher; its children are the ranks."""

PR_SET_CHILD_SUBREAPER = 36
"""prctl(2) option (linux/prctl.h): orphaned descendants are re-parented to this process."""


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux ``prctl``); returns whether
    it is. Elsewhere (or if the call fails) orphans go to init as before, and a supervisor whose
    runner died cannot wait for the ranks (item 5 of the module docstring)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes  # lazy: only the supervisor, only on Linux

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _live_job_processes() -> list:
    """This process's descendants that are the job's own and have not exited: the ranks (started
    with ``--local_rank=``) and DeepSpeed's ``launch.py``. Not a daemon a rank may leave behind
    (e.g. a tracker's service process), which the supervisor neither waits for nor kills."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and ("--local_rank=" in cmd or LAUNCH_MODULE in cmd):
                out.append(proc)
    return out


def _reap() -> None:
    """Collect the exit status of every child that has ended (re-parented ranks included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def join_launcher_group() -> bool:
    """In a rank started under the supervisor: join its process group and ignore SIGINT (the
    supervisor forwards a Ctrl-C as the run's stop signal). Returns whether it joined; outside a
    supervised launch (``torchrun``, one plain process) it does nothing."""
    pgid = os.environ.get(PGID_ENV)
    if not pgid:
        return False
    try:
        os.setpgid(0, int(pgid))
    except (OSError, ValueError):
        return False  # the supervisor is gone, or another session: stay where the launcher put us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True


def _rank_processes(root: int) -> list:
    """The ranks under ``root``: children of DeepSpeed's ``launch.py`` processes among ``root``
    and its descendants (each rank's own children, e.g. data-loader workers, are not included)."""
    try:
        top = psutil.Process(root)
        descendants = [top, *top.children(recursive=True)]
    except psutil.Error:
        return []
    ranks = []
    for proc in descendants:
        try:
            if LAUNCH_MODULE in " ".join(proc.cmdline()):
                ranks += proc.children()
        except psutil.Error:
            continue
    return ranks


def _log(message: str) -> None:
    print(f"[pretrain.sh] {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Run ``command`` in its own process group; forward stop signals to its ranks.

    Args:
        command: the launcher command line (DeepSpeed's runner with its arguments).
        stop_signal: the signal the ranks stop on (the run's first ``train.exit_signals``).
        stop_timeout_s: how long after the first stop signal the ranks may take to end.
    """

    def __init__(self, command: list[str], stop_signal: signal.Signals, stop_timeout_s: float) -> None:
        self.command = command
        self.stop_signal = stop_signal
        self.stop_timeout_s = stop_timeout_s
        self.child: subprocess.Popen | None = None
        self.stop_deadline: float | None = None
        self.unseen: tuple[signal.Signals, signal.Signals, float] | None = None
        self.stop_sent = False  # the ranks have the stop signal: a later one is not sent again

    def _forward(self, signum: int, frame: object = None) -> None:
        if getattr(self, "_forwarding", False):
            return  # a second signal during a forwarding (timeout's pair): the first one carries it
        self._forwarding = True
        try:
            self._forward_once(signum)
        finally:
            self._forwarding = False

    def _forward_once(self, signum: int) -> None:
        received = signal.Signals(signum)
        sent = received if received == signal.SIGUSR1 else self.stop_signal
        if self.stop_deadline is None and received != signal.SIGUSR1:
            self.stop_deadline = time.monotonic() + self.stop_timeout_s
        if self.child is None or self.child.poll() is not None:
            return
        if self.stop_sent and received != signal.SIGUSR1:
            # timeout's second SIGTERM after the first was handled (a loaded machine spaces them),
            # or a second Ctrl-C: the ranks are saving; the stop deadline still holds
            _log(f"{received.name} again: the ranks already have the stop signal")
            return
        ranks = _rank_processes(self.child.pid)
        if not ranks:
            # Not started yet, or already gone: timeout's second SIGTERM reaches the ranks through
            # the group, and they may have exited before this handler runs, with the launcher about
            # to pass their 75 on. Decide in the wait loop, after a grace period (_settle_unseen).
            self.unseen = (received, sent, time.monotonic())
            return
        self._send_to_ranks(received, sent, ranks)

    def _send_to_ranks(self, received: signal.Signals, sent: signal.Signals, ranks: list) -> None:
        _log(
            f"{received.name} received: sending {sent.name} to {len(ranks)} rank(s) "
            f"(PIDs {', '.join(str(p.pid) for p in ranks)}); they save a checkpoint and exit 75"
        )
        for proc in ranks:
            try:
                proc.send_signal(sent)
            except psutil.NoSuchProcess:
                pass  # a rank that has just exited
            except Exception as e:  # said, not hidden: a rank that does not get the stop trains on
                _log(f"could not send {sent.name} to rank PID {proc.pid}: {e!r}")
        self.stop_sent = self.stop_sent or sent != signal.SIGUSR1

    def _settle_unseen(self) -> None:
        """A stop signal found no ranks ``UNSEEN_GRACE_S`` ago and the launcher still runs: send it
        to the ranks that have started since, or end the launcher's group if there are none."""
        received, sent, _ = self.unseen
        self.unseen = None
        ranks = _rank_processes(self.child.pid)
        if ranks:
            self._send_to_ranks(received, sent, ranks)
            return
        _log(f"{received.name} received before the ranks started: ending the launcher")
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signum)

    def _kill_all(self) -> None:

        try:
            left = psutil.Process(self.child.pid).children(recursive=True)
        except psutil.Error:
            left = []
        self._signal_group(signal.SIGKILL)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def run(self) -> int:
        """Start the command, wait for it (forwarding signals); returns the exit status."""
        forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        for signum in forwarded:
            signal.signal(signum, self._forward)
        # Started with them blocked (a Python parent inside a ``pthread_sigmask`` block), this
        # process would never see a stop, and the launcher and the ranks would inherit the block: a
        # forwarded SIGTERM would wait, pending, for the run to end. One already pending is
        # handled here (no launcher yet: it is ended as soon as it starts, below).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        become_subreaper()
        env = {**os.environ, PGID_ENV: str(os.getpgrp())}
        self.child = subprocess.Popen(self.command, env=env, preexec_fn=os.setpgrp)
        if self.stop_deadline is not None:  # a stop signal came while it was being started
            self._signal_group(signal.SIGTERM)
        escalated: float | None = None
        while True:
            try:
                rc = self.child.wait(timeout=1.0 if self.unseen is None else 0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.unseen is not None and now > self.unseen[2] + UNSEEN_GRACE_S:
                self._settle_unseen()
            if self.stop_deadline is not None and now > self.stop_deadline and escalated is None:
                _log(
                    f"the ranks did not end within {self.stop_timeout_s:g} s of the stop signal "
                    "(MEGAFORMER_STOP_TIMEOUT_S): ending the launcher"
                )
                self._signal_group(signal.SIGTERM)
                escalated = now
            elif escalated is not None and now > escalated + 40:
                self._kill_all()
                self.child.wait()
                return EXIT_CODE_STOP_TIMEOUT
        if escalated is not None:
            return EXIT_CODE_STOP_TIMEOUT
        self._wait_for_orphans(rc)
        return 128 - rc if rc < 0 else rc

    def _wait_for_orphans(self, rc: int) -> None:
        """The launcher command ended while processes it started still run: its runner was killed
        (``scancel`` signals every process of the step; the runner has no handler). Give the ranks
        the stop signal unless they have it, wait for them to save and exit until the stop
        deadline, then kill what is left. A no-op when nothing is left, as after any normal end."""
        left = _live_job_processes()
        if not left:
            return
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        _log(f"the launcher ended ({how}) while {len(left)} of its processes still run: waiting for them")
        ranks = []
        for proc in left:
            with contextlib.suppress(psutil.Error):
                if "--local_rank=" in " ".join(proc.cmdline()):  # how DeepSpeed's launch.py starts a rank
                    ranks.append(proc)
        if ranks and not self.stop_sent:
            self._send_to_ranks(signal.SIGTERM, self.stop_signal, ranks)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.stop_timeout_s
        while left and time.monotonic() < self.stop_deadline:
            _reap()
            time.sleep(0.2)
            left = _live_job_processes()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if left:
            _log(f"{len(left)} process(es) did not end within the stop timeout: killed")
        _reap()


def _stop_signal(exit_signals: str) -> signal.Signals:
    """The first signal of ``train.exit_signals`` (SIGTERM when it is empty)."""
    names = [n.strip() for n in exit_signals.split(",") if n.strip()]
    return getattr(signal, names[0]) if names else signal.SIGTERM


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring); returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args or args.index("--") == len(args) - 1:
        print(
            "usage: python -m megaformer.training.supervisor [CONFIG [key=value ...]] -- LAUNCHER [ARGS ...]",
            file=sys.stderr,
        )
        return 2
    split = args.index("--")
    run_args, command = args[:split], args[split + 1 :]
    config, overrides = (run_args[0], run_args[1:]) if run_args else (None, [])
    stop_signal = signal.SIGTERM
    if config is not None:
        # lazy: the supervisor starts in a fraction of a second; the config only when one is given
        from megaformer.config import ConfigError, load_config
        from megaformer.training.run_lock import check_run_dir_free

        try:
            cfg = load_config(config, overrides)  # checked by launch/pretrain.sh already
            stop_signal = _stop_signal(cfg.train.exit_signals)
            if os.environ.get("NODE_RANK", "0") in ("", "0"):
                check_run_dir_free(cfg.output.dir, cfg.output.lock, cfg.output.lease_timeout_seconds)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
    timeout_s = float(os.environ.get("MEGAFORMER_STOP_TIMEOUT_S", STOP_TIMEOUT_S))
    return Supervisor(command, stop_signal, timeout_s).run()


if __name__ == "__main__":
    sys.exit(main())
