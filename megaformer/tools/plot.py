"""Pictures of runs as PNG files, read from their TensorBoard events (or a committed run's
``scalars.json.gz``: every figure but the scales').

    python -m megaformer.tools.plot RUN_DIR [RUN_DIR ...] [--output-dir DIR] [--step N]

Written to ``DIR`` (default ``<first RUN_DIR>/plots``):

* ``loss.png``: training loss (thin) and validation loss (markers) against steps and against
  tokens, one colour per run;
* ``grads_fc2_l1_by_layer.png``: the average L1 norm of each layer's FC2 weight gradient, one line
  per run, at the first, middle and last diagnostics step every run logged (or at ``--step``) (the
  NormFormer paper's Fig. 3, Shleifer et al. 2021);
* ``<run>_grads_l2.png``: per run, the L2 gradient norm of each operation by layer over the logged
  steps (one panel per operation; the paper's Fig. 7 view of every op);
* ``<run>_scales.png``: per run, the distribution of each learned scale by layer at the last
  diagnostics step, from its TensorBoard histogram: mean ± standard deviation and min–max (the
  paper's Fig. 4).

Runs need ``train.diagnostics_interval`` > 0 for the gradient and scale figures; without them only
``loss.png`` is written (and the tool says so).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from megaformer.experiments.scalars import event_files, read_scalars

LAYER_TAG = re.compile(r"^(.*)/layer_(\d+)$")


class RunEvents:
    """The scalars and histograms of one run directory's ``tensorboard/`` events, or, when it has
    none (a committed run), its scalars from ``scalars.json.gz`` (:mod:`megaformer.experiments.scalars`;
    no histograms: no ``<run>_scales.png``).

    Raises:
        FileNotFoundError: ``run_dir`` has neither (``ScalarsNotFoundError``, naming both).
        ValueError: its ``scalars.json.gz`` is damaged or of another format.
    """

    def __init__(self, run_dir: str) -> None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = os.path.join(run_dir, "tensorboard")
        self.name = os.path.basename(os.path.normpath(run_dir))
        if not event_files(tb):
            self.scalars = {t: dict(series) for t, series in read_scalars(run_dir).items()}
            self.histograms: dict[str, dict[int, Any]] = {}
            return
        acc = EventAccumulator(tb, size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        self.scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
        self.histograms = {
            t: {e.step: e.histogram_value for e in acc.Histograms(t)} for t in acc.Tags()["histograms"]
        }

    def by_layer(self, prefix: str) -> dict[int, dict[int, float]]:
        """``{layer: {step: value}}`` of the scalars ``<prefix>/layer_NN``."""
        out = {}
        for tag, values in self.scalars.items():
            m = LAYER_TAG.match(tag)
            if m and m.group(1) == prefix:
                out[int(m.group(2))] = values
        return dict(sorted(out.items()))

    def ops(self, family: str) -> list[str]:
        """The ``<op>`` names under ``<family>/<op>/layer_NN`` (e.g. ``grads/l2``, ``scales``)."""
        names = set()
        for tag in list(self.scalars) + list(self.histograms):
            m = LAYER_TAG.match(tag)
            if m and m.group(1).startswith(family + "/"):
                names.add(m.group(1)[len(family) + 1 :])
        return sorted(names)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_loss(runs: list[RunEvents], path: str) -> None:
    """Training and validation loss against steps (left) and tokens (right)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        color = f"C{i}"
        for ax, suffix in ((axes[0], ""), (axes[1], "-vs-tokens")):
            train = run.scalars.get(f"train/loss{suffix}", {})
            valid = run.scalars.get(f"valid/loss{suffix}", {})
            if train:
                ax.plot(
                    list(train),
                    list(train.values()),
                    color=color,
                    lw=0.8,
                    alpha=0.7,
                    label=f"{run.name} train",
                )
            if valid:
                ax.plot(list(valid), list(valid.values()), "o-", color=color, ms=4, label=f"{run.name} valid")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("tokens")
    for ax in axes:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def common_diagnostics_steps(runs: list[RunEvents]) -> list[int]:
    """The steps at which every run logged its FC2 gradient norms (sorted)."""
    steps = None
    for run in runs:
        layers = run.by_layer("grads/fc2_l1")
        run_steps = set().union(*(v.keys() for v in layers.values())) if layers else set()
        steps = run_steps if steps is None else steps & run_steps
    return sorted(steps or ())


def fc2_missing_reason(runs: list[RunEvents]) -> str:
    """Why no step is common to every run's FC2 gradient norms: the runs without any (logged only
    with ``train.diagnostics_interval`` > 0), or steps that never coincide."""
    without = [run.name for run in runs if not run.by_layer("grads/fc2_l1")]
    if without:
        return (
            f"{', '.join(without)} logged no FC2 gradient norms (train with train.diagnostics_interval > 0, "
            "e.g. 10, to record them)"
        )
    return "the runs logged them at no common step (give them the same train.diagnostics_interval)"


def plot_fc2_by_layer(runs: list[RunEvents], steps: Sequence[int], path: str) -> None:
    """The paper's Fig. 3: average L1 norm of the FC2 weight gradient by layer, one panel per step
    of ``steps``, one line per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(steps), figsize=(5.5 * len(steps), 4.5), squeeze=False)
    for ax, step in zip(axes[0], steps, strict=True):
        for i, run in enumerate(runs):
            layers = run.by_layer("grads/fc2_l1")
            xs = [layer for layer, v in layers.items() if step in v]
            ax.plot(xs, [layers[layer][step] for layer in xs], "o-", color=f"C{i}", label=run.name)
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_yscale("log")
        ax.set_title(f"step {step}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("average |grad| of FC2 weight")
    axes[0][0].legend()
    fig.suptitle("FC2 weight gradient by layer (cf. NormFormer paper Fig. 3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def panel_steps(steps: Sequence[int]) -> list[int]:
    """Up to three diagnostics steps to show: the first, the middle and the last."""
    return sorted({steps[0], steps[len(steps) // 2], steps[-1]})


def plot_grad_l2(run: RunEvents, path: str) -> None:
    """One panel per operation: L2 gradient norm by layer over the logged steps."""
    plt = _plt()
    ops = run.ops("grads/l2")
    cols = 4
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, op in zip(axes.flat, ops, strict=False):
        layers = run.by_layer(f"grads/l2/{op}")
        for layer, values in layers.items():
            color = cmap(layer / max(1, len(layers) - 1))
            ax.plot(list(values), list(values.values()), color=color, lw=1, label=f"layer {layer}")
        ax.set_title(op)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"{run.name}: L2 gradient norm per operation (dark: first layer, light: last)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def histogram_stats(h: Any) -> tuple[float, float, float, float]:
    """(mean, std, min, max) of a TensorBoard ``HistogramValue``."""
    mean = h.sum / h.num if h.num else math.nan
    var = max(0.0, h.sum_squares / h.num - mean * mean) if h.num else math.nan
    return mean, math.sqrt(var), h.min, h.max


def plot_scales(run: RunEvents, path: str) -> int | None:
    """The paper's Fig. 4: each learned scale's distribution by layer at the last diagnostics step.
    Returns that step (None: the run logged no scale histograms, nothing written)."""
    ops = [op for op in run.ops("scales") if not op.endswith("_mean")]
    hist = {
        op: {
            int(LAYER_TAG.match(t).group(2)): v
            for t, v in run.histograms.items()
            if t.startswith(f"scales/{op}/")
        }
        for op in ops
    }
    steps = sorted({s for per_layer in hist.values() for v in per_layer.values() for s in v})
    if not steps:
        return None
    step = steps[-1]
    plt = _plt()
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        layers = sorted(layer for layer, v in hist[op].items() if step in v)
        stats = [histogram_stats(hist[op][layer][step]) for layer in layers]
        means = [s[0] for s in stats]
        ax.errorbar(layers, means, yerr=[s[1] for s in stats], fmt="o", capsize=3, label="mean ± std")
        ax.vlines(
            layers, [s[2] for s in stats], [s[3] for s in stats], color="gray", alpha=0.5, label="min–max"
        )
        ax.axhline(1.0, color="k", lw=0.5, ls=":")
        ax.set_title(op)
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("learned scale value")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{run.name}: learned scales by layer at step {step} (cf. NormFormer paper Fig. 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return step


def plot_runs(run_dirs: Sequence[str], output_dir: str, step: int | None = None) -> list[str]:
    """Write every figure for ``run_dirs`` into ``output_dir``; return the PNG paths written.

    Raises:
        FileNotFoundError: a run directory without TensorBoard events or ``scalars.json.gz``.
        ValueError: a damaged ``scalars.json.gz``; ``step`` is not a diagnostics step of every run.
    """
    runs = [RunEvents(d) for d in run_dirs]
    steps = common_diagnostics_steps(runs)
    if step is not None and step not in steps:
        raise ValueError(f"--step {step}: not a diagnostics step of every run; those are {steps}")
    os.makedirs(output_dir, exist_ok=True)
    written = [os.path.join(output_dir, "loss.png")]
    plot_loss(runs, written[0])
    if steps:
        path = os.path.join(output_dir, "grads_fc2_l1_by_layer.png")
        plot_fc2_by_layer(runs, panel_steps(steps) if step is None else [step], path)
        written.append(path)
    else:
        print(f"note: grads_fc2_l1_by_layer.png not written: {fc2_missing_reason(runs)}", file=sys.stderr)
    for run in runs:
        if run.ops("grads/l2"):
            path = os.path.join(output_dir, f"{run.name}_grads_l2.png")
            plot_grad_l2(run, path)
            written.append(path)
        path = os.path.join(output_dir, f"{run.name}_scales.png")
        if plot_scales(run, path) is not None:
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megaformer.tools.plot", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="megaformer run directories (output.dir)"
    )
    parser.add_argument("--output-dir", help="where the PNGs go (default: <first RUN_DIR>/plots)")
    parser.add_argument("--step", type=int, help="the one diagnostics step of the FC2-by-layer figure")
    args = parser.parse_args(argv)
    out = args.output_dir or os.path.join(args.run_dirs[0], "plots")
    try:
        written = plot_runs(args.run_dirs, out, args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if len(written) == 1:
        print(
            "note: no per-layer diagnostics in these runs; set train.diagnostics_interval > 0",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
