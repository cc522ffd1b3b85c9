"""The tracked tree stays small enough to travel (issue 36, item 6).

A device call carries the working tree in at most 64 MiB, so the tracked files must leave room for
what travels with them. On 2026-11-28 the tree was 50.6 MB, 33.4 MB of it 31 committed runs' raw
TensorBoard event files; those runs now keep ``scalars.json.gz`` (2.3 MB in all) and the tree is
19.5 MB. Raw event files belong outside git (``runs/`` is ignored); a run to commit gets
``python -m megaformer.experiments.scalars export RUN_DIR --remove-events`` first.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 25_000_000  # 25 MB: under half of a device call's 64 MiB


def _tracked_sizes() -> dict[str, int]:
    """``{path: bytes}`` of every tracked file present in the working tree (symlinks: the link)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: {proc.stderr.decode(errors='replace').strip()}")
    sizes = {}
    for name in proc.stdout.decode("utf-8", errors="surrogateescape").split("\0"):
        path = REPO / name
        if name and (path.is_symlink() or path.is_file()):
            sizes[name] = path.lstat().st_size
    return sizes


def test_the_tracked_tree_fits_a_device_call():
    sizes = _tracked_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIMIT_BYTES, (
        f"the tracked tree is {total / 1e6:.1f} MB, over {LIMIT_BYTES / 1e6:.0f} MB; largest: "
        + ", ".join(f"{name} ({size / 1e6:.1f} MB)" for name, size in largest)
        + ". Commit runs as scalars.json.gz (python -m megaformer.experiments.scalars export RUN_DIR "
        "--remove-events), not their TensorBoard events"
    )


def test_no_tensorboard_event_file_is_tracked():
    events = [name for name in _tracked_sizes() if "tfevents" in Path(name).name]
    assert not events, (
        f"{len(events)} TensorBoard event files are tracked (e.g. {events[0]}); keep raw events outside "
        "git and commit the run's scalars.json.gz instead (python -m megaformer.experiments.scalars "
        "export RUN_DIR --remove-events)"
    )
