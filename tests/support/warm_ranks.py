"""Ranks of ``python -m megaformer.train`` forked from a warm interpreter, for the tests' run_ranks.

A rank's start-up is mostly imports: torch, DeepSpeed, torch._dynamo (which every torch optimizer
imports on construction) and the trainer take 3.5-4 s of CPU per rank on the 2-core CI machine, paid
twice per launch and by most of the ~100 launches of the multi-process tier. Here one server process
(multiprocessing's fork server) imports them once per test session; each rank is a fresh fork of it
(a new process: its own pid, file descriptors, signal handlers, process group and generator
states) that then runs :func:`megaformer.train.main` with the job's argv, environment and working
directory, as ``python -u -m megaformer.train`` would. What the fork skips is only the imports.

What a fork cannot reproduce, and how the tests are kept out of it:

* Environment read at interpreter start or at import (``PYTHONPATH``'s ``sitecustomize``, e.g. the
  CPU fp16 shim; OpenMP's thread count): a job whose environment differs from the server's in any
  of :data:`STARTUP_ENV` runs in fresh processes instead (:func:`can_fork`); the thread count is set
  with ``torch.set_num_threads`` from the job's ``OMP_NUM_THREADS`` (what OpenMP reads at start).
* A test-support directory put on ``PYTHONPATH`` for its ``sitecustomize.py`` (the CPU fp16
  switch, the checkpoint-fault injector: :data:`SITE_DIRS`) is not a start-up difference: the fork
  runs that ``sitecustomize.py`` itself, with the job's environment, before the rank's ``main``
  (each only sets attributes of modules the server has imported: DeepSpeed's accelerator,
  ``torch.save``, which the ranks look up when they call them).
* ``MEGAFORMER_TEST_FRESH_RANKS=1`` turns the fork server off for a whole session (every rank a
  fresh interpreter), to rule it out when a test fails.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import os
import runpy
import sys
from collections.abc import Iterator

PRELOAD = [
    "megaformer.train",
    "megaformer.training.trainer",
    "torch._dynamo",  # imported by every torch.optim optimizer's constructor (1 s per process)
    "torch.utils.tensorboard",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.pipe.engine",
    # DeepSpeed imports it on every ZeRO engine's optimizer check (is_zero_supported_optimizer), and
    # its module-level torch.compile pulls in inductor: about 1.3 s per rank
    "deepspeed.runtime.zero.muon.muon_optimizer",
    # imported later by every rank (DeepSpeed's op builders check the compiler through setuptools;
    # its expert-parallel config; numpy.ma by a median; the run lock): 0.1-0.2 s per rank
    "setuptools",
    "deepspeed.module_inject.auto_ep_layer",
    "numpy.ma",
    "megaformer.training.run_lock",
    "megaformer.experiments.step_timing",  # the calibration's rank program (MEGAFORMER_MODULE)
]
"""Imported once by the fork server: what a rank imports before its first step."""

STARTUP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "LD_PRELOAD", "DS_ACCELERATOR", "PYTHONHASHSEED")
"""Variables read when an interpreter starts or DeepSpeed is imported: a job that sets them
differently from the server's environment runs in fresh processes."""

_server_env: dict[str, str] | None = None

_SUPPORT = os.path.dirname(os.path.abspath(__file__))
SITE_DIRS = tuple(os.path.join(_SUPPORT, name) for name in ("cpu_fp16", "save_faults"))
"""Test-support directories whose ``sitecustomize.py`` a forked rank runs itself."""


def _site_dirs(env: dict[str, str]) -> tuple[list[str], str]:
    """``env``'s :data:`SITE_DIRS` entries of ``PYTHONPATH``, and ``PYTHONPATH`` without them."""
    parts = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    sites = [p for p in parts if os.path.abspath(p) in SITE_DIRS]
    return sites, os.pathsep.join(p for p in parts if os.path.abspath(p) not in SITE_DIRS)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fresh_ranks_only() -> bool:
    """True under ``MEGAFORMER_TEST_FRESH_RANKS=1``: every rank a new interpreter."""
    return os.environ.get("MEGAFORMER_TEST_FRESH_RANKS", "") not in ("", "0")


def can_fork(env: dict[str, str]) -> bool:
    """Whether a rank with environment ``env`` can be forked from the server: the server is not
    switched off and ``env`` agrees with the server's on every :data:`STARTUP_ENV` variable (the
    first job's environment starts the server, so the first job always can)."""
    if fresh_ranks_only():
        return False
    if _server_env is None:
        return True
    same = [k for k in STARTUP_ENV if k != "PYTHONPATH"]
    return _site_dirs(env)[1] == _site_dirs(_server_env)[1] and all(
        env.get(k) == _server_env.get(k) for k in same
    )


def _rank_main(
    argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, module: str = "megaformer.train"
) -> None:
    """The forked rank: the job's directory, environment and output files, then ``module``'s
    ``main`` (the trainer's, or another rank program such as the calibration's step-timing job;
    each leaves through ``os._exit``; an exception exits 1 with its traceback)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # unbuffered, as `python -u`: the text reaches the file even if the rank is killed
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=True)  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True)  # noqa: SIM115
    import torch

    # OpenMP read OMP_NUM_THREADS when the server imported torch; the job's value, as a fresh
    # interpreter would have read it
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    for site in _site_dirs(env)[0]:  # what a fresh interpreter's start-up would have run
        runpy.run_path(os.path.join(site, "sitecustomize.py"), run_name="sitecustomize")
    sys.argv = [module.replace(".", "/") + ".py", *argv]
    importlib.import_module(module).main(argv)


def start_rank(
    argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, module: str = "megaformer.train"
) -> Forked:
    """Fork one rank of ``python -m module`` from the warm server (started on first use, with
    ``env`` as its environment).

    Returns the started rank behind ``Popen``'s ``poll``/``returncode``/``kill``/``wait``
    (:class:`Forked`)."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(target=_rank_main, args=(argv, env, cwd, out, err, module), daemon=False)
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        server_env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}
        # the server itself runs no test sitecustomize: each fork runs its job's (_rank_main)
        server_env["PYTHONPATH"] = _site_dirs(server_env)[1]
        with _environ(server_env):  # the server keeps the environment it starts with
            proc.start()
        _server_env = server_env
    else:
        proc.start()
    return Forked(proc)


class Forked:
    """A forked rank (``multiprocessing.Process``) behind the part of ``Popen``'s interface that
    :func:`run_ranks` uses: ``poll``, ``returncode``, ``kill``, ``wait``."""

    def __init__(self, proc) -> None:
        self._proc = proc

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()

    def wait(self) -> int | None:
        self._proc.join()
        return self._proc.exitcode
