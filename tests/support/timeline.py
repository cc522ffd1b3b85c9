"""A pytest plugin that records when every test ran, on which xdist worker: where the suite's time goes.

    MEGAFORMER_TEST_TIMELINE=/tmp/timeline PYTEST_ADDOPTS="-p tests.support.timeline" bash scripts/check.sh
    .venv/bin/python -m tests.support.timeline /tmp/timeline      # per worker: busy, idle, the slowest files

Each process (an xdist worker, or pytest itself without workers) appends one JSON line per test phase
(setup, call, teardown) to ``$MEGAFORMER_TEST_TIMELINE/<worker>.jsonl``: ``nodeid``, ``when``,
``start`` and ``stop`` (Unix seconds, pytest's own report times) and ``outcome``. Without the
variable the plugin does nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path


def pytest_runtest_logreport(report) -> None:
    folder = os.environ.get("MEGAFORMER_TEST_TIMELINE")
    if not folder or not hasattr(report, "start") or getattr(report, "node", None) is not None:
        return  # off, or a worker's report as xdist's controller receives it (the worker wrote it)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    line = {"nodeid": report.nodeid, "when": report.when, "start": report.start, "stop": report.stop,
            "outcome": report.outcome}  # fmt: skip
    with open(Path(folder) / f"{worker}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def summarize(folder: str | os.PathLike) -> str:
    """Per worker: its span, the seconds inside test phases, the gaps between them (collection,
    waiting for work, the end), and its ten longest files."""
    lines = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        rows.sort(key=lambda r: r["start"])
        begin, end = rows[0]["start"], max(r["stop"] for r in rows)
        busy = sum(r["stop"] - r["start"] for r in rows)
        by_file: dict[str, float] = defaultdict(float)
        for r in rows:
            by_file[r["nodeid"].split("::")[0]] += r["stop"] - r["start"]
        lines.append(
            f"{path.stem}: {len(rows)} phases, {begin:.0f}..{end:.0f} ({end - begin:.0f} s), "
            f"in tests {busy:.0f} s, between them {end - begin - busy:.0f} s"
        )
        for name, secs in sorted(by_file.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {secs:7.1f} s  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
