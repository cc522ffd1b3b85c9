"""The suite's timeline plugin's summaries (tests/support/timeline.py): what a committed timing
record holds."""

from __future__ import annotations

import json

from tests.support.timeline import per_file, summarize


def _write(folder, worker, rows):
    with open(folder / f"{worker}.jsonl", "w", encoding="utf-8") as f:
        for nodeid, when, start, stop, outcome in rows:
            row = {"nodeid": nodeid, "when": when, "start": start, "stop": stop, "outcome": outcome}
            f.write(json.dumps(row) + "\n")


def test_per_file_sums_the_phases_of_each_file_over_the_workers(tmp_path):
    _write(tmp_path, "gw0", [
        ("tests/a.py::t1", "setup", 100.0, 102.0, "passed"),  # a fixture's set-up counts for its file
        ("tests/a.py::t1", "call", 102.0, 105.0, "passed"),
        ("tests/b.py::t2", "call", 106.0, 107.5, "failed"),
    ])  # fmt: skip
    _write(tmp_path, "gw1", [("tests/a.py::t3", "call", 100.0, 104.0, "passed")])
    record = per_file(tmp_path)
    assert record["files_s"] == {"tests/a.py": 9.0, "tests/b.py": 1.5}
    assert list(record["files_s"]) == ["tests/a.py", "tests/b.py"]  # longest first
    assert record["total_in_tests_s"] == 10.5
    gw0 = {"span_s": 7.5, "in_tests_s": 6.5, "phases": 3, "failed": ["tests/b.py::t2"]}
    assert record["workers"]["gw0"] == gw0
    assert record["workers"]["gw1"]["failed"] == []
    text = summarize(tmp_path)
    assert "gw0: 3 phases, 100..108 (8 s), in tests 6 s, between them 1 s" in text
    assert "      5.0 s  tests/a.py" in text
