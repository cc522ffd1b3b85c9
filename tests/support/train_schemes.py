"""Test helper: several short trainings in ONE process group (started by the caller, torchrun-style
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

    python tests/support/train_schemes.py CONFIG OUT_ROOT NAME=OVERRIDE[;OVERRIDE...] ... -- COMMON...

Each ``NAME`` trains ``CONFIG`` with ``COMMON`` and its own overrides into ``OUT_ROOT/NAME`` through
:func:`megaformer.training.trainer.train`, the trainer the launcher runs; one process start-up
(imports, rendezvous) serves every run, which is what makes a checkpoint per norm scheme cheap.
"""

from __future__ import annotations

import os
import sys

from megaformer.config import load_config
from megaformer.training.distributed import finish
from megaformer.training.trainer import train


def main(argv: list[str]) -> None:
    config, out_root, *rest = argv
    split = rest.index("--") if "--" in rest else len(rest)
    runs, common = rest[:split], rest[split + 1 :]
    for spec in runs:
        name, _, overrides = spec.partition("=")
        extra = [o for o in overrides.split(";") if o]
        cfg = load_config(config, [*common, *extra, f"output.dir={os.path.join(out_root, name)}"])
        train(cfg)
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1:])
