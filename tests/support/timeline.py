"""A pytest plugin that records when every test ran, on which xdist worker: where the suite's time goes.

    MEGAFORMER_TEST_TIMELINE=/tmp/timeline PYTEST_ADDOPTS="-p tests.support.timeline" bash scripts/check.sh
    .venv/bin/python -m tests.support.timeline /tmp/timeline      # per worker: busy, idle, the slowest files
    .venv/bin/python -m tests.support.timeline /tmp/timeline --json suite.json   # and per file, to commit

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


def per_file(folder: str | os.PathLike) -> dict:
    """The record to commit beside a timing (a few KB, where the ``.jsonl`` files are hundreds):
    per worker its span and seconds in tests, and per test file its seconds in test phases summed
    over the workers (setup, call and teardown; a file's session fixtures count where they ran)."""
    workers, files = {}, defaultdict(float)
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        begin, end = min(r["start"] for r in rows), max(r["stop"] for r in rows)
        busy = sum(r["stop"] - r["start"] for r in rows)
        failed = sorted({r["nodeid"] for r in rows if r["outcome"] == "failed"})
        workers[path.stem] = {"span_s": round(end - begin, 1), "in_tests_s": round(busy, 1)}
        workers[path.stem] |= {"phases": len(rows), "failed": failed}
        for r in rows:
            files[r["nodeid"].split("::")[0]] += r["stop"] - r["start"]
    ordered = {name: round(secs, 1) for name, secs in sorted(files.items(), key=lambda kv: -kv[1])}
    return {"workers": workers, "files_s": ordered, "total_in_tests_s": round(sum(files.values()), 1)}


if __name__ == "__main__":
    # python -m tests.support.timeline DIR [--json OUT.json]
    print(summarize(sys.argv[1]))
    if "--json" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--json") + 1])
        out.write_text(json.dumps(per_file(sys.argv[1]), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")
