"""Helpers of the tests that stop processes: what a process does with its stop signals, read from
``/proc/PID/status`` (Linux), so that a hang says whether the signal was blocked, ignored or
caught where it went; and which processes a session holds."""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _names(mask_hex: str) -> str:
    mask = int(mask_hex, 16)
    names = [s.name for s in STOP_SIGNALS if mask >> (s.value - 1) & 1]
    return ",".join(names) or "-"


def describe(pid: int) -> str:
    """``"PID 123 (python): blocked SIGINT, ignored -, caught SIGTERM"`` for the stop signals
    (SIGINT, SIGTERM, SIGUSR1), or a note that the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return f"PID {pid}: gone"
    return (
        f"PID {pid} ({fields.get('Name', '?')}, {fields.get('State', '?')}): blocked "
        f"{_names(fields['SigBlk'])}, ignored {_names(fields['SigIgn'])}, caught "
        f"{_names(fields['SigCgt'])}, pending {_names(fields['ShdPnd'])}/{_names(fields['SigPnd'])}"
    )


def session_processes(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``, its leader included, from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(int(entry))
    return found
