"""The training run: preflight, parts, loop, summary.

One optimizer step = ``global_batch_size`` samples: each data-parallel rank runs
``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` samples through the DeepSpeed
engine, which averages gradients over the data-parallel group, clips, scales (fp16) and steps.

The world is a ``tp × pp × dp`` grid (:class:`~megaformer.parallel.state.ParallelState`): the ranks
of one TP group read the same samples and hold slices of one model; data is sharded over the
data-parallel rank only. At ``pp_size`` = 1 the model is :class:`~megaformer.model.NormFormerLM` in
the plain engine (the grid is DeepSpeed's ``mpu``); with ``pp_size`` > 1 it is a DeepSpeed
``PipelineModule`` cut from the same layer plan, trained by the pipeline engine (one
``train_batch`` per step, the gradient-accumulation steps being the pipeline's micro-batches).

Parts (each its own module, testable alone): :mod:`.preflight` (checks before any process group),
:mod:`.builders` (layout, data, model, optimizer), :mod:`.ds_adapter` (DeepSpeed),
:mod:`megaformer.checkpoint` (its manager saves and resumes),
:mod:`.metrics`, and here the evaluator and the loop. Losses and norms stay on the device; they are
read to the host once per log interval (:class:`~.metrics.DeferredScalars`).

The samples of step ``s`` are fixed by ``(seed, s)``: on resume the loop continues with exactly the
samples it would have seen.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from data_tools.files import atomic_write_json
from data_tools.indexed_dataset import opened_once
from megaformer.checkpoint import integrity as ckpt_integrity
from megaformer.checkpoint.manager import CheckpointManager, init_weights_from, saved_param_order
from megaformer.config import RunConfig, to_dict
from megaformer.data.loader import train_loader, valid_loader
from megaformer.parallel.layout import Layout, log
from megaformer.parallel.rng import DropoutRNG
from megaformer.training.builders import (
    Data,
    build_data,
    build_layout,
    build_model,
    build_optimizer,
    count_parameters_global,
)
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.diagnostics import LayerDiagnostics, StepHealth, param_norm_squared
from megaformer.training.ds_adapter import LossScaleExhaustedError, initialize
from megaformer.training.flops import ComputeMeter, device_peak_flops, model_flops_per_token
from megaformer.training.metrics import (
    DeferredScalars,
    MetricsWriter,
    StepTimer,
    format_step_line,
    peak_memory_gib,
)
from megaformer.training.preflight import run_preflight
from megaformer.training.run_length import RunLength
from megaformer.training.schedule import Schedule, extension_rule
from megaformer.training.stopping import StopCheck
from megaformer.training.summary_file import null_non_finite
from megaformer.training.tracking import WandbTracker, provenance


def to_device(batches: Iterable, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, labels)`` moved to ``device`` (non-blocking: the loader pins them on GPU)."""
    for tokens, labels in batches:
        yield tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def safe_exp(x: float) -> float:
    """``exp(x)``, or ``inf`` where it overflows or ``x`` is not finite (a diverged loss)."""
    return math.exp(x) if x < 700 else math.inf


class Evaluator:
    """Validation loss over the first ``batches × global_batch_size`` held-out samples.

    The same samples, cut into the same micro-batches, at any data-parallel size: each rank reads
    its share and the per-micro-batch means are averaged over all of them.
    """

    def __init__(
        self,
        engine: Any,
        cfg: RunConfig,
        layout: Layout,
        data: Data,
        samples: Any = None,
        batches: int | None = None,
    ) -> None:
        """``samples``: what to evaluate (default ``data.valid``; the test set for the test loss).
        ``batches``: global batches per evaluation (default ``train.eval_batches``; 0: every full
        global batch of ``samples``)."""
        t = cfg.train
        samples = data.valid if samples is None else samples
        batches = t.eval_batches if batches is None else batches
        if batches == 0:
            batches = len(samples) // t.global_batch_size
        self.engine = engine
        self.device = layout.device
        self.batches = batches
        self.tokens = batches * t.global_batch_size * cfg.model.seq_len
        self.micro_batches = batches * engine.gas
        self.loader = valid_loader(
            samples,
            eval_batches=batches,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            dp_rank=layout.dp_rank,
            dp_size=layout.dp_size,
            num_workers=cfg.data.num_workers,
            pin_memory=layout.device.type == "cuda",
            objective=cfg.model.objective,
        )

    def __call__(self) -> torch.Tensor:
        """Mean validation loss (nats/token), a 0-dim device tensor, the same on every rank."""
        return self.engine.eval_loss(to_device(self.loader, self.device), self.micro_batches)


def train_batches(
    cfg: RunConfig, layout: Layout, data: Data, start_step: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches from ``start_step`` on, on the layout's device: what
    the training loop feeds :meth:`~.ds_adapter.Engine.train_step` (also the step-time
    calibration's, :mod:`megaformer.experiments.step_timing`)."""
    t = cfg.train
    loader = train_loader(
        data.train,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp_size,
        start_step=start_step,
        end_step=t.steps,  # the most a budget may choose: the loader is lazy, the rest unread
        num_workers=cfg.data.num_workers,
        pin_memory=layout.device.type == "cuda",
        objective=cfg.model.objective,
    )
    return to_device(loader, layout.device)


class TrainLoop:
    """Steps ``start_step .. total - 1``: train, log, evaluate, save. Where the run ends is the
    :class:`~.run_length.RunLength` policy's (``train.steps``, a budget's length, a time limit, a
    signal), which the loop asks after every step."""

    def __init__(
        self,
        engine: Any,
        cfg: RunConfig,
        layout: Layout,
        data: Data,
        checkpoints: Any,
        start_step: int,
        compute: Any,
        schedule: Any,
        client_state: dict,
        batches: Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]] | None = None,
        stop: StopCheck | Callable[[], str | None] | None = None,
    ) -> None:
        """``batches``: the batch source, ``start_step -> iterator of micro-batches`` on the device
        (default :func:`train_batches`); the fake-CUDA dry run passes one that marks the data phase.
        ``stop``: the run's signal and time-limit check (made at start-up), given to the policy."""
        self.engine, self.cfg, self.layout, self.data = engine, cfg, layout, data
        self.batch_source = batches or (lambda start: train_batches(cfg, layout, data, start))
        self.checkpoints = checkpoints
        self.start_step = start_step
        self.compute = compute  # a flops.ComputeMeter: tokens, device-hours, TFLOP/s, MFU
        self.schedule = schedule  # maps a step to its learning rate
        self.length = RunLength(cfg, layout, schedule, start_step, client_state, stop)  # when to stop
        self.evaluate = Evaluator(engine, cfg, layout, data)
        self.evaluate_test = None if data.test is None else Evaluator(engine, cfg, layout, data, data.test)
        self.test_loss = math.nan
        # The final validation on more of the held-out set (train.final_eval_batches), after the
        # last step's regular one; not charged to a budget (it measures, see the key's doc).
        final = cfg.train.final_eval_batches
        self.evaluate_final = None
        if final != -1:
            self.evaluate_final = Evaluator(engine, cfg, layout, data, batches=final)
            if self.evaluate_final.batches == self.evaluate.batches:
                self.evaluate_final = None  # the same samples: the regular one is the final one
        self.final_loss = math.nan  # that validation's loss, when it ran
        self.sampled_loss = math.nan  # the regular validation's at the last step, beside it
        self.tb_dir = os.path.join(cfg.output.dir, "tensorboard")
        # purge_step: TensorBoard hides the events a killed run wrote after the step this run starts
        # from (the checkpoint's own step keeps its scalars; a restart from scratch purges them all).
        self.writer = MetricsWriter(
            self.tb_dir,
            enabled=layout.is_main,
            hparams=to_dict(cfg),
            purge_step=start_step + 1,
            tracker=_wandb_tracker(cfg, layout),
        )
        self.metrics = DeferredScalars(self.writer)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.step_times: list[float] = []
        self.valid_loss = math.nan
        self.paused = 0.0  # seconds spent in evaluations and checkpoints
        self.stopped: str | None = None  # why the run stopped before its end (signal, time limit)
        self.eval_seconds: list[float] = []  # wall-clock of each validation (for calibrations)
        self.last_step = start_step
        self._init_diagnostics(int(client_state.get("nonfinite_steps", 0)))

    def _init_diagnostics(self, nonfinite_steps: int) -> None:
        """Run health (non-finite and skipped steps, the divergence stop; a resumed run continues
        its count of ``nonfinite_steps``) and, every ``train.diagnostics_interval`` steps, per-layer
        gradient norms and learned scales (:mod:`.diagnostics`)."""
        t, engine = self.cfg.train, self.engine
        self.health = StepHealth(engine, self.layout.device, t.precision == "fp16", t.divergence_factor)
        self.health.count += nonfinite_steps
        self.health.reported = nonfinite_steps
        self.diverged: dict[str, float] = {}  # diverged_at_step / diverged_at_lr once it happens
        self.diagnostics = None
        self._diagnose_now = False
        if t.diagnostics_interval > 0:
            self.diagnostics = LayerDiagnostics(
                engine.module, self.cfg.model, self.layout.state, engine.loss_scale
            )
            engine.before_optimizer_step(self._before_optimizer_step)

    def _before_optimizer_step(self) -> None:
        # Gradients are complete here and not yet clipped, stepped or zeroed (see ds_adapter).
        if self._diagnose_now:
            self.diagnostics.collect_grads()

    def _step_scalars(self, done: int, loss: Any, lr: float, step_time: float) -> dict[str, Any]:
        """Scalars of the step just taken (device tensors stay on the device)."""
        grad_norm = self.engine.grad_norm()
        values = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/loss_scale": self.engine.loss_scale(),
            "train/tokens_per_s": self.tokens_per_step / step_time,
            "train/step_time_s": step_time,
            "train/param_norm": param_norm_squared(self.engine.module, self.layout.state).sqrt(),
            "train/peak_memory_gib": peak_memory_gib(self.layout.device),
            **self.health.step(loss, grad_norm),
            **self.compute.step(self.tokens_per_step, step_time),
        }
        if self.diagnostics is not None and self._diagnose_now:
            values.update(self.diagnostics.grad_scalars())
            values.update(self.diagnostics.scale_means())
            self.writer.histograms(done, self.diagnostics.scale_histograms())
        return values

    @property
    def total(self) -> int:
        """The run's last step, as the policy has it now (:attr:`.run_length.RunLength.total`)."""
        return self.length.total

    def run(self, resumed: bool) -> float:
        """Train from ``start_step`` until the run-length policy ends the run (its length reached,
        a budget spent, a signal, the time limit); save there; return the wall-clock seconds."""
        t, start_step = self.cfg.train, self.start_step
        self.length.begin(start_step, lambda: self.compute.device_seconds, self._ahead_seconds)
        # The schedule is final here (an extension's new length, a budget's decision): a resumed
        # optimizer still holds the rate the saved run's schedule gave its next update.
        self.engine.apply_schedule()
        batches = self.batch_source(start_step)
        timer, started = StepTimer(), time.perf_counter()
        last_saved = start_step if resumed else -1
        step = start_step
        while step < self.total:
            # The optimizer's own lr, read before the update uses it: after an fp16 overflow
            # DeepSpeed skips the scheduler's step too, so it lags the step counter.
            lr = self.engine.lr()
            interval = t.diagnostics_interval
            self._diagnose_now = interval > 0 and (step + 1) % interval == 0
            loss = self._train_step(batches, step, lr)
            if loss is None:  # fp16 gave up: the run ends at the last completed step
                self._log_and_evaluate(step, start_step)
                break
            step_time = timer.lap()
            self.step_times.append(step_time)
            done = step = step + 1
            self.metrics.add(done, self._step_scalars(done, loss, lr, step_time))
            if self.health.diverged(loss):
                self._stop_diverged(done, lr, loss)
            if self.length.wants_timing(done, loss.item, self.paused):
                self._decide_budget(done)
            self._log_and_evaluate(done, start_step)
            if t.save_interval and done % t.save_interval == 0 and done < self.total:
                self._paused(self.checkpoints.save, done, self._client_extra())
                last_saved = done
            timer.lap()  # do not charge logging, evaluation and checkpoints to the next step
            verdict = self.length.after_step(done, self.compute.device_hours)
            if verdict.stop and not verdict.preempted and done % t.eval_interval != 0:
                self._validate(done, done)  # a spent budget: the run ends complete, evaluated here
            if verdict.preempted:
                self.stopped = verdict.reason
                log(self.layout, f"stopping at step {step}/{self.total}: {self.stopped}; saving a checkpoint")
                break
        self.last_step = step
        if self.evaluate_final is not None and not self.stopped and step == self.total:
            self._validate_final(step)
        if self.evaluate_test is not None and not self.stopped:  # once, after the last step (Megatron's)
            self.test_loss = float(self._paused(self.evaluate_test))
            ppl = safe_exp(self.test_loss)
            self.writer.scalars(step, {"test/loss": self.test_loss, "test/ppl": ppl})
            log(self.layout, f"step {step} | test loss {self.test_loss:.4f} | test ppl {ppl:.2f}")
        if last_saved != step:
            self.metrics.flush()  # every step's scalars are written before the checkpoint is
            self.checkpoints.save(step, self._client_extra())
        self.writer.close()
        return time.perf_counter() - started

    def _train_step(self, batches: Iterator, step: int, lr: float) -> torch.Tensor | None:
        """One step; None when fp16's loss scaler gave up at its minimum scale (the run diverged:
        recorded, the loop ends at ``step``, the last completed one)."""
        try:
            return self.engine.train_step(batches)
        except LossScaleExhaustedError as e:
            self.diverged = {"diverged_at_step": step + 1, "diverged_at_lr": lr}
            self.length.end_at(step)
            log(self.layout, f"diverged at step {step + 1}, lr {lr:.4g}: {e}; stopping after step {step}")
            return None

    def _stop_diverged(self, done: int, lr: float, loss: Any) -> None:
        """End the run at step ``done`` (evaluated, saved, summarised), for the stability test."""
        self.diverged = {"diverged_at_step": done, "diverged_at_lr": lr}
        self.length.end_at(done)  # the loop's last step: evaluation and save follow
        log(
            self.layout,
            f"diverged at step {done}, lr {lr:.4g}: training loss {float(loss):.4g} (non-finite, or above "
            f"train.divergence_factor={self.cfg.train.divergence_factor:g} × its running minimum "
            f"{self.health.detector.running_min:.4f}); stopping, saving, and recording it in summary.json",
        )

    def _paused(self, fn: Any, *args: Any) -> Any:
        """Run an evaluation or a save, adding its time to :attr:`paused`."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.paused += time.perf_counter() - t0

    def _decide_budget(self, done: int) -> None:
        """Time one evaluation, fix the run's length, end the schedule there (see :mod:`.budget`)."""
        t0 = time.perf_counter()
        self.valid_loss = float(self._paused(self.evaluate))
        eval_seconds = time.perf_counter() - t0
        self.writer.scalars(done, {"valid/loss": self.valid_loss, "valid/ppl": safe_exp(self.valid_loss)})
        self.length.decide(done, self.compute.device_seconds / self.layout.world_size, eval_seconds)

    def _ahead_seconds(self) -> float:
        """Wall-clock of one more step and the final evaluation: the recent steps' median and the
        last evaluation's time (the calibrated one before the first evaluation)."""
        step = float(np.median(self.step_times[-20:])) if self.step_times else 0.0
        if self.eval_seconds:
            return step + self.eval_seconds[-1]
        return step + self.length.calibrated_eval_seconds()

    def _client_extra(self) -> dict[str, float]:
        """What a resumed run continues from (saved in the checkpoint's client state): tokens,
        device-seconds, non-finite steps, and the budget's decision once taken."""
        extra = {
            "tokens": self.compute.tokens,
            "device_seconds": self.compute.device_seconds,
            "nonfinite_steps": int(self.health.count.item()),  # at a save: one host read
        }
        return extra | self.length.state_dict()

    def _log_and_evaluate(self, done: int, start_step: int) -> None:
        t, total = self.cfg.train, self.total
        evaluate = done % t.eval_interval == 0 or done == total
        if done % t.log_interval == 0 or done == total or done == start_step + 1 or evaluate:
            values = self.metrics.flush()  # the one read of the device per log interval
            if done % t.log_interval == 0 or done == total or done == start_step + 1:
                recent = self.step_times[-t.log_interval :]
                eta = (total - done) * float(np.median(recent)) if recent else None
                log(self.layout, format_step_line(done, total, values, eta))
            warning = self.health.announce(values)
            if warning is not None:
                log(self.layout, f"step {done}: {warning}")
        if evaluate:
            self._validate(done, total)

    def _validate_final(self, step: int) -> None:
        """The final validation on ``train.final_eval_batches`` of the held-out set, after the
        regular one of the last step: ``valid_final/*`` in TensorBoard, the log, and (in
        :func:`_summary`) ``final_valid_loss``. Its time is not added to :attr:`paused`' budget
        share: a run's compute is its steps and regular validations."""
        ev = self.evaluate_final
        t0 = time.perf_counter()
        self.sampled_loss = self.valid_loss
        self.final_loss = float(ev())
        seconds = time.perf_counter() - t0
        ppl = safe_exp(self.final_loss)
        scalars = {
            "valid_final/loss": self.final_loss,
            "valid_final/ppl": ppl,
            "valid_final/seconds": seconds,
        }
        self.writer.scalars(step, scalars | {"valid_final/tokens": float(ev.tokens)})
        log(
            self.layout,
            f"step {step} | final validation on {ev.tokens:,} held-out tokens ({ev.batches} batches; "
            f"train.final_eval_batches={self.cfg.train.final_eval_batches}): loss {self.final_loss:.4f} | "
            f"ppl {ppl:.2f} | {seconds:.1f} s (the sampled one: {self.valid_loss:.4f})",
        )
        self.writer.flush()

    def _validate(self, done: int, total: int) -> None:
        """One validation after step ``done``: TensorBoard (loss, ppl, its wall-clock seconds) and log."""
        t0 = time.perf_counter()
        self.valid_loss = float(self._paused(self.evaluate))
        self.eval_seconds.append(time.perf_counter() - t0)
        ppl = safe_exp(self.valid_loss)
        scalars = {"valid/loss": self.valid_loss, "valid/ppl": ppl, "valid/seconds": self.eval_seconds[-1]}
        self.writer.scalars(done, scalars, tokens=self.compute.tokens)
        log(self.layout, f"step {done}/{total} | valid loss {self.valid_loss:.4f} | valid ppl {ppl:.2f}")
        self.writer.flush()


def train(cfg: RunConfig) -> dict[str, Any]:
    """Run the configured pretraining job in this process (one of ``WORLD_SIZE``).

    Returns:
        The run summary (also written to ``<output.dir>/summary.json`` by rank 0). A run found
        already complete (:func:`~megaformer.checkpoint.manager.finished_run`; its last
        checkpoint verified) is not trained: no model is built and nothing written, rank 0 says so, and its
        ``summary.json`` is returned as it is (``{"stopped": None}`` without one).

    Raises:
        ConfigError: a layout the world size cannot satisfy, an unusable DeepSpeed, engine JSON or
            checkpoint (all before any process group starts).
        DataFormatError: a missing or corrupt dataset, or one that does not fit the model
            (before any process group starts).
    """
    # each dataset opened and checked once in the run: the preflight, the data checks, the held-out
    # split and the sample indices share it (they reopened it 11 times)
    with opened_once():
        return _train(cfg)


def _train(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    stop = StopCheck(t.exit_signals, t.exit_duration_mins)  # first: a signal during start-up counts
    preflight = run_preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # no process group yet
    CheckpointManager.check_fresh_start(cfg)  # another run's directory: refused before any group
    layout = build_layout(cfg, preflight.dp_size)
    checkpoints = CheckpointManager(cfg, layout, explain_extension=extension_rule)
    plan = checkpoints.prepare()  # sha256 of every file to load, before anything is built
    # A complete run relaunched: said once its last checkpoint is known intact, and before anything
    # is written (config.json, TensorBoard events, summary.json).
    if plan.finished is not None:
        log(layout, plan.finished[0])
        return {**(plan.finished[1] or {}), "stopped": None}  # main exits 0: the run is complete
    load_dir = plan.load_dir
    if layout.is_main:
        os.makedirs(checkpoints.ckpt_dir, exist_ok=True)
        atomic_write_json(os.path.join(cfg.output.dir, "config.json"), _config_record(cfg))
    data = build_data(cfg, layout, preflight.stats, preflight.datasets)
    _log_data(cfg, layout, data)

    built = build_engine(cfg, layout, preflight.dp_size, load_dir)
    engine, dropout_rng, n_params, init_step, schedule, param_order = built
    checkpoints.attach(engine, dropout_rng, param_order)
    start_step, client_state = checkpoints.resume(load_dir) if load_dir is not None else (init_step, {})
    compute = compute_meter(cfg, layout, start_step, client_state)
    loop = TrainLoop(
        engine, cfg, layout, data, checkpoints, start_step, compute, schedule, client_state, stop=stop
    )
    elapsed = loop.run(resumed=load_dir is not None)
    return _summary(cfg, layout, loop, data, n_params, start_step, elapsed)


def build_engine(cfg: RunConfig, layout: Any, dp_size: int, load_dir: str | None) -> tuple:
    """The model (weights from ``train.init_from`` on a fresh start), optimizer, schedule and
    DeepSpeed engine of this rank; returns ``(engine, dropout_rng, n_params, init_step, schedule,
    param_order)``: the optimizer's parameter order, aligned for a new run, the checkpoint's for a
    resume (:func:`~megaformer.checkpoint.manager.saved_param_order`). Public: the step-timing
    job and the fake-CUDA dry run build their engine with it."""
    t, s = cfg.train, layout.state
    torch.manual_seed(t.seed)
    dropout_rng = DropoutRNG(
        t.seed, tp_rank=s.tp_rank, dp_rank=s.dp_rank, pp_rank=s.pp_rank, device=layout.device
    )
    model = build_model(cfg, layout, dropout_rng)
    n_params = count_parameters_global(model, layout)
    init_step = init_weights_from(model, cfg, layout) if load_dir is None and t.init_from else 0
    schedule = Schedule(t)
    param_order = "aligned"
    if load_dir is not None:
        tag_dir = ckpt_integrity.resolve_latest(load_dir)
        param_order = saved_param_order(tag_dir)
        if param_order != "aligned":
            log(
                layout,
                f"{tag_dir}: saved before the optimizer's parameters were ordered for alignment; "
                "resumed in its order (its optimizer state follows it). On a GPU, parameters after "
                "an odd-sized one (HeadScale) are then misaligned and their GEMMs slower",
            )
    optimizer, scheduler = build_optimizer(model, cfg, init_step, schedule, param_order)
    ds_config = build_deepspeed_config(cfg, dp_size)
    engine = initialize(
        model,
        optimizer,
        scheduler,
        ds_config,
        s,
        pipelined=cfg.parallel.pp_size > 1,
        masked_lm=cfg.model.objective == "mlm",
    )
    _log_layout(cfg, layout, n_params, engine.gas, engine.optimizer_summary())
    return engine, dropout_rng, n_params, init_step, schedule, param_order


def _config_record(cfg: RunConfig) -> dict[str, Any]:
    """The run's ``config.json``: the config's sections and, under ``provenance``, the git commit and
    the versions of megaformer, torch and deepspeed (:func:`~.tracking.provenance`)."""
    return {**to_dict(cfg), "provenance": provenance()}


def _wandb_tracker(cfg: RunConfig, layout: Layout) -> Any:
    """The W&B mirror of the scalars (rank 0, with ``output.wandb_project``), or None."""
    o = cfg.output
    if not (o.wandb_project and layout.is_main):
        return None

    return WandbTracker(o.wandb_project, o.wandb_entity, o.wandb_run_name, o.dir, _config_record(cfg), True)


def compute_meter(cfg: RunConfig, layout: Layout, start_step: int, client_state: dict) -> Any:
    """The run's :class:`~.flops.ComputeMeter`, continuing a resumed run's tokens and device-hours.

    Every process measures its device's peak (on CPU a matmul benchmark; ranks share the cores, so
    they measure together); rank 0 logs the model FLOPs and the peak. Public: the fake-CUDA dry run
    meters its steps with it.
    """
    flops = model_flops_per_token(cfg.model, cfg.model.padded_vocab_size(cfg.parallel.tp_size))
    peak, where = device_peak_flops(layout.device)
    tokens = int(client_state.get("tokens", start_step * cfg.train.global_batch_size * cfg.model.seq_len))
    log(layout, f"compute: {flops / 1e9:.3f} GFLOP per token (model FLOPs, training) | peak {where}")
    return ComputeMeter(
        flops, layout.world_size, peak, tokens, float(client_state.get("device_seconds", 0.0))
    )


def _log_data(cfg: RunConfig, layout: Layout, data: Data) -> None:
    info = data.info
    log(
        layout,
        f"data: {cfg.data.blend or cfg.data.prefix} | "
        f"train {info['train_documents']} docs / {info['train_tokens']:,} tokens | "
        f"valid {info['valid_documents']} docs / {info['valid_tokens']:,} tokens | "
        f"sample-index cache: {info['index_cache_hits']} hit, {info['index_cache_builds']} built "
        f"(by each node's local rank 0; the node's other ranks load them) | "
        f"loader workers {cfg.data.num_workers}",
    )


def _log_layout(cfg: RunConfig, layout: Layout, n_params: int, gas: int, optimizer: str) -> None:
    t, par, dp = cfg.train, cfg.parallel, layout.dp_size
    pipelined = par.pp_size > 1
    log(
        layout,
        f"model: {n_params:,} parameters"
        f"{' | masked LM (loss on masked tokens)' if cfg.model.objective == 'mlm' else ''}"
        f" | world {layout.world_size} on {layout.backend} | tp {par.tp_size}"
        f"{' (sequence parallel)' if par.sequence_parallel and par.tp_size > 1 else ''} | "
        f"pp {par.pp_size}{f' ({par.partition_method})' if pipelined else ''} | dp {dp} | "
        f"micro_batch_size {t.micro_batch_size} × grad accumulation {gas} × dp {dp} = "
        f"global_batch_size {t.global_batch_size} | seq_len {cfg.model.seq_len} | {t.precision} | "
        f"ZeRO {t.zero_stage} | DeepSpeed optimizer {optimizer}",
    )


def _compute_summary(loop: TrainLoop) -> dict[str, Any]:
    """The summary's compute fields; throughput from the median step time, as ``tokens_per_s``."""
    meter = loop.compute
    median_step = float(np.median(loop.step_times)) if loop.step_times else math.nan
    tflops = meter.tflops_per_device(loop.tokens_per_step / median_step) if loop.step_times else math.nan
    return {
        "model_flops_per_token": meter.flops_per_token,
        "tflops_per_device": tflops,
        "mfu": meter.mfu(tflops),
        "tokens": meter.tokens,
        "device_hours": meter.device_hours,
    }


def _health_summary(loop: TrainLoop) -> dict[str, Any]:
    """``nonfinite_steps``, ``skipped_steps`` (fp16 overflows) and, after a divergence stop,
    ``diverged_at_step`` / ``diverged_at_lr``."""
    out: dict[str, Any] = {
        "nonfinite_steps": int(loop.health.count.item()),
        "skipped_steps": loop.engine.skipped_steps(),
        **loop.diverged,
    }
    if out["nonfinite_steps"]:
        log(
            loop.layout,
            f"warning: {out['nonfinite_steps']} of {loop.total} steps had a non-finite loss or gradient "
            f"norm, {out['skipped_steps']} updates were skipped: the run diverged (TensorBoard "
            "train/nonfinite_steps, train/skipped_steps). Lower train.lr or set train.grad_clip > 0",
        )
    return out


def _missing_reasons(loop: TrainLoop, summary: dict[str, Any]) -> dict[str, str]:
    """Why a summary figure could not be measured, for :func:`~.summary_file.null_non_finite`
    (only the figures that are in fact NaN, infinite or None become null and are listed)."""
    reasons = {}
    if not loop.step_times:
        no_step = "no training step ran in this launch (throughput is measured on its own steps)"
        reasons |= {"tokens_per_s": no_step, "tflops_per_device": no_step, "mfu": no_step}
    elif loop.compute.peak_flops is None:
        reasons["mfu"] = "no peak FLOP/s known for this device (flops.PEAK_TFLOPS)"
    loss = loop.valid_loss
    if math.isnan(loss) and not (summary.get("nonfinite_steps") or loop.diverged):
        why = "no validation ran in this launch"
    elif not math.isfinite(loss):
        why = f"the validation loss was not finite ({loss}): the run diverged"
    else:
        why = f"exp(final_valid_loss={loss:.4g}) overflows a float"
    reasons["final_valid_ppl"] = why
    if not math.isfinite(loss):
        reasons["final_valid_loss"] = why
    reasons["final_test_ppl"] = "exp(final_test_loss) overflows a float"
    reasons |= loop.length.missing_reasons()
    return {k: v for k, v in reasons.items() if k in summary}


def _summary(
    cfg: RunConfig,
    layout: Layout,
    loop: TrainLoop,
    data: Data,
    n_params: int,
    start_step: int,
    elapsed: float,
) -> dict[str, Any]:
    """The run summary; rank 0 writes ``summary.json`` and prints where things are."""
    # Median step time: robust to the first steps' warm-up and to evaluation pauses.
    median_step = float(np.median(loop.step_times)) if loop.step_times else math.nan
    valid_loss = loop.final_loss if math.isfinite(loop.final_loss) else loop.valid_loss
    ckpt = os.path.abspath(os.path.join(cfg.output.dir, "checkpoints", f"global_step{loop.last_step}"))
    summary = {
        "steps": loop.last_step,
        "stopped": loop.stopped,
        "resumed_from_step": start_step,
        "parameters": n_params,
        "world_size": layout.world_size,
        "train_seconds": elapsed,
        "tokens_per_s": loop.tokens_per_step / median_step if loop.step_times else math.nan,
        "final_valid_loss": valid_loss,
        "final_valid_ppl": safe_exp(valid_loss) if math.isfinite(valid_loss) else math.nan,
        "tensorboard_dir": os.path.abspath(loop.tb_dir),
        "checkpoint_dir": ckpt,
        "unigram_entropy": data.unigram_entropy,
        **_compute_summary(loop),
    }
    if math.isfinite(loop.final_loss):  # the final validation read more than the regular ones
        summary["final_valid_loss_sampled"] = loop.sampled_loss
        summary["final_valid_tokens"] = loop.evaluate_final.tokens
    if math.isfinite(loop.test_loss):
        summary |= {"final_test_loss": loop.test_loss, "final_test_ppl": safe_exp(loop.test_loss)}
    summary |= loop.length.summary()
    summary.update(_health_summary(loop))
    # Strict JSON: a figure not measured (NaN, inf) is null, with why under "missing".
    raw, summary = summary, null_non_finite(summary, _missing_reasons(loop, summary))
    if layout.is_main:
        atomic_write_json(os.path.join(cfg.output.dir, "summary.json"), summary, allow_nan=False)
        ran = loop.last_step - start_step
        steps = (
            f"{loop.last_step} steps"
            if start_step == 0
            else f"{ran} steps in this launch (steps {start_step + 1}–{loop.last_step}; the run has "
            f"{loop.last_step} of {loop.total})"
        )
        if math.isfinite(valid_loss):
            valid = f"valid loss {valid_loss:.4f} (ppl {raw['final_valid_ppl']:.2f})"
        else:  # not measured (stopped before any validation of this launch) or diverged: no "nan"
            valid = "valid loss: " + summary.get("missing", {}).get("final_valid_loss", "not measured")
        log(
            layout,
            f"{'stopped' if loop.stopped else 'done'}: {steps} in {elapsed:.1f} s | "
            f"{raw['tokens_per_s']:,.0f} tokens/s | "
            f"{raw['tflops_per_device']:.3g} TFLOP/s per device"
            + (f" (MFU {raw['mfu']:.1%})" if raw["mfu"] is not None else "")
            + f" | {raw['tokens']:,} tokens, {raw['device_hours']:.3g} device-hours"
            + (" (the run's totals, all launches)" if start_step else "")
            + " | "
            f"{valid} vs unigram entropy {raw['unigram_entropy']:.4f} nats",
        )
        log(layout, f"TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
        log(layout, f"plots (PNG): python -m megaformer.tools.plot {os.path.abspath(cfg.output.dir)}")
        log(layout, f"checkpoint: {summary['checkpoint_dir']}")
    return summary
