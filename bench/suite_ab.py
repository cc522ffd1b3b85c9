"""The same test files in two checkouts, timed in alternation on this machine: a suite change's
effect as a ratio that the machine's drift does not decide.

    .venv/bin/python bench/suite_ab.py --a /path/to/clone-before --b /path/to/clone-after \\
        --pairs 2 --json bench/results/suite/ab.json tests/distributed/test_tp_train.py ...

Each checkout needs its own installed ``.venv`` (``bash scripts/install.sh --dev`` in it, as its
``.ci/run`` does). A round runs A then B, the next B then A (so neither always goes first), each as
``scripts/check.sh`` runs its tiers: the files' tests not marked ``serial`` on ``--workers``
pytest-xdist workers (whole files per worker), then their ``serial`` tests in one process; each
run with an empty inductor cache of its own (CI's machine starts with none). Prints a table of
pytest's wall-clock per run and the B/A ratio of each pair, and writes them as JSON.

Why not two clean-clone suites hours apart: the project VM's speed drifted by 24 % within two hours
(2026-12-07: the unchanged files of the suite took 1.12x and 1.24x their morning time), more than the
change measured; a pair run back to back shares the machine's state.

Raises:
    SystemExit: a checkout without ``.venv/bin/python``, or a run whose pytest failed (its output is
        printed): a failing test would make its time meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _serial_files(checkout: Path, files: list[str]) -> list[str]:
    return [f for f in files if "pytest.mark.serial" in (checkout / f).read_text(encoding="utf-8")]


def run_once(checkout: Path, files: list[str], workers: int) -> dict:
    """Wall-clock seconds of the parallel and the serial pytest call in ``checkout``.

    Raises:
        SystemExit: pytest failed (its output tail is printed).
    """
    python = checkout / ".venv" / "bin" / "python"
    serial = _serial_files(checkout, files)
    out = {"parallel_s": 0.0, "serial_s": 0.0}
    with tempfile.TemporaryDirectory(prefix="suite-ab-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        env.pop("PYTEST_ADDOPTS", None)
        calls = [("parallel_s", ["-n", str(workers), "--dist", "loadfile", "-m", "not serial", *files])]
        if serial:
            calls.append(("serial_s", ["-m", "serial", *serial]))
        for key, args in calls:
            start = time.perf_counter()
            proc = subprocess.run(
                [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                cwd=checkout, env=env, capture_output=True, text=True,
            )  # fmt: skip
            out[key] = round(time.perf_counter() - start, 1)
            if proc.returncode != 0:
                print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
                raise SystemExit(
                    f"{checkout}: pytest {' '.join(args[:4])} ... failed (exit {proc.returncode})"
                )
    out["total_s"] = round(out["parallel_s"] + out["serial_s"], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, type=Path, help="the checkout before the change")
    p.add_argument("--b", required=True, type=Path, help="the checkout after the change")
    p.add_argument("--pairs", type=int, default=2, help="rounds of A and B (alternating which goes first)")
    p.add_argument(
        "--start-with", choices=["a", "b"], default="a", help="which checkout the first round runs first"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="pytest-xdist workers")
    p.add_argument("--json", type=Path, default=None, help="write the runs and ratios here")
    p.add_argument("files", nargs="+", help="test files, relative to each checkout")
    args = p.parse_args(argv)
    for checkout in (args.a, args.b):
        if not (checkout / ".venv" / "bin" / "python").is_file():
            raise SystemExit(
                f"{checkout}: no .venv/bin/python; run `bash scripts/install.sh --dev` there first"
            )
        missing = [f for f in args.files if not (checkout / f).is_file()]
        if missing:
            raise SystemExit(f"{checkout}: no {', '.join(missing)}")
    head = ["git", "rev-parse", "--short", "HEAD"]
    commits = {
        k: subprocess.run(head, cwd=c, capture_output=True, text=True).stdout.strip()
        for k, c in (("a", args.a), ("b", args.b))
    }
    rows = []
    for i in range(args.pairs):
        first = args.start_with if i % 2 == 0 else {"a": "b", "b": "a"}[args.start_with]
        order = (first, "b" if first == "a" else "a")
        pair = {"round": i, "order": "".join(order)}
        for key in order:
            pair[key] = run_once(args.a if key == "a" else args.b, args.files, args.workers)
            print(f"round {i} {key} ({commits[key]}): {pair[key]}", flush=True)
        pair["ratio_b_over_a"] = round(pair["b"]["total_s"] / pair["a"]["total_s"], 3)
        rows.append(pair)
    print(f"\n| round | order | A {commits['a']} (s) | B {commits['b']} (s) | B / A |")
    print("|---|---|---|---|---|")
    for r in rows:
        a, b = r["a"]["total_s"], r["b"]["total_s"]
        print(f"| {r['round']} | {r['order']} | {a:.1f} | {b:.1f} | {r['ratio_b_over_a']:.3f} |")
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count()},
        "commits": commits, "workers": args.workers, "files": args.files, "rounds": rows,
    }  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
