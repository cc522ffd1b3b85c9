"""A run owns its ``output.dir`` while it runs: ``OUTPUT_DIR/run.lock``.

Two launches into one directory (a job submitted twice, a requeue beside a job that still runs, a
relaunch while an orphaned run trains on) would both write ``checkpoints/global_stepN``, both move
``latest`` and interleave two TensorBoard curves as one. So one process holds an exclusive OS lock
on ``run.lock`` (:mod:`data_tools.owner_lock`: ``fcntl.flock``, its holder's host, PID, Slurm job
and start time written inside) for the run's life, and a second launch is refused naming it.

Who holds it, and when it is checked:

* **Rank 0 holds it** (global rank, ``RANK``), from the start of ``megaformer.train``'s main (before
  the preflight, the process groups and the model) until the process ends: :func:`hold_run_dir`.
  The lock lives exactly as long as a process that writes the run's files: a rank killed by any
  means (``kill -9``, the out-of-memory killer, a node lost) drops it with its last descriptor, so a
  killed run leaves no stale lock, and a run whose launcher was killed while its ranks train on
  (orphans) still owns its directory. A lock in the launcher instead would be released by exactly
  that kill while the ranks go on writing. The same holds under ``torchrun`` and for one plain
  process, which do not pass through ``launch/pretrain.sh``.
* **The launcher checks first** (:func:`check_run_dir_free`, from ``launch/pretrain.sh``'s
  supervisor before DeepSpeed's launcher starts any worker): a second launch into a live run exits
  2 in about a second, not after every worker has imported torch. The check takes nothing: between
  it and rank 0's lock a few seconds pass, and two launches started within them both pass it; rank
  0 of the later one then finds the lock taken and exits 2 with the same message (its launcher ends
  its other ranks), so at most one run writes the directory in every case. Only node 0's launcher
  checks (``NODE_RANK`` unset or 0): the other nodes of a job start while node 0's rank 0 may
  already hold the lock, and a second job is refused on its node 0 anyway.

Where the file system keeps no locks (some FUSE mounts), the run holds the directory by a lease
with a heartbeat instead (:mod:`data_tools.lease`), said on stderr; where its locks are not shared
between nodes (NFS mounted with ``nolock`` or ``local_lock``, which no process can detect),
``output.lock=lease`` asks for the lease. See :mod:`data_tools.owner_lock` for what NFS does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from data_tools.lease import DEFAULT_TIMEOUT_S
from data_tools.owner_lock import LockFileError, LockHeldError, OwnerLock, check_free
from megaformer.checkpoint.storage import check_writable
from megaformer.config import ConfigError, RunConfig

LOCK_NAME = "run.lock"


class RunDirBusyError(ConfigError):
    """``output.dir`` is held by another live run (or its lock file cannot be used)."""


def lock_path(output_dir: str) -> str:
    """``{output_dir}/run.lock``."""
    return os.path.join(output_dir, LOCK_NAME)


def _way_on(output_dir: str) -> str:
    return (
        f"one run writes output.dir={output_dir} at a time. Wait for that run to end (stop it with "
        "kill PID on its host: its ranks save a checkpoint and exit; a launch with train.resume=auto "
        "then continues it), or launch into another output.dir"
    )


def check_run_dir_free(output_dir: str, mode: str = "auto", lease_timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Refuse a launch into an ``output.dir`` a live run holds; take and create nothing. ``mode`` and
    ``lease_timeout`` are ``output.lock`` and ``output.lease_timeout_seconds``.

    Raises:
        RunDirBusyError: held by another run (naming its host, PID, Slurm job and start), or a
            ``run.lock`` that is not ours or cannot be opened (naming it and the fix).
    """
    try:
        check_free(lock_path(output_dir), _way_on(output_dir), mode, lease_timeout)
    except (LockHeldError, LockFileError) as e:
        raise RunDirBusyError(f"output.dir: {e}") from None


@contextlib.contextmanager
def hold_run_dir(cfg: RunConfig) -> Iterator[OwnerLock | None]:
    """On global rank 0 (``RANK``, default 0), hold ``output.dir``'s lock for the block; on other
    ranks do nothing (yields None). Creates ``output.dir`` if missing (as the run would), and
    removes it again if the block left it empty.

    Raises:
        RunDirBusyError: another run holds it, or its ``run.lock`` is not ours or cannot be opened.
        ConfigError: ``output.dir`` cannot be written or created (read-only, permissions).
    """
    if int(os.environ.get("RANK", "0")) != 0:
        yield None
        return

    out = cfg.output.dir
    check_writable(out, "output.dir", "checkpoints, TensorBoard events and summary.json")
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    lock = OwnerLock(
        lock_path(out), "a training run", _way_on(out), cfg.output.lock, cfg.output.lease_timeout_seconds
    )
    try:
        lock.acquire()
    except (LockHeldError, LockFileError) as e:
        raise RunDirBusyError(f"output.dir: {e}") from None
    except OSError as e:  # checked writable just now: a full disk, or a race with a chmod
        raise ConfigError(
            f"output.dir='{out}': cannot create {lock.path} ({e.strerror}); free space on that disk "
            "or choose another output.dir"
        ) from None
    try:
        yield lock
    finally:
        lock.release()
        if created:  # a run refused by its preflight leaves no empty output.dir behind
            with contextlib.suppress(OSError):
                os.rmdir(out)  # only if empty
