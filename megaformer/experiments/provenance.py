"""What a run of an experiment was asked to be: the basis for reusing it, or refusing to.

An experiment command (:mod:`.compare`, :mod:`.sweep`) reuses a finished run only when everything
that decides its result is what is asked now: the resolved config (the YAML with every override
applied, defaults filled in; the output directory aside), the data (each dataset's sizes and a
digest of its index), the budget and the calibrated times it was given, and the code version (a
digest of megaformer's and data_tools' sources). :func:`run_request` builds that record,
:func:`differences` names what changed between two of them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from data_tools.blend import parse_blend
from megaformer.config.load import load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
_IDX_DIGEST_BYTES = 4 << 20  # head and tail of the .idx: its header, sizes and document index


def resolved_config(config: str, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The run config as the trainer will see it (YAML + overrides + defaults), without the
    ``output`` section (where a run writes does not change what it computes).

    Raises:
        ConfigError: a bad key or value (names it).
    """
    resolved = to_dict(load_config(config, list(overrides)))
    resolved.pop("output", None)
    return resolved


def data_fingerprint(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{prefix: {"bin_bytes", "idx_bytes", "idx_sha256"}}`` of every dataset the run reads
    (``data.prefix`` or the blend's, and the held-out prefixes); ``idx_sha256`` digests the first
    and last 4 MiB of the ``.idx`` (header, sizes, document index), so a re-tokenised corpus
    differs without the whole ``.bin`` being read. A missing file is recorded as missing."""
    data = resolved["data"]
    prefixes = [p for _, p in parse_blend(data["blend"])] if data.get("blend") else [data["prefix"]]
    prefixes += [data[k] for k in ("valid_prefix", "test_prefix") if data.get(k)]
    out: dict[str, dict[str, Any]] = {}
    for prefix in prefixes:
        idx, binf = prefix + ".idx", prefix + ".bin"
        if not (os.path.isfile(idx) and os.path.isfile(binf)):
            out[prefix] = {"missing": True}
            continue
        h = hashlib.sha256()
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            h.update(f.read(_IDX_DIGEST_BYTES))
            if size > 2 * _IDX_DIGEST_BYTES:
                f.seek(size - _IDX_DIGEST_BYTES)
            h.update(f.read(_IDX_DIGEST_BYTES))
        out[prefix] = {"bin_bytes": os.path.getsize(binf), "idx_bytes": size, "idx_sha256": h.hexdigest()}
    return out


def code_version() -> str:
    """sha256 (16 hex digits) over the paths and contents of every ``.py`` file of ``megaformer/``
    and ``data_tools/`` (works without git; any edit to the code that trains changes it)."""
    h = hashlib.sha256()
    for package in ("megaformer", "data_tools"):
        for path in sorted((REPO / package).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_request(
    config: str, overrides: list[str] | tuple[str, ...], extra: dict[str, Any], code: str | None = None
) -> dict[str, Any]:
    """The record a finished run is compared with before it is reused.

    Args:
        config: the YAML path.
        overrides: ``section.key=value`` items applied after it.
        extra: what the experiment adds (the budget, the calibrated times, the run's own overrides).
        code: :func:`code_version` (computed when None).
    """
    resolved = resolved_config(config, overrides)
    return {
        "config": resolved,
        "data": data_fingerprint(resolved),
        "code_version": code or code_version(),
        **extra,
    }


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``["key: old -> new", ...]`` for every leaf that differs between two records (dotted keys)."""
    out: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out
