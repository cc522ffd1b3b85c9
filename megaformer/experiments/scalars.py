"""A run's TensorBoard scalars in one small file, and one reader for either form.

    python -m megaformer.experiments.scalars export RUN_DIR [RUN_DIR ...] [--remove-events]

A run writes its scalars as TensorBoard events under ``<run dir>/tensorboard/`` (about 1 MB for a
1,000-step CPU run: every event carries a wall time and a protobuf frame). ``export`` writes the
same series beside the run's ``summary.json`` as ``scalars.json.gz`` (about 90 kB), checks that it
reads back equal to the events, and with ``--remove-events`` deletes the event files. Runs
committed to git keep only that file; raw event files stay outside git (``runs/`` is ignored).

:func:`read_scalars` reads a run directory in either form (the events when there are any), so
``compare``, ``plot`` and the experiment scripts take a committed run like a fresh one.

The file is gzip-compressed JSON::

    {"format": "megaformer-scalars/1",
     "events": ["events.out.tfevents..."],          # the event files it was made from
     "histograms_not_kept": ["scales/...", ...],      # histogram tags of those events (see below)
     "tags": {"train/loss": {"dtype": "float32", "steps": [1, 2, ...], "values": [11.405361, ...]},
              ...}}

Each tag's points are in the order TensorBoard's ``EventAccumulator`` returns them (by step; a step
logged twice appears twice). TensorBoard stores a scalar as a float32: such a tag has ``"dtype":
"float32"`` and each value is written as the shortest decimal that reads back as that float32,
so :func:`read_compact` returns exactly the floats ``EventAccumulator`` gives (nothing is rounded).
A tag with a value that is not a float32 (none that ``megaformer.train`` writes) is ``"float64"``,
written in full. Histograms (``scales/*``, logged with ``train.diagnostics_interval`` > 0) are not
kept: ``plot``'s ``<run>_scales.png`` needs the event files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

COMPACT_FILE = "scalars.json.gz"
"""The compact file's name, beside the run's ``summary.json``."""

FORMAT = "megaformer-scalars/1"

Series = list[tuple[int, float]]
"""One tag's points: ``[(step, value)]``, in logged order (steps are tokens for ``*-vs-tokens``)."""


class ScalarsNotFoundError(FileNotFoundError, ValueError):
    """A run directory with neither TensorBoard events nor a compact scalars file. Both a
    ``FileNotFoundError`` and a ``ValueError`` (as :class:`io.UnsupportedOperation` is both an
    ``OSError`` and a ``ValueError``), so the commands that report either as a user error
    (``compare``, ``plot``) report this one too."""


def event_files(tb_dir: str | Path) -> list[Path]:
    """The TensorBoard event files (``events.out.tfevents.*``) in ``tb_dir``, sorted; [] when the
    directory is missing."""
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        return []
    return sorted(p for p in tb_dir.iterdir() if p.name.startswith("events.out.tfevents"))


def read_events(tb_dir: str | Path) -> dict[str, Series]:
    """Every scalar tag of the TensorBoard events in ``tb_dir``: ``{tag: [(step, value)]}``.

    Raises:
        ScalarsNotFoundError: ``tb_dir`` holds no event files.
    """
    return _scalars_of(_load(tb_dir))


def _load(tb_dir: str | Path):  # -> EventAccumulator, imported lazily (tensorboard is slow to import)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not event_files(tb_dir):
        raise ScalarsNotFoundError(f"{tb_dir}: no TensorBoard event files (events.out.tfevents.*)")
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def _scalars_of(acc) -> dict[str, Series]:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _is_float32(values: Sequence[float]) -> bool:
    """Whether every value is exactly a float32 (NaN and inf count as float32)."""
    arr = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        back = arr.astype(np.float32).astype(np.float64)
    return bool(np.array_equal(arr, back, equal_nan=True))


def _encode(series: Series) -> dict:
    steps = [int(step) for step, _ in series]
    values = [float(v) for _, v in series]
    if _is_float32(values):
        # str(np.float32(v)): the shortest decimal that reads back as this float32 (e.g. 11.405361
        # for 11.40536117553711), about half the digits of the float64's repr.
        return {"dtype": "float32", "steps": steps, "values": [float(str(np.float32(v))) for v in values]}
    return {"dtype": "float64", "steps": steps, "values": values}


def _decode(tag: str, entry: dict, path: Path) -> Series:
    steps, values, dtype = entry.get("steps"), entry.get("values"), entry.get("dtype")
    if not isinstance(steps, list) or not isinstance(values, list) or len(steps) != len(values):
        raise ValueError(f"{path}: tag '{tag}' needs 'steps' and 'values' lists of one length")
    if dtype == "float32":
        values = np.asarray(values, dtype=np.float32).astype(np.float64).tolist()
    elif dtype != "float64":
        raise ValueError(f"{path}: tag '{tag}' has dtype {dtype!r}; expected 'float32' or 'float64'")
    return [(int(s), float(v)) for s, v in zip(steps, values, strict=True)]


def read_compact(path: str | Path) -> dict[str, Series]:
    """The scalars of a compact file (``scalars.json.gz``): ``{tag: [(step, value)]}``, the values
    exactly those of the events it was made from.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a compact scalars file of this format (names the path and what is wrong).
    """
    path = Path(path)
    try:
        record = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: not a gzip-compressed JSON scalars file ({e})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}: format {got!r}; expected {FORMAT!r} (written by write_compact)")
    return {tag: _decode(tag, entry, path) for tag, entry in record["tags"].items()}


def read_scalars(run_dir: str | Path) -> dict[str, Series]:
    """Every scalar tag of a run: ``{tag: [(step, value)]}``, from its TensorBoard events
    (``<run_dir>/tensorboard/events.out.tfevents.*``) when there are any, else from its compact
    file (``<run_dir>/scalars.json.gz``, :func:`write_compact`); both give the same values.

    Raises:
        ScalarsNotFoundError: ``run_dir`` has neither; the message names both paths and the fix.
        ValueError: the compact file is damaged or of another format.
    """
    run_dir = Path(run_dir)
    tb_dir = run_dir / "tensorboard"
    if event_files(tb_dir):
        return read_events(tb_dir)
    compact = run_dir / COMPACT_FILE
    if compact.is_file():
        return read_compact(compact)
    raise ScalarsNotFoundError(
        f"{run_dir}: no tensorboard/ events ({tb_dir}/events.out.tfevents.*) and no {compact}; "
        "pass a run directory (output.dir of a megaformer run), or, where its events are, write the "
        f"compact file with `python -m megaformer.experiments.scalars export {run_dir}`"
    )


def read_tb_dir(tb_dir: str | Path) -> dict[str, Series]:
    """:func:`read_scalars` for callers that hold a run's TensorBoard directory (``summary.json``'s
    ``tensorboard_dir``, ``<run dir>/tensorboard``): its events, or, when it has none, the compact
    file of its parent, the run directory.

    Raises:
        ScalarsNotFoundError: neither is there.
        ValueError: the compact file is damaged or of another format.
    """
    tb_dir = Path(tb_dir)
    return read_events(tb_dir) if event_files(tb_dir) else read_scalars(tb_dir.parent)


def write_compact(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/scalars.json.gz`` from the run's TensorBoard events and return its path.

    The file is read back and compared with the events before this returns, so deleting the
    events afterwards loses no scalar. The same events give the same bytes (no timestamp inside).

    Raises:
        ScalarsNotFoundError: ``<run_dir>/tensorboard`` holds no event files.
        RuntimeError: the file did not read back equal to the events (it is removed).
    """
    run_dir = Path(run_dir)
    tb_dir = run_dir / "tensorboard"
    files = event_files(tb_dir)
    if not files:
        raise ScalarsNotFoundError(
            f"{run_dir}: no TensorBoard events in {tb_dir} to export; pass a run directory "
            "(output.dir of a megaformer run) that still has its tensorboard/ events"
        )
    acc = _load(tb_dir)
    scalars = _scalars_of(acc)
    record = {
        "format": FORMAT,
        "events": [p.name for p in files],
        "histograms_not_kept": sorted(acc.Tags()["histograms"]),
        "tags": {tag: _encode(series) for tag, series in scalars.items()},
    }
    text = json.dumps(record, separators=(",", ":"), allow_nan=True)
    path = run_dir / COMPACT_FILE
    path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    if not _same(read_compact(path), scalars):
        path.unlink()
        raise RuntimeError(f"{path}: did not read back equal to the events in {tb_dir}; removed it")
    return path


def _same(a: dict[str, Series], b: dict[str, Series]) -> bool:
    """Equal tags, steps and values (NaN equal to NaN)."""
    if a.keys() != b.keys():
        return False
    for tag in a:
        if [s for s, _ in a[tag]] != [s for s, _ in b[tag]]:
            return False
        va = np.asarray([v for _, v in a[tag]], dtype=np.float64)
        vb = np.asarray([v for _, v in b[tag]], dtype=np.float64)
        if not np.array_equal(va, vb, equal_nan=True):
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megaformer.experiments.scalars", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser(
        "export", help=f"write {COMPACT_FILE} beside each run's summary.json from its tensorboard/ events"
    )
    export.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="megaformer run directories (output.dir)"
    )
    export.add_argument(
        "--remove-events",
        action="store_true",
        help="delete the event files (and the tensorboard/ directory, if then empty) once the file "
        "reads back equal to them",
    )
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        try:
            files = event_files(Path(run_dir) / "tensorboard")
            path = write_compact(run_dir)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        size = sum(p.stat().st_size for p in files)
        print(f"{path}: {path.stat().st_size:,} bytes (events: {size:,} bytes in {len(files)} file(s))")
        dropped = json.loads(gzip.decompress(path.read_bytes()))["histograms_not_kept"]
        if dropped:
            print(
                f"note: {len(dropped)} histogram tag(s) not kept ({dropped[0]}, ...): "
                "plot's <run>_scales.png needs the event files",
                file=sys.stderr,
            )
        if args.remove_events:
            for p in files:
                p.unlink()
            tb_dir = Path(run_dir) / "tensorboard"
            if not any(tb_dir.iterdir()):
                tb_dir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
