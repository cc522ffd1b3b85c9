"""Profiles ``data_tools.preprocess``: the main process and every worker under cProfile, one report each.

    .venv/bin/python bench/profile_preprocess.py --label after [--workers 2] [--repeat 5]
    git archive OLD data_tools | tar -x -C /tmp/old && \
        .venv/bin/python bench/profile_preprocess.py --label before --code /tmp/old

Builds the corpus of ``bench/preprocess.py`` (the Gutenberg novels as JSONL, ``--repeat`` copies)
in a temporary directory, runs ``data_tools.preprocess.main`` in this process under cProfile,
and has each pool worker profile its whole life (``data_tools.ordered_pool._worker_main``
wrapped before the pool forks). Writes ``bench/results/profile_preprocess/{label}/``:

* ``main.txt``, ``worker-0.txt``, ``worker-1.txt``...: wall and CPU seconds of the process, then
  cProfile's top entries by own time and by cumulative time;
* ``summary.json``: per process, its start and end (seconds after this script's start), wall and
  CPU seconds, and the seconds of a few entries of interest (tokenizer calls, JSON decoding, pipe
  reads and writes, waiting for a worker, the output writes).

cProfile's own overhead (about a microsecond per call) inflates the parts made of many small
calls, and on a shared machine wall times include time other jobs held the cores (the summary's
per-process CPU seconds do not). Compare reports made the same way on the same machine, at the
same load.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# --code DIR: profile the data_tools of another tree (e.g. `git archive OLD data_tools | tar -x -C DIR`)
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv else REPO
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(CODE))

import data_tools.ordered_pool as ordered_pool  # noqa: E402
from data_tools import preprocess  # noqa: E402

T0 = time.monotonic()
# cProfile's clock, set by --timer: wall time ("wall", the default: waiting for workers, pipes and
# disks shows too) or the process's CPU time ("cpu": time the process waited for a core on a shared
# machine is charged to no function, but each reading of that clock is a system call, which
# inflates code made of many small calls several times over).
_TIMER = time.perf_counter
# Entries whose seconds summary.json lists: a regular expression on pstats' "file:line(function)"
# keys, and whether to add up the matches' own time or their cumulative time (each match's
# callees are not matches).
_OF_INTEREST = {
    "tokenizer calls (tiktoken's encode_to_tiktoken_buffer / encode_ordinary)": (
        r"encode_to_tiktoken_buffer|method 'encode_ordinary'",
        "own",
    ),
    "JSON decoding (json.loads, orjson.loads)": (r"json/__init__\.py:\d+\(loads\)|orjson\.loads", "cum"),
    "pipe reads (posix.read)": (r"posix\.read", "own"),
    "pipe writes (posix.write)": (r"posix\.write", "own"),
    "waiting for workers (select.poll)": (r"method 'poll' of 'select\.poll'", "own"),
    "output .bin writes": (r"'(write|close)' of '_io\.BufferedWriter'", "own"),
    "building the tokenizer (build_tokenizer)": (r"\(_?build_tokenizer\)", "cum"),
}


def _report(prof: cProfile.Profile, name: str, wall: float, cpu: float, start: float, out: Path) -> dict:
    """Writes ``out/{name}.txt`` and returns the process's summary entry."""
    text = io.StringIO()
    print(f"{name}: pid {os.getpid()}, wall {wall:.3f} s, CPU {cpu:.3f} s", file=text)
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    (out / f"{name}.txt").write_text(text.getvalue())
    seconds = {}
    for label, (pattern, how) in _OF_INTEREST.items():
        matches = [
            (tt, ct)
            for (file, line, func), (_, _, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
            if re.search(pattern, f"{file}:{line}({func})")
        ]
        seconds[label] = round(sum(tt if how == "own" else ct for tt, ct in matches), 4)
    return {
        "start_s": round(start - T0, 4),
        "end_s": round(time.monotonic() - T0, 4),
        "wall_s": round(wall, 4),
        "cpu_s": round(cpu, 4),
        "seconds": seconds,
    }


def _profiled(original, out: Path):
    """``_worker_main`` under cProfile: the report is written as the worker's loop returns."""

    def worker_main(*args, **kwargs):
        start, cpu0 = time.monotonic(), time.process_time()
        prof = cProfile.Profile(_TIMER)
        prof.enable()
        try:
            return original(*args, **kwargs)
        finally:
            prof.disable()
            wall, cpu = time.monotonic() - start, time.process_time() - cpu0
            tmp = out / f".worker-{os.getpid()}.json"
            entry = _report(prof, f"worker-pid{os.getpid()}", wall, cpu, start, out)
            tmp.write_text(json.dumps(entry))

    return worker_main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="subdirectory of the reports, e.g. before / after")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--code", default=str(REPO), help="the tree whose data_tools is profiled (default: this one)"
    )
    ap.add_argument("--timer", choices=["cpu", "wall"], default="wall", help="cProfile's clock")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "profile_preprocess"))
    args = ap.parse_args()
    global _TIMER
    _TIMER = time.perf_counter if args.timer == "wall" else time.process_time
    from preprocess import BPE, CpuShare, gutenberg_documents  # bench/preprocess.py

    out = Path(args.out) / args.label
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    docs = gutenberg_documents()
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "gutenberg-00.jsonl"
        one.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        inputs = [one]
        for k in range(1, args.repeat):
            inputs.append(Path(tmp) / f"gutenberg-{k:02d}.jsonl")
            os.link(one, inputs[-1])
        argv = ["--input", *map(str, inputs), "--output-prefix", f"{tmp}/out"]
        argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(BPE / "encoder.json")]
        argv += ["--merge-file", str(BPE / "vocab.bpe"), "--append-eod", "--workers", str(args.workers)]
        argv += ["--log-interval", "0"]
        ordered_pool._worker_main = _profiled(ordered_pool._worker_main, out)
        load = os.getloadavg()
        share = CpuShare()
        share.start()
        start, cpu0 = time.monotonic(), time.process_time()
        prof = cProfile.Profile(_TIMER)
        prof.enable()
        status = preprocess.main(argv)
        prof.disable()
        wall, cpu = time.monotonic() - start, time.process_time() - cpu0
        busy_other = share.stop()
    assert status == 0, status
    summary = {
        "command": " ".join(sys.argv),
        "code": str(CODE) if CODE != REPO else "this tree",
        "timer": "wall" if _TIMER is time.perf_counter else "cpu (process_time)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores, load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "busy_other": round(busy_other, 3),  # share of the CPU time other processes took meanwhile
        "corpus_mb": round(sum(len(d.encode()) for d in docs) * args.repeat / 1e6, 2),
        "processes": {"main": _report(prof, "main", wall, cpu, start, out)},
    }
    for k, path in enumerate(sorted(out.glob(".worker-*.json"))):
        pid = path.name.split("-")[1].split(".")[0]
        summary["processes"][f"worker-{k}"] = json.loads(path.read_text())
        (out / f"worker-pid{pid}.txt").rename(out / f"worker-{k}.txt")
        path.unlink()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, entry in summary["processes"].items():
        print(f"{name:9} wall {entry['wall_s']:6.2f} s  CPU {entry['cpu_s']:6.2f} s  {entry['seconds']}")
    print(f"other processes' share of the CPU time meanwhile: {busy_other:.0%}; wrote {out}")


if __name__ == "__main__":
    main()
