"""The record a lock holder writes into its lock file, and the errors of both ways of holding an
output (:mod:`data_tools.owner_lock`'s ``flock``, :mod:`data_tools.lease`'s lease)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

from data_tools.errors import DataToolsError

FORMAT = "megaformer-owner-lock/1"
"""The ``format`` field of every record this module writes; a file without it is not ours."""


class LockFileError(DataToolsError):
    """A lock file that cannot be used: not ours (another format), or not openable."""


class LockHeldError(DataToolsError):
    """The output is held by another live process; :attr:`holder` is its record (or None)."""

    def __init__(self, message: str, holder: dict | None) -> None:
        super().__init__(message)
        self.holder = holder


def holder_record(what: str) -> dict:
    """This process's record: what it is doing, host, PID, Slurm job, start time, command."""
    now = time.time()
    return {
        "format": FORMAT,
        "what": what,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "started": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds"),
        "started_unix": now,
        "command": " ".join(sys.argv)[:500],
    }


def describe(holder: dict | None) -> str:
    """``"a training run on host h, PID 123, Slurm job 77, since 2026-11-28T14:00:00+00:00 (3 min
    ago)"``; a lock taken a moment ago whose record is not written yet: said so."""
    if not holder:
        return "a process that has just taken it (its record is not written yet)"
    parts = [f"host {holder.get('host', '?')}", f"PID {holder.get('pid', '?')}"]
    if holder.get("slurm_job_id"):
        parts.append(f"Slurm job {holder['slurm_job_id']}")
    since = f"since {holder.get('started', '?')}"
    started = holder.get("started_unix")
    if isinstance(started, (int, float)):
        since += f" ({_ago(time.time() - started)})"
    return f"{holder.get('what', 'a process')} on {', '.join(parts)}, {since}"


def _ago(seconds: float) -> str:
    if seconds < 0:
        return "in the future: the clocks of the two hosts differ"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def read_record(path: str, text: str) -> dict | None:
    """The record in a lock file's ``text``: None when empty (a holder that has just taken the lock).

    Raises:
        LockFileError: the text is not a record of this module (another program's file).
    """
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LockFileError(
            f"{path}: not a megaformer lock file (it starts {text[:60]!r}; ours are JSON records with "
            f'"format": "{FORMAT}"); nothing was changed: move that file away if it is not needed, '
            "or choose another output"
        )
    return record
