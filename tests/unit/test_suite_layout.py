"""``bash scripts/check.sh`` runs pytest per tier (tests/unit on every core, then the multi-process
tiers one at a time): a test file outside the tiers it names would silently never run in CI."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("tests/unit", "tests/distributed", "tests/fakecuda", "tests/gpu")


def test_every_test_file_lies_in_a_tier_that_check_sh_runs():
    script = (REPO / "scripts" / "check.sh").read_text()
    named = set(re.findall(r"\btests/[a-z]+\b", script))
    assert named == set(TIERS), named
    files = [p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")]
    assert files and all(f.startswith(tuple(f"{t}/" for t in TIERS)) for f in files), [
        f for f in files if not f.startswith(tuple(f"{t}/" for t in TIERS))
    ]
