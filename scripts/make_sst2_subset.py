"""Write the bundled SST-2 training subset (data/glue/SST-2/train.tsv) from GLUE's full train.tsv.

    .venv/bin/python scripts/make_sst2_subset.py FULL_TRAIN_TSV [--output data/glue/SST-2/train.tsv]
        [--keep 10000] [--salt glue-sst2-train-subset] [--any-input]

FULL_TRAIN_TSV is GLUE's ``SST-2/train.tsv`` (67,349 rows + header, 3,806,081 bytes, sha256
``48eac263…``; origin in data/glue/SOURCE.md). The subset is the header, then the ``--keep`` data rows
chosen by :func:`megaformer.data.glue.hashed_subset` (the rows whose ``sha256("<salt>:<row index>")``
is smallest), in the full file's order, each line's bytes unchanged. With the defaults on that file
the output's sha256 is :data:`SUBSET_SHA256`, checked before anything is written. Another input is
refused unless ``--any-input`` (then no hash is checked).

Exit status: 0 written; 2 a missing or unexpected input file, or a bad ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without installing the package

from megaformer.data.glue import hashed_subset  # noqa: E402

FULL_SHA256 = "48eac26399f8456935f81dd9e3a745c1430adb6c62e233ccfe22db4a0d15d1d1"
FULL_ROWS = 67349
SUBSET_SHA256 = "1fe138c375a482ab9de263a5f7deb15e12b0b8b7498d351c90a3d06106188b66"
KEEP = 10000
SALT = "glue-sst2-train-subset"


def subset_bytes(full: bytes, keep: int, salt: str) -> bytes:
    """The header line and the chosen data lines of ``full`` (a ``.tsv`` with a header, ``\\n`` line
    ends, a final newline), bytes unchanged.

    Raises:
        ValueError: no final newline, no data rows, or ``keep`` outside ``[1, rows]``.
    """
    if not full.endswith(b"\n"):
        raise ValueError("the file does not end with a newline; GLUE's train.tsv does")
    lines = full.split(b"\n")[:-1]
    header, rows = lines[0], lines[1:]
    if not rows:
        raise ValueError("the file has a header and no data rows")
    chosen = hashed_subset(len(rows), keep, salt)
    return b"\n".join([header, *(rows[i] for i in chosen)]) + b"\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("full", help="GLUE's SST-2/train.tsv (all 67,349 rows)")
    p.add_argument("--output", default=str(REPO / "data" / "glue" / "SST-2" / "train.tsv"))
    p.add_argument("--keep", type=int, default=KEEP, help="data rows in the subset")
    p.add_argument("--salt", default=SALT, help="names the subset (see hashed_subset)")
    p.add_argument("--any-input", action="store_true", help="accept a file other than GLUE's")
    args = p.parse_args(argv)
    try:
        with open(args.full, "rb") as f:
            full = f.read()
    except OSError as e:
        print(f"error: {args.full}: {e.strerror}; pass GLUE's SST-2/train.tsv", file=sys.stderr)
        return 2
    digest = hashlib.sha256(full).hexdigest()
    if digest != FULL_SHA256 and not args.any_input:
        print(
            f"error: {args.full}: sha256 {digest}, not GLUE's SST-2 train.tsv ({FULL_SHA256}, "
            f"{FULL_ROWS} rows; data/glue/SOURCE.md); pass --any-input to subset another file",
            file=sys.stderr,
        )
        return 2
    try:
        out = subset_bytes(full, args.keep, args.salt)
    except ValueError as e:
        print(f"error: {args.full}: {e}", file=sys.stderr)
        return 2
    out_digest = hashlib.sha256(out).hexdigest()
    if not args.any_input and (args.keep, args.salt) == (KEEP, SALT) and out_digest != SUBSET_SHA256:
        raise AssertionError(f"subset sha256 {out_digest} != recorded {SUBSET_SHA256}")  # our invariant
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".tmp", "wb") as f:
        f.write(out)
    os.replace(args.output + ".tmp", args.output)
    rows, total = out.count(b"\n") - 1, full.count(b"\n") - 1
    positive = sum(line.endswith(b"\t1") for line in out.split(b"\n")[1:])  # SST-2: label last
    print(
        f"wrote {args.output}: {rows} of {total} rows ({positive} ending in label 1), "
        f"{len(out):,} bytes, sha256 {out_digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
