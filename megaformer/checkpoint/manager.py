"""Checkpoints of a run: save, exact resume (same layout), and ``init_from`` (weights, any layout).

The trainer talks to one object, :class:`CheckpointManager`: :meth:`~CheckpointManager.check_fresh_start`
before any process group (a fresh start into another run's directory, an ``init_from`` that leaves
nothing to train), :meth:`~CheckpointManager.prepare` for the :class:`ResumePlan` (where to resume
from, verified; or that the run is already complete), then :meth:`~CheckpointManager.save` and
:meth:`~CheckpointManager.resume` once the engine exists. The functions below are its parts, public
for the tools and tests.

A checkpoint is DeepSpeed's ``checkpoints/global_stepN`` (module, optimizer, scheduler, our
``client_state``: step, consumed samples, the run config) plus every rank's generator states
(:mod:`megaformer.checkpoint.rng_state`) and a ``manifest.json`` of every file's size and sha256.

The ``latest`` tag moves only when the checkpoint is whole (DeepSpeed's own ``latest``, which its
rank 0 writes without waiting for the other ranks' files, is switched off):

1. every rank writes its files and fsyncs them;
2. the ranks wait until all succeeded (an all-reduce on the communication device); a rank whose
   write fails (a full disk, a quota, a read-only file system) raises at once naming the cause, and
   the others' collectives fail with it or the launcher ends them: every rank stops, none waits;
3. the ranks hash the files between them, rank 0 writes the manifest durably, then ``latest``;
4. a last all-reduce: no rank goes on (deletes old checkpoints, exits) before ``latest`` moved.

A reader (resume, ``init_from``, ``reshard``, ``generate``) checks the files against the manifest
(:mod:`megaformer.checkpoint.integrity`) and names a damaged file and the newest intact ``global_stepN``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megaformer.checkpoint import integrity
from megaformer.checkpoint.reshard import consolidate, load_full, resolve_tag_dir
from megaformer.checkpoint.resume_rules import (
    check_init_from_steps,
    check_resume_config,
    refuse_other_model,
    saved_config,
)
from megaformer.checkpoint.rng_state import load_rng_state, save_rng_state
from megaformer.checkpoint.storage import write_failure
from megaformer.config import ConfigError, RunConfig, to_dict
from megaformer.model import PARAM_ORDERS
from megaformer.parallel.comm import all_reduce_ints
from megaformer.parallel.layout import Layout, log
from megaformer.parallel.rng import DropoutRNG

ExplainExtension = Callable[[RunConfig, int, int], str]
"""``(cfg, step, old_steps) -> log line``: an extension's learning-rate rule (the schedule is training's)."""


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


def finished_run(
    cfg: RunConfig, explain_extension: ExplainExtension | None = None
) -> tuple[str, dict | None] | None:
    """Whether this launch would continue a run that is already complete: (message, its summary
    or None), or None to go on.

    Complete: ``train.resume`` finds a checkpoint whose step is ``train.steps``; or, for the run's
    own checkpoints with ``train.steps`` as saved (no extension), one whose step is where the
    run's ``summary.json`` says it ended (a budget's length, a divergence stop; not a stop for a
    signal or a time limit). Nothing is left to train, so such a launch (the same command again, a
    Slurm requeue of a finished job) must leave the run's summary, checkpoints and TensorBoard
    events as they are: the trainer asks once the checkpoint is verified (a damaged one is still
    an error) and exits 0 before building the model or writing anything. Reads files only, with
    the same answer on every process. The config is still compared with the saved one
    (:mod:`.resume_rules`): a changed key is refused as for any resume.

    Raises:
        ConfigError: a key that may not change differs from the saved config; ``latest`` is
            empty or names no directory (:class:`~megaformer.checkpoint.integrity.CheckpointError`).
    """
    ckpt_dir = os.path.join(cfg.output.dir, "checkpoints")
    load_dir = resolve_resume(cfg, ckpt_dir)
    if load_dir is None:
        return None
    tag_dir = integrity.resolve_latest(load_dir)
    name = os.path.basename(os.path.normpath(tag_dir)).removeprefix("global_step")
    if not name.isdigit():
        return None  # not a tag this trainer writes: the resume path reports what it finds
    step = int(name)
    summary_path = os.path.join(cfg.output.dir, "summary.json")
    summary = None
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)  # NaN accepted: summaries written before they were strict JSON
    except (OSError, ValueError):
        pass
    saved = saved_config(tag_dir)
    own = os.path.abspath(load_dir) == os.path.abspath(ckpt_dir)
    ended_here = (
        own
        and isinstance(summary, dict)
        and summary.get("steps") == step
        and summary.get("stopped") is None
        and saved is not None
        and saved.get("train", {}).get("steps") == cfg.train.steps
    )
    if step != cfg.train.steps and not ended_here:
        return None
    if saved is not None:
        check_resume_config(saved, cfg, step, tag_dir, explain_extension)
    where = (
        f"its summary: {os.path.abspath(summary_path)}"
        if isinstance(summary, dict)
        else f"no summary.json in {os.path.abspath(cfg.output.dir)} (the run ended after its last "
        "checkpoint, before writing it)"
    )
    end = (
        f"train.steps={step}"
        if step == cfg.train.steps
        else f"step {step}, where its summary says it ended (train.steps={cfg.train.steps})"
    )
    message = (
        f"run already complete: its checkpoint {os.path.abspath(tag_dir)} is at {end}; nothing to "
        f"train, nothing written ({where}). To train further: a higher train.steps with "
        "train.extend_steps=true"
    )
    return message, summary if isinstance(summary, dict) else None


def holds_a_run(out_dir: str) -> list[str]:
    """What in ``out_dir`` belongs to an earlier run: a ``latest`` tag, ``global_stepN``
    directories, TensorBoard event files ([] for a new or empty directory)."""
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    found = [os.path.join(ckpt_dir, "latest")] if os.path.exists(os.path.join(ckpt_dir, "latest")) else []
    found += [os.path.join(ckpt_dir, tag) for _, tag in integrity.step_dirs(ckpt_dir)]
    tb = os.path.join(out_dir, "tensorboard")
    if os.path.isdir(tb) and any(n.startswith("events.out.tfevents") for n in os.listdir(tb)):
        found.append(tb)
    return found


def check_output_dir(cfg: RunConfig) -> None:
    """Refuse a fresh start (``train.resume=none``) in an ``output.dir`` that holds a run, unless
    ``output.overwrite=true`` (a resume, ``auto`` included, continues the run there instead; a run
    killed before its first checkpoint restarts there from step 0 under ``auto``).

    Raises:
        ConfigError: naming what is there and the three ways on.
    """
    if cfg.train.resume != "none" or cfg.output.overwrite:
        return
    found = holds_a_run(cfg.output.dir)
    if found:
        raise ConfigError(
            f"output.dir='{cfg.output.dir}' holds another run ({', '.join(found[:3])}): a fresh start "
            "would mix its checkpoints and TensorBoard events with this one's; continue it with "
            "train.resume=auto, choose another output.dir, or set output.overwrite=true to delete them"
        )


def clear_output_dir(cfg: RunConfig, layout: Layout) -> None:
    """``output.overwrite=true`` on a fresh start: rank 0 deletes the earlier run's checkpoints and
    TensorBoard events (logged), then every rank goes on (collectives).

    Every rank looks before any deletes, and the answer is shared: a rank that looked after rank 0
    had deleted would find nothing, skip the collective below, and the next one would pair
    different operations (a hang, seen with a run that left only TensorBoard events)."""
    if not cfg.output.overwrite:
        return
    (holders,) = all_reduce_ints([1 if holds_a_run(cfg.output.dir) else 0])
    if not holders:
        return
    if layout.is_main:
        for name in ("checkpoints", "tensorboard"):
            shutil.rmtree(os.path.join(cfg.output.dir, name), ignore_errors=True)
        log(
            layout,
            f"output.overwrite=true: deleted the earlier run's checkpoints and TensorBoard events "
            f"in {cfg.output.dir}",
        )
    all_reduce_ints([0])


@dataclass(frozen=True)
class ResumePlan:
    """What a launch does with the checkpoints it finds (:meth:`CheckpointManager.prepare`).

    Attributes:
        load_dir: the checkpoints directory whose ``latest`` the run resumes from (verified against
            its manifest, its config compared with this run's), or None for a fresh start.
        finished: for a run that is already complete, ``(message, its summary or None)``: nothing is
            trained or written (:func:`finished_run`); else None.
    """

    load_dir: str | None
    finished: tuple[str, dict | None] | None = None


class CheckpointManager:
    """Every checkpoint concern of one rank's run behind one object: the checks before the process
    groups start, the resume plan, saving (atomically, with a manifest) and resuming.

    Args:
        cfg: the run config (stored in every checkpoint; ``reshard`` and ``init_from`` read it).
        layout: this rank's layout.
        explain_extension: states an extension's learning-rate rule in the log (the trainer passes
            :func:`megaformer.training.schedule.extension_rule`).

    Order: :meth:`check_fresh_start` (a static check, before :func:`build_layout`), :meth:`prepare`,
    :meth:`attach` (once the engine exists), then :meth:`resume` and :meth:`save`.
    """

    def __init__(
        self, cfg: RunConfig, layout: Layout, explain_extension: ExplainExtension | None = None
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.explain_extension = explain_extension
        self.ckpt_dir = os.path.join(cfg.output.dir, "checkpoints")
        self.engine: Any = None
        self.dropout_rng: DropoutRNG | None = None
        self.param_order = "aligned"  # the optimizer's (build_optimizer), named in each manifest

    @staticmethod
    def check_fresh_start(cfg: RunConfig) -> None:
        """The checks that need no process group: a fresh start into another run's directory
        (:func:`check_output_dir`) and an ``init_from`` that leaves nothing to train.

        Raises:
            ConfigError: naming the directory or the step, and the fix.
        """
        check_output_dir(cfg)
        check_init_from_steps(cfg)

    def prepare(self) -> ResumePlan:
        """Decide where the run starts (collective: every rank calls it). A fresh start under
        ``output.overwrite=true`` clears the earlier run; the checkpoint to load (resume or
        ``init_from``) is verified against its manifest before anything is built; a run already
        complete is recognised before anything is written.

        Raises:
            ConfigError: ``train.resume`` without a checkpoint, a key that may not change.
            CheckpointError: damaged files, naming them and the newest intact checkpoint.
        """
        load_dir = resolve_resume(self.cfg, self.ckpt_dir)
        if load_dir is None:
            clear_output_dir(self.cfg, self.layout)
        verify_before_load(self.cfg, load_dir, self.layout, self.explain_extension)
        finished = finished_run(self.cfg, self.explain_extension) if load_dir is not None else None
        return ResumePlan(load_dir, finished)

    def attach(self, engine: Any, dropout_rng: DropoutRNG, param_order: str = "aligned") -> None:
        """Give the manager what it saves: the :class:`~megaformer.training.ds_adapter.Engine`
        (its ``save``/``load``), the dropout generator states and the optimizer's parameter order."""
        self.engine = engine
        self.dropout_rng = dropout_rng
        self.param_order = param_order

    def tag_dir(self, step: int) -> str:
        return os.path.join(self.ckpt_dir, f"global_step{step}")

    def save(self, step: int, extra: dict | None = None) -> None:
        """Write ``global_step{step}`` on every rank, then its manifest, then ``latest`` (see the
        module docstring). ``extra`` joins the client state (e.g. tokens and device-seconds
        consumed, which a resumed run continues from).

        A rank whose write fails raises at once, with no further collective: DeepSpeed's own
        collectives inside the save cannot be matched by a rank that left it half way, so a rank
        that waited for it would wait for ever. The other ranks' next collective then fails (gloo:
        the peer closed its connections) or the launcher ends them when the failed rank exits.

        Raises:
            CheckpointError: this rank could not write its files (the cause named: no space left
                on device, a quota, a read-only file system; with the path, the bytes written and
                the free space), or another rank stopped during the save. ``latest`` still names
                the previous checkpoint.
        """
        t, lay = self.cfg.train, self.layout
        tag, tag_dir = f"global_step{step}", self.tag_dir(step)
        client_state = {
            "step": step,
            "consumed_samples": step * t.global_batch_size,
            "config": to_dict(self.cfg),
            **(extra or {}),
        }
        if lay.is_main and os.path.isdir(tag_dir):
            # A leftover of a save that was interrupted (`latest` never named it): its files must
            # not join this checkpoint's manifest.
            shutil.rmtree(tag_dir, ignore_errors=True)
        all_reduce_ints([0])  # no rank writes before the leftover is gone
        try:
            save_rng_state(tag_dir, lay.rank, lay.rng_layout(), self.dropout_rng, lay.device)
            self.engine.save(self.ckpt_dir, tag, client_state)
            for rel in integrity.checkpoint_files(tag_dir):  # ours among them: flushed to disk
                integrity.fsync_path(os.path.join(tag_dir, rel))
            all_reduce_ints([0])  # the barrier: every rank's files written
            count = self._commit(tag_dir, tag, step, client_state["config"])
            all_reduce_ints([0])  # nobody goes on before `latest` names the new checkpoint
        except (OSError, RuntimeError) as e:  # torch.save's "unexpected pos" on a full disk
            raise self._failed(tag_dir, e) from None
        log(lay, f"saved checkpoint {tag_dir} ({count} files, manifest and latest written)")

    def _commit(self, tag_dir: str, tag: str, step: int, config: dict) -> int:
        """Hash the files (the ranks share them), then rank 0 writes the manifest and moves
        ``latest``; return the number of files."""
        lay = self.layout
        rels = integrity.checkpoint_files(tag_dir)
        mine = integrity.describe_files(tag_dir, rels[lay.rank :: lay.world_size])
        gathered: list[Any] = [None] * lay.world_size
        dist.all_gather_object(gathered, mine)
        if lay.is_main:
            files = {k: v for part in gathered for k, v in part.items()}
            order = {"optimizer_param_order": self.param_order}
            integrity.write_manifest(tag_dir, files, step, config, extra=order)
            integrity.write_latest(self.ckpt_dir, tag)
            self._prune(tag)
        return len(rels)

    def _failed(self, tag_dir: str, error: BaseException) -> integrity.CheckpointError:
        """The error of a save that failed on this rank (or that another rank left), its cause
        named (:func:`~.storage.write_failure`). Alone, the rank removes the partial directory;
        with others it leaves it, as they may still be writing into it."""
        why, known = write_failure(tag_dir, error)
        try:
            with open(os.path.join(self.ckpt_dir, "latest"), encoding="utf-8") as f:
                named = f.read().strip()
        except OSError:
            named = ""
        kept = f"'latest' still names {named}" if named else "No checkpoint was completed ('latest' absent)"
        if named == os.path.basename(tag_dir):  # a peer lost after rank 0 moved `latest`
            kept, left = "The checkpoint itself is complete: 'latest' names it", "nothing to remove"
        elif self.layout.world_size == 1:
            shutil.rmtree(tag_dir, ignore_errors=True)
            left = "the partial directory was removed"
        else:
            left = (
                f"the partial {tag_dir} has no manifest and 'latest' does not name it: delete it to "
                "reclaim its space (a resumed run replaces it when it saves that step again)"
            )
        hint = (
            ""
            if known
            else ". A rank that reports a lost connection (Connection closed by peer) stopped because "
            "another rank failed: that rank's error names the cause"
        )
        return integrity.CheckpointError(
            f"rank {self.layout.rank}: saving {tag_dir} failed: {why}. {kept}; {left}{hint}"
        )

    def _prune(self, keep_tag: str) -> None:
        """Delete all but the newest ``train.keep_last_checkpoints`` checkpoints (rank 0), never
        the one ``latest`` names (``keep_tag``); 0 keeps every checkpoint."""
        keep = self.cfg.train.keep_last_checkpoints
        if keep <= 0:
            return
        newest = int(keep_tag.removeprefix("global_step"))
        # Only checkpoints up to this one: later ones belong to a run resumed from an earlier tag.
        older = [tag for step, tag in integrity.step_dirs(self.ckpt_dir) if step <= newest]
        for tag in older[keep:]:
            if tag != keep_tag:
                shutil.rmtree(os.path.join(self.ckpt_dir, tag), ignore_errors=True)
                log(self.layout, f"removed checkpoint {tag} (train.keep_last_checkpoints={keep})")

    def resume(self, load_dir: str) -> tuple[int, dict]:
        """Load the checkpoint ``load_dir/latest`` names (same layout) into the attached engine and
        generator states; return (step, client state).

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
        restored, why = load_rng_state(
            tag_dir, lay.rank, lay.rng_layout(), self.dropout_rng, lay.device, step=step
        )
        if not restored:  # from any rank: rank 0's line below speaks for the count only
            print(f"[megaformer] rank {lay.rank}: {why}", flush=True)
        count = all_reduce_ints([int(restored)])[0]
        log(lay, f"restored generator states on {count}/{lay.world_size} ranks")
        return step, client_state


def init_weights_from(model: torch.nn.Module, cfg: RunConfig, layout: Layout) -> int:
    """Load ``train.init_from``'s module weights (saved at any tp / pp / dp layout) into this rank's
    model (its TP slice of its stage); return the checkpoint's step.

    Raises:
        ConfigError: a checkpoint of another model configuration.
    """
    tag_dir = resolve_tag_dir(cfg.train.init_from)
    # Only this rank's stage's parameters, memory-mapped: at 2.7B, 8 ranks of a node holding the
    # whole fp32 model each would need ~86 GB of host memory.
    full, saved, extra = consolidate(
        tag_dir,
        names={name for name, _ in model.named_parameters()},
        trust_code=cfg.train.trust_checkpoint_code,
    )
    refuse_other_model(saved, cfg)
    step = int(extra["step"] or 0)
    if step >= cfg.train.steps:
        raise ConfigError(
            f"train.init_from='{cfg.train.init_from}' was saved at step {step}, and train.steps="
            f"{cfg.train.steps} leaves nothing to train: set train.steps above {step}"
        )
    load_full(model, full, cfg.model, layout.state.tp_rank, layout.state.tp_size)
    log(
        layout,
        f"initialised weights from {tag_dir} (saved at tp {extra['tp_size']} × pp {extra['pp_size']}, "
        f"step {step}); continuing at step {step} with a fresh optimizer (AdamW moments restart at zero)",
    )
    return step


def verify_before_load(
    cfg: RunConfig,
    load_dir: str | None,
    layout: Layout,
    explain_extension: ExplainExtension | None = None,
) -> None:
    """Verify the checkpoint a run is about to load (resume's ``latest``, else ``train.init_from``)
    against its manifest, before the model is built (every rank; see :func:`verify_collectively`):
    for a resume every file but a missing generator-state file; for ``init_from`` the weights."""
    if load_dir is not None:
        tag_dir = integrity.resolve_latest(load_dir)
        verify_collectively(tag_dir, layout, integrity.NEEDS_RESUME)
        _check_config(cfg, tag_dir, layout, explain_extension)
    elif cfg.train.init_from:
        verify_collectively(resolve_tag_dir(cfg.train.init_from), layout, integrity.NEEDS_WEIGHTS)


def saved_param_order(tag_dir: str) -> str:
    """The order of the optimizer's parameters that ``tag_dir`` was saved with (its manifest's
    ``optimizer_param_order``; ``"declared"`` for a checkpoint written before the key existed).

    A resume must build its optimizer in this order: DeepSpeed saves its fp32 master weights and
    Adam moments as flat partitions in the order of the groups' parameters and loads them back by
    position, so another order would hand each parameter another one's state without an error.

    Raises:
        CheckpointError: an unreadable manifest, or an order this version does not know.
    """
    body = integrity.read_manifest(tag_dir) or {}
    order = body.get("optimizer_param_order", "declared")
    if order not in PARAM_ORDERS:
        raise integrity.CheckpointError(
            f"{tag_dir}/{integrity.MANIFEST}: optimizer_param_order {order!r} is not one of "
            f"{', '.join(PARAM_ORDERS)}; it was written by a newer megaformer: resume with that version"
        )
    return order


def _check_config(
    cfg: RunConfig, tag_dir: str, layout: Layout, explain_extension: ExplainExtension | None
) -> None:
    """Compare the checkpoint's saved config with this run's (:mod:`.resume_rules`); log the
    allowed changes and an extension's learning-rate rule."""
    saved = saved_config(tag_dir)
    if saved is None:
        log(layout, f"{tag_dir}: no saved config to compare with this run's")
        return
    step = int(os.path.basename(os.path.normpath(tag_dir)).removeprefix("global_step") or 0)
    for line in check_resume_config(saved, cfg, step, tag_dir, explain_extension):
        log(layout, line)


def verify_collectively(tag_dir: str, layout: Layout, needs: str = integrity.NEEDS_ALL) -> None:
    """Check the files of ``tag_dir`` the run reads (``needs``, see
    :func:`~megaformer.checkpoint.integrity.verify`) against its manifest, the ranks sharing the
    hashing; rank 0 names a damaged file the run does not read in a warning.

    Raises:
        CheckpointError: on every rank, naming the damaged files and the newest intact checkpoint.
    """
    found = integrity.file_problems(tag_dir, (layout.rank, layout.world_size), needs)
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, found)
    # Presence and sizes are checked on every rank: each such line comes once per rank.
    found = list(dict.fromkeys(tuple(item) for part in gathered for item in part))
    fatal, warnings = integrity.triage(found, needs)
    if fatal:
        raise integrity.damaged(tag_dir, fatal)
    if layout.is_main:
        integrity.warn(tag_dir, warnings)
    if integrity.read_manifest(tag_dir) is None:
        log(layout, f"{tag_dir} has no manifest (written before checksums existed): not verified")
    else:
        log(layout, f"verified {tag_dir} against its manifest (sizes and sha256)")
