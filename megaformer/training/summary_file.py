"""``summary.json`` values as strict JSON: a figure that could not be measured is ``null``, with why.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which strict parsers (``jq``,
JavaScript, most languages' JSON libraries) reject. A run that measured nothing (no step in this
launch, no evaluation) or diverged (a non-finite loss, a perplexity that overflows) has such
figures: :func:`null_non_finite` makes each ``null`` and names it under ``"missing"`` with a
reason; the trainer then writes the file with ``allow_nan=False``.
"""

from __future__ import annotations

import math
from typing import Any


def null_non_finite(summary: dict[str, Any], reasons: dict[str, str] | None = None) -> dict[str, Any]:
    """A copy of ``summary`` with every non-finite float (NaN, ±inf) replaced by None.

    Each such key is listed in the copy's ``"missing"`` dict (``{key: why}``, merged into an
    existing one) with its reason from ``reasons``, else ``"not finite (nan)"`` and the like. A
    value that is already None is listed only where ``reasons`` names it. Nested dicts are cleaned
    too, their keys listed as ``outer.inner``. ``"missing"`` is absent when nothing is.
    """
    reasons = reasons or {}
    missing: dict[str, str] = dict(summary.get("missing") or {})

    def clean(d: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in d.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and name != "missing":
                out[key] = clean(value, f"{name}.")
            elif isinstance(value, float) and not math.isfinite(value):
                out[key] = None
                missing[name] = reasons.get(name, f"not finite ({value})")
            else:
                out[key] = value
                if value is None and name in reasons:
                    missing[name] = reasons[name]
        return out

    cleaned = clean(summary, "")
    cleaned.pop("missing", None)
    if missing:
        cleaned["missing"] = missing
    return cleaned
