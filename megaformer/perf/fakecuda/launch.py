"""Start a fake-CUDA process: the shim preloaded, DeepSpeed's accelerator set to CUDA.

Every fake-CUDA run is its own process because the shim must be loaded before torch
(:mod:`.build`). :func:`run_session` runs one rank of a job (:mod:`.session`) and returns its report,
in a new interpreter or, given :class:`WarmSessions`, in a fork of a warm one (:mod:`.server`: the
imports, about 4 s of a session's CPU, paid once per GPU model).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from megaformer.perf.fakecuda.build import build_shim

ROOT = Path(__file__).resolve().parents[3]


def fake_cuda_env(lib: Path | None = None) -> dict[str, str]:
    """The environment of a fake-CUDA child: ``LD_PRELOAD`` of the shim, ``DS_ACCELERATOR=cuda``
    (DeepSpeed picks its accelerator at import), no real GPU visible, the project on the path."""
    lib = lib or build_shim()
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env["DS_ACCELERATOR"] = "cuda"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def run_python(args: list[str], timeout: float = 900, lib: Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fake-CUDA child; output captured."""
    return subprocess.run(
        [sys.executable, *args], env=fake_cuda_env(lib), capture_output=True, text=True, timeout=timeout,
        cwd=ROOT,
    )  # fmt: skip


class WarmSessions:
    """Warm fake-CUDA interpreters (:mod:`.server`), started on first use, one per GPU model and
    concurrent caller, each forking one session per request: for a caller that runs many sessions
    (the recipes' test tier; the dry-run command starts its sessions fresh). Thread-safe; a context
    manager that stops the servers on exit.

    A session forked here is what ``python -m megaformer.perf.fakecuda.session`` runs after its
    imports: same request, same report. The environment is the one :func:`fake_cuda_env` gives when
    the server starts.
    """

    def __init__(self, lib: Path | None = None) -> None:
        self._lib = lib
        self._idle: dict[str, list[subprocess.Popen]] = {}
        self._all: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def __enter__(self) -> WarmSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every server (its running session, if any, with it)."""
        with self._lock:
            servers, self._all, self._idle = self._all, [], {}
        for server in servers:
            _stop(server)

    def _start(self, gpu: str, deadline: float) -> subprocess.Popen:
        errors = tempfile.TemporaryFile()  # noqa: SIM115  (closed with the server's failure or by GC)
        server = subprocess.Popen(
            [sys.executable, "-m", "megaformer.perf.fakecuda.server", gpu],
            env=fake_cuda_env(self._lib or build_shim()), cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True,
        )  # fmt: skip
        with self._lock:
            self._all.append(server)
        if _read_line(server, deadline) != "ready":
            _stop(server)
            errors.seek(0)
            said = errors.read().decode(errors="replace")[-3000:]
            raise RuntimeError(
                f"the warm fake-CUDA server for {gpu} exited with {server.returncode} before it was "
                f"ready:\n{said}"
            )
        return server

    def run(self, request_path: str, log_path: str, gpu: str, timeout: float) -> int:
        """Run the session of ``request_path`` (output to ``log_path``) on a warm server for
        ``gpu``; return its exit status.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` seconds (the server is stopped).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            idle = self._idle.setdefault(gpu, [])
            server = idle.pop() if idle else None
        if server is None or server.poll() is not None:
            server = self._start(gpu, deadline)
        assert server.stdin is not None
        server.stdin.write(json.dumps([request_path, log_path]) + "\n")
        server.stdin.flush()
        try:
            reply = _read_line(server, deadline)
        except subprocess.TimeoutExpired:
            _stop(server)
            raise subprocess.TimeoutExpired(request_path, timeout) from None
        if not reply.lstrip("-").isdigit():  # the server died: report it as the session's failure
            _stop(server)
            return 70
        with self._lock:
            self._idle[gpu].append(server)
        return int(reply)


def _read_line(server: subprocess.Popen, deadline: float) -> str:
    """The server's next reply line ('' if it exited), waiting until ``deadline`` (monotonic)."""
    assert server.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired("megaformer.perf.fakecuda.server", 0)
        ready, _, _ = select.select([server.stdout], [], [], min(left, 5.0))
        if ready:
            return server.stdout.readline().strip()


def _stop(server: subprocess.Popen) -> None:
    """Kill a server and the session it forked (its own process group)."""
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def run_session(
    config: str,
    overrides: list[str],
    *,
    world_size: int,
    rank: int,
    gpu: str,
    steps: int = 2,
    strict_nccl: bool = True,
    timeout: float = 900,
    stream: bool = False,
    sessions: WarmSessions | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Run rank ``rank`` of a ``world_size``-rank job of ``config`` for ``steps`` optimizer steps on
    fake CUDA (:mod:`.session`); return its report (``error`` and ``traceback`` set if it failed).

    Args:
        stream: let the child's console output through (progress for the dry-run command); else
            captured and put in the report as ``output`` when it failed.
        sessions: fork the session from these warm servers instead of starting an interpreter
            (not with ``stream``).
        extra: further request keys (:mod:`.session`): ``max_micro_batches`` (fewer micro-batches
            per step, each at full size), ``peer_sends`` (the first pipeline stage's small integer
            sends, for a later stage's receives), ``setup_modules``, ``unchecked_engine_json``.

    Raises:
        ShimUnavailableError: the shim cannot be built here (no compiler or headers).
    """
    lib = build_shim()
    with tempfile.TemporaryDirectory(prefix="megaformer-fakecuda-") as tmp:
        request = {
            "config": str(config),
            "overrides": list(overrides),
            "world_size": world_size,
            "rank": rank,
            "gpu": gpu,
            "steps": steps,
            "strict_nccl": strict_nccl,
            "report": os.path.join(tmp, "report.json"),
            "output_dir": os.path.join(tmp, "run"),
            **extra,
        }
        path = os.path.join(tmp, "request.json")
        with open(path, "w") as f:
            json.dump(request, f)
        cmd = [sys.executable, "-m", "megaformer.perf.fakecuda.session", path]
        if sessions is not None and not stream:
            log = os.path.join(tmp, "session.log")
            code = sessions.run(path, log, gpu, timeout)
            with open(log, errors="replace") as f:
                output = f.read()
            proc = subprocess.CompletedProcess(cmd, code)
        elif stream:
            proc = subprocess.run(cmd, env=fake_cuda_env(lib), timeout=timeout, cwd=ROOT)
            output = ""
        else:
            proc = subprocess.run(
                cmd, env=fake_cuda_env(lib), capture_output=True, text=True, timeout=timeout, cwd=ROOT
            )
            output = proc.stdout + proc.stderr
        if not os.path.exists(request["report"]):
            return {"error": f"the fake-CUDA process exited with {proc.returncode} without a report",
                    "output": output[-8000:], "returncode": proc.returncode}  # fmt: skip
        with open(request["report"]) as f:
            report = json.load(f)
        if "error" in report:
            report["output"] = output[-8000:]
        report["returncode"] = proc.returncode
        return report


def run_rank_of_job(
    config: str,
    overrides: list[str],
    *,
    world_size: int,
    rank: int,
    gpu: str,
    first_stage: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """:func:`run_session` for any rank of a job. A rank on a later pipeline stage first needs what
    the first stage sends it (tensor shapes, partition tables: small integer tensors a fake run
    cannot know otherwise), so the first-stage rank with the same data- and tensor-parallel
    coordinates runs first and its recorded sends are handed on (``peer_sends``); its report is kept
    under ``first_stage_report``.

    Args:
        first_stage: the report of a first-stage rank of the same job and request, to take the
            sends from instead of running one: the pipeline engine's sends are the activations'
            shapes, the same at every data- and tensor-parallel coordinate (checked 2026-12-07 on
            ``configs/normformer-1.3b-3d-v100.yaml`` at world 256, tp 2 × dp 64 × pp 2: rank 0's
            sends equal rank 127's, the first-stage rank its last rank would otherwise run).

    Raises:
        ShimUnavailableError: as :func:`run_session`.
        ConfigError: the config or overrides do not load, or the layout does not fit the world.
    """
    # lazy: torch loads only when a session runs (the dry-run command checks its flags first)
    from megaformer.config import load_config
    from megaformer.parallel.state import coords_of, rank_of
    from megaformer.training.preflight import validate_layout

    cfg = load_config(config, overrides)
    dp = validate_layout(cfg, world_size)
    tp = cfg.parallel.tp_size
    pp_rank, dp_rank, tp_rank = coords_of(rank, tp=tp, dp=dp)
    if pp_rank == 0:
        return run_session(config, overrides, world_size=world_size, rank=rank, gpu=gpu, **kwargs)
    if first_stage is not None:
        head = first_stage
    else:
        first = rank_of(0, dp_rank, tp_rank, tp=tp, dp=dp)
        quiet = {k: v for k, v in kwargs.items() if k != "stream"}
        head = run_session(config, overrides, world_size=world_size, rank=first, gpu=gpu, **quiet)
    if "error" in head:
        return head
    report = run_session(
        config, overrides, world_size=world_size, rank=rank, gpu=gpu,
        peer_sends=head.get("p2p_int_sends", []), **kwargs,
    )  # fmt: skip
    report["first_stage_report"] = {
        k: head.get(k) for k in ("rank", "seconds", "peak_bytes", "peak_by_category")
    }
    return report
