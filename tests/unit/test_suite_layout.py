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


def test_the_tests_that_time_the_machine_run_alone():
    """check.sh runs the multi-process tiers two files at a time, except the tests marked ``serial``:
    a test that compares spent device-hours with a budget or keeps calibration rounds by their
    spread must carry the mark, or it would time the other worker's load."""
    script = (REPO / "scripts" / "check.sh").read_text()
    assert '--dist loadfile --no-loadscope-reorder -m "${FAST}not serial"' in script
    assert '-m "${FAST}serial"' in script
    timing = re.compile(r"^BUDGET = |interleaved_step_times\(|--budget-device-hours", re.M)
    # Calibrated, but asserting nothing a calibration's step counts change (the rows, the best rate
    # per scheme, one decided count per scheme, the reuse): passed twice in the parallel pass.
    load_proof = {"test_sweep_launch.py"}
    unmarked = []
    for path in sorted((REPO / "tests").glob("distributed/test_*.py")):
        text = path.read_text()
        if timing.search(text) and "pytest.mark.serial" not in text and path.name not in load_proof:
            unmarked.append(path.name)
    assert not unmarked, f"time the machine but are not marked serial: {unmarked}"
    assert "serial:" in (REPO / "pyproject.toml").read_text()  # registered: an unknown mark only warns
