"""Small-file writes that never leave a half-written file behind."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary name in the same directory, renamed
    into place: a reader, or a run killed midway, sees the old file, the new file, or none.

    The parent directory is created when missing. The temporary name carries the process id, so
    several processes writing the same path do not write into one temporary file.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no temporary left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, indent: int = 2, *, allow_nan: bool = True
) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON with a final newline.

    ``allow_nan=False``: strict JSON; a NaN or infinite float raises ``ValueError`` before
    anything is written (the default writes them as ``NaN`` / ``Infinity``, as Python's ``json``).
    """
    atomic_write_text(path, json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n")
