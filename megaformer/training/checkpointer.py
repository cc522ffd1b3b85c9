"""Checkpoints of a run: save, exact resume (same layout), and ``init_from`` (weights, any layout).

A checkpoint is DeepSpeed's ``checkpoints/global_stepN`` (module, optimizer, scheduler, our
``client_state``: step, consumed samples, the run config) plus every rank's generator states
(:mod:`megaformer.training.rng_state`), written before DeepSpeed writes the ``latest`` tag.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from megaformer.config import ConfigError, RunConfig, to_dict
from megaformer.parallel.rng import DropoutRNG
from megaformer.training.builders import Layout, log
from megaformer.training.rng_state import load_rng_state, save_rng_state


def resolve_resume(cfg: RunConfig, ckpt_dir: str) -> str | None:
    """The checkpoint directory to load from, or None to start fresh.

    ``none``: never. ``auto``: ``ckpt_dir`` if it has a ``latest`` tag. Otherwise a directory that
    must hold a ``latest`` tag.

    Raises:
        ConfigError: ``train.resume`` names a directory without a DeepSpeed checkpoint.
    """
    resume = cfg.train.resume
    if resume == "none":
        return None
    if resume == "auto":
        return ckpt_dir if os.path.isfile(os.path.join(ckpt_dir, "latest")) else None
    if not os.path.isfile(os.path.join(resume, "latest")):
        raise ConfigError(
            f"train.resume='{resume}': no DeepSpeed checkpoint there (no 'latest' file); "
            "use auto, none or a directory written by a previous run's checkpoints/."
        )
    return resume


class Checkpointer:
    """Saves and restores the run's state for one rank.

    Args:
        engine: the :class:`~megaformer.training.ds_adapter.Engine`.
        cfg: the run config (stored in every checkpoint; ``reshard`` and ``init_from`` read it).
        layout: this rank's layout.
        dropout_rng: the dropout generator states saved and restored with the checkpoint.
    """

    def __init__(self, engine: Any, cfg: RunConfig, layout: Layout, dropout_rng: DropoutRNG) -> None:
        self.engine = engine
        self.cfg = cfg
        self.layout = layout
        self.dropout_rng = dropout_rng
        self.ckpt_dir = os.path.join(cfg.output.dir, "checkpoints")

    def tag_dir(self, step: int) -> str:
        return os.path.join(self.ckpt_dir, f"global_step{step}")

    def save(self, step: int, extra: dict | None = None) -> None:
        """Write ``global_step{step}`` (every rank's generator states first, then DeepSpeed's files
        and its ``latest`` tag). ``extra`` joins the client state (e.g. tokens and device-seconds
        consumed, which a resumed run continues from)."""
        t = self.cfg.train
        client_state = {
            "step": step,
            "consumed_samples": step * t.global_batch_size,
            "config": to_dict(self.cfg),
            **(extra or {}),
        }
        lay = self.layout
        save_rng_state(self.tag_dir(step), lay.rank, lay.rng_layout(), self.dropout_rng, lay.device)
        self.engine.save(self.ckpt_dir, f"global_step{step}", client_state)
        log(lay, f"saved checkpoint {self.tag_dir(step)}")

    def resume(self, load_dir: str) -> tuple[int, dict]:
        """Load the checkpoint ``load_dir/latest`` names (same layout); return (step, client state).

        Raises:
            ConfigError: DeepSpeed could not load it.
            RuntimeError: an unreadable generator-state file (names it).
        """
        lay = self.layout
        # One tag for every rank, read once: `latest` may move on if another job still writes there.
        tag = [None]
        if lay.rank == 0:
            with open(os.path.join(load_dir, "latest"), encoding="utf-8") as f:
                tag[0] = f.read().strip()
        dist.broadcast_object_list(tag, src=0)
        path, client_state = self.engine.load(load_dir, tag[0])
        step = int(client_state["step"])
        log(lay, f"resumed from {path} at step {step}")
        tag_dir = os.path.join(load_dir, tag[0])
        restored, why = load_rng_state(tag_dir, lay.rank, lay.rng_layout(), self.dropout_rng, lay.device)
        if not restored:  # from any rank: rank 0's line below speaks for the count only
            print(f"[megaformer] rank {lay.rank}: {why}", flush=True)
        from megaformer.parallel.comm import all_reduce_ints

        count = all_reduce_ints([int(restored)])[0]
        log(lay, f"restored generator states on {count}/{lay.world_size} ranks")
        return step, client_state


def init_weights_from(model: torch.nn.Module, cfg: RunConfig, layout: Layout) -> int:
    """Load ``train.init_from``'s module weights (saved at any tp / pp / dp layout) into this rank's
    model (its TP slice of its stage); return the checkpoint's step.

    Raises:
        ConfigError: a checkpoint of another model configuration.
    """
    from megaformer.tools.reshard import consolidate, load_full, resolve_tag_dir

    tag_dir = resolve_tag_dir(cfg.train.init_from)
    # Only this rank's stage's parameters, memory-mapped: at 2.7B, 8 ranks of a node holding the
    # whole fp32 model each would need ~86 GB of host memory.
    full, saved, extra = consolidate(tag_dir, names={name for name, _ in model.named_parameters()})
    ours = to_dict(cfg)["model"]
    if saved["model"] != ours:
        diff = {k: (v, ours.get(k)) for k, v in saved["model"].items() if ours.get(k) != v}
        raise ConfigError(f"train.init_from='{cfg.train.init_from}': saved with another model config {diff}")
    load_full(model, full, cfg.model, layout.state.tp_rank, layout.state.tp_size)
    step = int(extra["step"] or 0)
    log(
        layout,
        f"initialised weights from {tag_dir} (saved at tp {extra['tp_size']} × pp {extra['pp_size']}, "
        f"step {step}); continuing at step {step} with a fresh optimizer (AdamW moments restart at zero)",
    )
    return step
