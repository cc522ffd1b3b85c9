"""``python -m megaformer.tools.plan``: the memory and throughput planner's command.

``python -m megaformer.tools.plan CONFIG [section.key=value ...] --gpu a100-80gb --nodes N
--gpus-per-node G [--mfu 0.4] [--predict] [--counts auto|trace|formula]`` prints the memory plan of
every pipeline stage against the device (:mod:`megaformer.perf.plan`, whose docstring says what is
counted), the step time at a stated MFU or, with ``--predict``, the step-time model's
(:mod:`megaformer.perf.steptime`), whether the layout fits the recipes' devices, and a layout that
fits where it does not. Exit 0 when the plan fits, 1 when it does not, 2 on a config error.
"""

from __future__ import annotations

import argparse
import os
import sys

from megaformer.config import ConfigError, load_config
from megaformer.config.schema import RunConfig
from megaformer.perf import steptime
from megaformer.perf.fakecuda.gpus import GPU_ALIASES, gpu_name
from megaformer.perf.plan import (
    DEVICES,
    GIB,
    RECIPE_DEVICES,
    Plan,
    cpu_device,
    describe,
    header_layout,
    layout_overrides,
    make_plan,
    recipe_layout,
    suggest_layout,
    with_train,
)


def _layout_line(how: str, header: Plan | None, found: Plan | None, extra: list[str] | None) -> str:
    """One device's suggestion for ``main``: the header's layout where it fits, the planner's
    otherwise, and why they differ where both fit."""
    if how == "header":
        added = " ".join(extra or [])
        line = f"; the recipe header's layout fits: add {added} (peak {header.peak / GIB:.1f} GiB)"
        if found is not None and layout_overrides(found) != layout_overrides(header):
            line += (
                f"\n      (the planner's own search would pick {layout_overrides(found)}: it keeps this "
                "file's ZeRO stage and precision and takes the largest micro-batch that fits; the header's "
                "layout is the recipe's own choice for this GPU, its comment says why)"
            )
        return line
    line = ""
    if header is not None:
        added = " ".join(extra or [])
        line = f"; the recipe header's layout ({added}) does NOT fit (peak {header.peak / GIB:.1f} GiB)"
    return line + "; suggested: " + (layout_overrides(found) if found else "nothing fits this world size")


# --- printing --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m megaformer.tools.plan", description=__doc__.split("\n")[0]
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for the launcher")
    parser.add_argument(
        "--gpu",
        default="a100-80gb",
        type=lambda v: "cpu" if v.lower() == "cpu" else gpu_name(v),
        help=f"one of {', '.join(DEVICES)} (aliases: {', '.join(GPU_ALIASES)}), or cpu",
    )
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="devices (CPU: processes) per node")
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for the step time"
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="also predict the step time, tokens/s, MFU and device-hours (megaformer.perf.steptime)",
    )
    parser.add_argument(
        "--counts",
        default="auto",
        choices=("auto", "trace", "formula"),
        help="--predict: count a block's operations from its fake-CUDA trace (auto: where the shim "
        "builds, on GPUs) or by formula",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        world = args.nodes * args.gpus_per_node
        device = cpu_device(args.gpus_per_node) if args.gpu == "cpu" else DEVICES[args.gpu]
        plan = make_plan(cfg, device, world, args.mfu)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(plan, assumed_mfu=not args.predict))
    if args.predict:
        print("\n" + _predict(cfg, args.gpu, world, args.gpus_per_node, args.counts))
    if args.gpu != "cpu":
        print("\nthis layout on the recipes' devices:")
        for key in RECIPE_DEVICES:
            dev = DEVICES[key]
            trial = cfg if dev.bf16 or cfg.train.precision != "bf16" else with_train(cfg, precision="fp16")
            p = make_plan(trial, dev, world, args.mfu)
            line = f"  {dev.name:16s} peak {p.peak / GIB:6.2f} GiB: {'fits' if p.fits else 'does NOT fit'}"
            if not p.fits:
                how, header, found = recipe_layout(
                    args.config, args.overrides, key, world, args.gpus_per_node
                )
                line += _layout_line(how, header, found, header_layout(args.config, key))
            print(line)
    if not plan.fits and args.gpu != "cpu":
        alt = suggest_layout(cfg, device, world, args.gpus_per_node)
        print("suggested layout: " + (layout_overrides(alt) if alt else "none fits; add devices"))
    return 0 if plan.fits else 1


def _predict(cfg: RunConfig, gpu: str, world: int, gpus_per_node: int, counts: str = "auto") -> str:
    """``--predict``: the step-time model's prediction (fp16 for a bf16 config on a V100)."""
    if gpu == "cpu":
        threads = max(1, (os.cpu_count() or 1) // gpus_per_node)
        dev = steptime.cpu_device(threads=threads, processes=gpus_per_node)
    else:
        dev = steptime.DEVICE_SPECS[gpu]
        if not DEVICES[gpu].bf16 and cfg.train.precision == "bf16":
            cfg = with_train(cfg, precision="fp16")
    return steptime.describe(steptime.predict(cfg, dev, world, gpus_per_node, counts), dev)


if __name__ == "__main__":
    sys.exit(main())
