"""How long a user waits for the tools that do not train: ``--help`` of each, and a short
``generate`` on a checkpoint (issue 39: a cold ``generate`` took 31 s on a loaded 2-core machine).

    .venv/bin/python bench/tool_startup.py --checkpoint runs/quickstart [--repeats 3]
        [--out bench/results/tool_startup.json]

Each command runs ``--repeats`` times in a fresh interpreter (the first may pay a cold file cache);
the table gives the median and the fastest wall-clock seconds, and whether DeepSpeed was imported
(its "Setting accelerator" banner). Targets on a quiet 2-core machine: ``generate --help`` under
2 s, a quickstart-checkpoint ``generate`` (8 new tokens) under 10 s. The JSON records the machine,
date, commit and the 1-minute load average before and after: a loaded machine's figures are not
the targets' (say so when recording them). Not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.files import atomic_write_json  # noqa: E402

HELP = ["generate", "evaluate", "export_hf", "zero_shot", "plan", "dryrun", "reshard", "finetune"]


def timed(cmd: list[str]) -> tuple[float, bool, int]:
    """``(seconds, DeepSpeed imported, exit code)`` of one command from the repository root."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, "Setting accelerator" in proc.stdout + proc.stderr, proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run directory (e.g. runs/quickstart)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "tool_startup.json"))
    args = p.parse_args(argv)
    if not Path(args.checkpoint).exists():
        print(
            f"error: --checkpoint {args.checkpoint}: no such directory; train one first "
            "(scripts/quickstart.sh)"
        )
        return 2
    cases = {f"{tool} --help": [sys.executable, "-m", f"megaformer.tools.{tool}", "--help"] for tool in HELP}
    cases["generate (8 tokens)"] = [
        sys.executable, "-m", "megaformer.tools.generate", "--checkpoint", args.checkpoint,
        "--prompt", "It was", "--max-new-tokens", "8",
    ]  # fmt: skip
    load0 = os.getloadavg()[0]
    rows = {}
    for name, cmd in cases.items():
        runs = [timed(cmd) for _ in range(args.repeats)]
        secs = [s for s, _, _ in runs]
        rows[name] = {
            "median_s": statistics.median(secs),
            "min_s": min(secs),
            "deepspeed_imported": any(d for _, d, _ in runs),
            "exit_codes": sorted({c for _, _, c in runs}),
        }
        r = rows[name]
        print(
            f"| {name} | {r['median_s']:.2f} | {r['min_s']:.2f} | "
            f"{'yes' if r['deepspeed_imported'] else 'no'} |"
        )
    record = {
        "rows": rows,
        "repeats": args.repeats,
        "checkpoint": args.checkpoint,
        "load_average_1min": [load0, os.getloadavg()[0]],
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
    }
    atomic_write_json(Path(args.out), record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
