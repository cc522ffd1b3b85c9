"""The step times of several configs measured in one job, their steps interleaved turn by turn.

    MEGAFORMER_MODULE=megaformer.experiments.step_timing launch/pretrain.sh SPEC.json

Why: the calibration's launches (:func:`megaformer.experiments.calibrate.calibrate`) alternate the
configs launch by launch, ~40 s apart; on a shared VM whose speed changes by 10-25 % from one
minute to the next (measured: ``experiments/cpu-final/``), adjacent launches of one config differ
that much, and 6 rounds still left the ratio of two configs' step times uncertain by ±5 %, more
than the cost of what they compare. Here every config's model, optimizer and DeepSpeed engine are
built once, side by side in the same processes, and the job alternates them every few steps
(turns of ``steps_per_turn`` steps, a few seconds each; the order rotated and reversed round by
round as in the calibration), so that whatever the machine does hits every config within seconds
of the others.

The spec (JSON, written by :func:`megaformer.experiments.calibrate.interleaved_step_times`)::

    {"runs": {"NAME": {"config": "PATH.yaml", "overrides": ["section.key=value", ...]}, ...},
     "warmup_steps": 10, "rounds": 40, "steps_per_turn": 5, "output": "PATH.json"}

Each config is built as :func:`megaformer.training.trainer.train` builds it (preflight, data,
model, optimizer, engine, the schedule applied) and stepped as its loop steps it (the timed region
is the same: the optimizer's rate read, then one :meth:`train_step` over the loader's
micro-batches); every config must have the same parallel layout (they share the process groups).
After ``warmup_steps`` steps of each (allocator, kernel selection, the loader's start; not timed), a
turn is: the first step (the switch from another model: cold caches; not timed), then
``steps_per_turn - 1`` timed steps, with the device synchronised at both ends. Rank 0 writes
``output``: every turn's round, position, config and mean step seconds. Nothing is checkpointed.

Exit status: 0, or 2 on a bad spec, config or dataset (said before any process group starts).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_tools.errors import DataFormatError
from data_tools.files import atomic_write_json
from megaformer.config import ConfigError, load_config
from megaformer.experiments.calibrate import round_order
from megaformer.parallel.layout import log
from megaformer.training.builders import build_data, build_layout
from megaformer.training.distributed import finish
from megaformer.training.preflight import run_preflight
from megaformer.training.trainer import build_engine, train_batches

SPEC_KEYS = {"runs", "warmup_steps", "rounds", "steps_per_turn", "output"}


def read_spec(path: str) -> dict[str, Any]:
    """The spec at ``path``, checked (see the module docstring).

    Raises:
        ValueError: unreadable, a missing or unknown key, fewer than two runs, ``rounds < 2``,
            ``steps_per_turn < 2`` or ``warmup_steps < 1``; the message names the file and key.
    """
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable step-timing spec ({e})") from e
    if not isinstance(spec, dict) or set(spec) != SPEC_KEYS:
        raise ValueError(f"{path}: a step-timing spec has exactly the keys {sorted(SPEC_KEYS)}")
    if len(spec["runs"]) < 2:
        raise ValueError(
            f"{path}: 'runs' holds {len(spec['runs'])} config(s); interleaving needs two or more"
        )
    for key, least in (("rounds", 2), ("steps_per_turn", 1), ("warmup_steps", 1)):
        if not isinstance(spec[key], int) or spec[key] < least:
            raise ValueError(f"{path}: '{key}' is {spec[key]!r}; it must be an integer >= {least}")
    return spec


class _Stepper:
    """One config's engine and micro-batch stream in the shared processes."""

    def __init__(self, cfg: Any, layout: Any, preflight: Any) -> None:
        data = build_data(cfg, layout, preflight.stats, preflight.datasets)
        self.engine = build_engine(cfg, layout, preflight.dp_size, None)[0]
        self.engine.apply_schedule()
        self.batches = train_batches(cfg, layout, data, 0)
        self.device = layout.device

    def steps(self, n: int) -> None:
        """``n`` steps, as the training loop takes them."""
        for _ in range(n):
            self.engine.lr()
            loss = self.engine.train_step(self.batches)
        self.sync(loss)

    def sync(self, loss: Any) -> None:
        """Wait for the device (on CPU the step's all-reduce has already waited)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        del loss


def _build(spec: dict[str, Any], world_size: int) -> tuple[Any, dict[str, _Stepper]]:
    """Load and preflight every config (before any process group), then build the engines."""
    cfgs = {n: load_config(r["config"], r["overrides"]) for n, r in spec["runs"].items()}
    preflights = {n: run_preflight(c, world_size) for n, c in cfgs.items()}
    first = next(iter(cfgs))
    for name, cfg in cfgs.items():
        if cfg.parallel != cfgs[first].parallel or preflights[name].dp_size != preflights[first].dp_size:
            raise ConfigError(
                f"{spec['runs'][name]['config']}: its parallel layout differs from "
                f"{spec['runs'][first]['config']}'s; configs timed together share one layout "
                "(time them in separate calibrations)"
            )
    layout = build_layout(cfgs[first], preflights[first].dp_size)
    return layout, {n: _Stepper(cfgs[n], layout, preflights[n]) for n in cfgs}


def run(spec: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Build every config and time their interleaved turns; returns the turns (every rank)."""
    layout, steppers = _build(spec, world_size)
    names = list(steppers)
    for name in names:
        steppers[name].steps(spec["warmup_steps"])
    log(layout, f"step timing: {len(names)} configs warmed up; {spec['rounds']} interleaved rounds")
    k, turns = spec["steps_per_turn"], []
    for r in range(spec["rounds"]):
        for position, name in enumerate(round_order(names, r)):
            stepper = steppers[name]
            dist.barrier()  # every rank starts the turn together: the turn times one job's steps
            seconds = []
            for _ in range(k):
                start = time.perf_counter()
                stepper.steps(1)
                seconds.append(time.perf_counter() - start)
            turns.append({"round": r, "position": position, "name": name, "step_seconds": seconds})
        if layout.is_main and (r + 1) % max(1, spec["rounds"] // 10) == 0:
            log(layout, f"step timing: round {r + 1}/{spec['rounds']}")
    return turns


def main(argv: list[str] | None = None) -> None:
    """``python -m megaformer.experiments.step_timing SPEC.json`` on every rank (see the module
    docstring); the launcher's ``--local_rank`` is ignored."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local")]
    try:
        spec = read_spec(args[0] if args else "")
        turns = run(spec, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, ConfigError, DataFormatError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        record = {k: spec[k] for k in ("warmup_steps", "rounds", "steps_per_turn")}
        atomic_write_json(spec["output"], {**record, "turns": turns})
    finish(0)


if __name__ == "__main__":
    main()
