"""Everything megaformer asks of DeepSpeed, in one module, for the one minor version it is tested with.

DeepSpeed gives the engine (data parallelism, ZeRO 0–3, fp16 dynamic loss scaling, bf16, gradient
accumulation), the pipeline engine (1F1B) and the checkpoint files. Where this project relies on
behaviour or names that are not DeepSpeed's public API, that reliance lives here, and
:func:`check_deepspeed_version` refuses a DeepSpeed other than :data:`TESTED_DEEPSPEED` before any
process group starts:

* ``init_distributed``: on gloo, DeepSpeed's shared-memory CPU collective is marked incompatible so
  it is not JIT-compiled (~30 s) at start-up (``deepspeed.ops.__compatible_ops__``).
* the pipeline engine's fp32 gradient clipping (``PipelineEngine.clip_fp32_gradients``) is replaced
  by a correct one that also records the norm (:func:`_install_pipeline_fp32_clipping`);
* the fp16 loss scaler's give-up at its minimum scale is recognised by its message (a bare
  ``Exception``) and raised as :class:`LossScaleExhaustedError`;
* loss scale and skipped steps are read from the engine's fp16 optimizer
  (``DeepSpeedEngine._get_optimizer_loss_scale``, ``DeepSpeedEngine.skipped_steps``);
* at pp = 1 the loop owns the step: ``forward``, ``backward`` per micro-batch, then, once the
  gradients are complete, its own gradient work (the fp32 norm, the per-layer diagnostics:
  :meth:`Engine._gradient_work`), then ``step()``. It relies on ``step()`` touching no gradient
  before ``_take_model_step`` (managed gradient accumulation) and on ``backward`` reducing over
  data-parallel ranks at the boundary;
* the pipeline engine runs backward and the update inside ``train_batch``, so there
  ``_take_model_step`` stays wrapped for the diagnostics (:meth:`Engine.before_optimizer_step`),
  and its fp32 clipping is replaced as above;
* the learning rate an update uses, read from the optimizer's ``param_groups`` (DeepSpeed does not
  step the scheduler after an fp16 overflow, so it lags the step counter);
* sequence-parallel parameter gradients are summed over the TP group once per step, coalesced,
  where the engine still holds whole gradients at the accumulation boundary
  (:func:`_deferred_sequence_parallel_grads`: ZeRO 0/1 without ``overlap_comm``, not bf16's
  optimizer), just before DeepSpeed's data-parallel reduction (under ZeRO-1 that reduction moves
  the gradients out of ``.grad``, so the sum must precede it). At pp = 1 the loop runs both: the
  engine's ``enable_backward_allreduce`` is off (as DeepSpeed's own pipeline engine sets it), so
  ``backward`` leaves the reduction to the loop, which calls ``allreduce_gradients`` after each
  micro-batch's backward, the sum first at the boundary (:meth:`Engine._reduce_gradients`). The
  pipeline engine calls ``allreduce_gradients`` from its own instructions, so there it stays
  wrapped (:func:`_install_sequence_parallel_reduction`);
* (DeepSpeed's checkpoint format, its file names and the data classes it pickles into them, is the
  checkpoint package's: :mod:`megaformer.checkpoint.formats`);
* the pipeline engine's mark on its copy of a tied parameter (``ds_pipe_replicated``:
  :func:`is_pipe_replica`), its instruction table (``PipelineEngine._INSTRUCTION_MAP``:
  :func:`wrap_pipeline_instructions`, for the fake-CUDA dry run's phase audit), and ZeRO's
  gradient assembly (``deepspeed.utils.safe_get_full_grad``: :func:`full_grad`).

Outside this module only :mod:`megaformer.pipeline.module` (whose classes are DeepSpeed's) and
``megaformer/tools`` import DeepSpeed; ``tests/unit/test_boundaries.py`` fails otherwise. Each
reliance above is checked on the installed DeepSpeed's source by
``tests/unit/test_ds_adapter_contract.py``, which fails, naming it, when DeepSpeed changes under it.

Every tensor handed to a collective here is on the communication device of its group
(:func:`megaformer.parallel.comm.comm_device`): CUDA under NCCL, which refuses CPU tensors.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megaformer.config import ConfigError
from megaformer.data.mlm import IGNORE_INDEX
from megaformer.parallel.comm import comm_device, mean_over_group
from megaformer.parallel.grads import defer_sequence_parallel_grads, reduce_sequence_parallel_grads
from megaformer.parallel.utils import grad_norm_squared
from megaformer.training.schedule import apply_schedule

TESTED_DEEPSPEED = "0.19"
"""The DeepSpeed minor version this module is written and tested against (requirements.txt pins it)."""


def check_deepspeed_version(version: str | None = None) -> str:
    """Refuse a DeepSpeed whose minor version is not :data:`TESTED_DEEPSPEED`; return the version.

    Args:
        version: the version to check (default: the installed one, read without importing it).

    Raises:
        ConfigError: DeepSpeed missing, or another minor version; names the fix.
    """
    if version is None:
        try:
            version = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            raise ConfigError(
                "deepspeed is not installed; run scripts/install.sh (or pip install -r requirements.txt)"
            ) from None
    minor = ".".join(version.split(".")[:2])
    if minor != TESTED_DEEPSPEED:
        raise ConfigError(
            f"deepspeed {version} is installed, but megaformer is tested with deepspeed "
            f"{TESTED_DEEPSPEED}.x only (it relies on engine internals that change between minor "
            f"versions); install it with: pip install 'deepspeed>={TESTED_DEEPSPEED}.8,<0.20'"
        )
    return version


def check_precision(precision: str, backend: str) -> None:
    """Refuse ``train.precision=fp16`` where DeepSpeed's accelerator has no fp16 (CPU).

    Raises:
        ConfigError: naming the precision, the device and the fix.
    """
    if precision != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        raise ConfigError(
            f"train.precision=fp16: DeepSpeed's {get_accelerator().device_name()} accelerator has no "
            f"fp16 support on this machine (backend {backend}); use train.precision=bf16 or fp32, "
            "or run on GPUs"
        )


def init_distributed(backend: str, timeout: Any = None) -> tuple[int, int, int]:
    """Start the default process group through DeepSpeed; return (rank, world_size, local_rank).

    The launcher (``deepspeed`` or ``torchrun``) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT; a plain ``python`` start without them runs as a single process. Under NCCL the
    CUDA device of ``LOCAL_RANK`` is made current first, so collectives and object broadcasts use it.

    Args:
        timeout: ``datetime.timedelta`` a collective may wait (``parallel.timeout_minutes``);
            None: DeepSpeed's default (30 minutes) for the world, torch's per-backend default for
            later groups. Given, it is the world group's, and torch's default for every group made
            later without a timeout of its own: DeepSpeed's pipeline engine builds its groups with
            ``deepspeed.comm.new_group(ranks)``, which takes none (torch would give them its NCCL
            default, 10 minutes), so torch's defaults (``distributed_c10d.default_pg_timeout``,
            ``default_pg_nccl_timeout``, read by ``_get_default_timeout``) are set to it here.
    """
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if backend == "gloo":
        # DeepSpeed JIT-compiles its shared-memory CPU collective (~30 s) at init even though gloo
        # does the work; marking it incompatible skips the build (FACTS-DEEPSPEED-CPU.md).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    kwargs = {} if timeout is None else {"timeout": timeout}
    if timeout is not None:
        from torch.distributed import distributed_c10d

        for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
            if hasattr(distributed_c10d, name):
                setattr(distributed_c10d, name, timeout)
    deepspeed.init_distributed(dist_backend=backend, **kwargs)
    return dist.get_rank(), dist.get_world_size(), local_rank


def is_pipe_replica(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is the pipeline engine's copy of a tied parameter (the tied embedding on
    the last stage, which DeepSpeed marks ``ds_pipe_replicated``): counted once, on its owner."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's whole gradient of ``param`` (its TP shard), assembled under ZeRO.

    ``deepspeed.utils.safe_get_full_grad`` (``param.grad`` when it is there). A collective over the
    data-parallel group under ZeRO 1–3: every data-parallel rank must call it for the same
    parameters in the same order, after the backward pass and before the optimizer step.
    """
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def wrap_pipeline_instructions(engine_cls: type, wrap: Any) -> None:
    """Replace each handler of the pipeline engine's instruction table with ``wrap(handler, phase)``.

    ``engine_cls``: the ``PipelineEngine`` class whose ``_INSTRUCTION_MAP`` (instruction type →
    handler) is rewritten in place; ``phase`` is ``"forward"``, ``"backward"`` or ``"optimizer"``
    (communication instructions count as the pass they serve); instructions without a phase
    (loads, buffer allocation) keep their handler.
    """
    from deepspeed.runtime.pipe import schedule

    phases = {
        schedule.ForwardPass: "forward",
        schedule.BackwardPass: "backward",
        schedule.OptimizerStep: "optimizer",
        schedule.ReduceGrads: "optimizer",
        schedule.ReduceTiedGrads: "optimizer",
        schedule.SendActivation: "forward",
        schedule.RecvActivation: "forward",
        schedule.SendGrad: "backward",
        schedule.RecvGrad: "backward",
    }
    engine_cls._INSTRUCTION_MAP = {
        k: (wrap(v, phases[k]) if k in phases else v) for k, v in engine_cls._INSTRUCTION_MAP.items()
    }


def pipeline_grad_norm(params: Iterable[torch.nn.Parameter], state: Any) -> torch.Tensor:
    """L2 norm of the whole pipelined model's gradients, on every stage, as a device tensor.

    Each stage's TP-aware squared norm (:func:`megaformer.parallel.utils.grad_norm_squared`; the
    tied embedding's copy on the last stage, marked ``ds_pipe_replicated`` by DeepSpeed, skipped)
    summed over the pipeline group, in fp32 on the group's communication device.
    """
    owned = [p for p in params if not is_pipe_replica(p)]
    tp_group = state.split_tp_group
    square = grad_norm_squared(owned, tp_group, device=comm_device(state.pp_group))
    if state.pp_size > 1:
        dist.all_reduce(square, group=state.pp_group)
    return square.sqrt()


def _install_pipeline_fp32_clipping(engine: Any, state: Any) -> None:
    """Replace the pipeline engine's fp32 gradient clipping (no ZeRO, no fp16/bf16 optimizer).

    DeepSpeed 0.19's ``clip_grad_norm_`` counts a parameter that is not tensor-parallel only where
    the rank in its "model parallel" group (TP × PP) is 0, i.e. on the first stage alone: the later
    stages' blocks, norms and the tied embedding's copy drop out of the norm, so pp = 2 clipped with
    another norm than pp = 1. Here the norm of :func:`pipeline_grad_norm`, the clip coefficient
    ``min(1, clip / (norm + 1e-6))`` as DeepSpeed's, applied on the device (no host sync), and the
    norm recorded for ``engine.get_global_grad_norm()``.
    """
    max_norm = engine.gradient_clipping()

    def clip_and_record() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = pipeline_grad_norm(params, state)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_record


class LossScaleExhaustedError(RuntimeError):
    """fp16: the gradients overflowed at the minimum loss scale (DeepSpeed's dynamic loss scaler
    gives up); raised by :meth:`Engine.train_step` on every rank alike (overflow is agreed over the
    ranks), before the update is applied."""


_MIN_SCALE_MESSAGE = "loss scale already at minimum"  # DeepSpeed 0.19's DynamicLossScaler.update_scale


def _deferred_sequence_parallel_grads(engine: Any, state: Any) -> tuple[list, Any] | None:
    """Switch sequence-parallel parameters to one coalesced TP sum of their gradients per step
    (Megatron's LayerNorm-gradient all-reduce) instead of one per parameter per micro-batch; return
    ``(params, grad_of)`` for :func:`~megaformer.parallel.grads.reduce_sequence_parallel_grads`, or
    None where it does not apply.

    It applies only where DeepSpeed 0.19 holds the parameters' whole gradients at the accumulation
    boundary (``.grad``, or ``.grad_accum`` when it accumulates in fp32): no ZeRO or ZeRO-1 without
    ``overlap_comm``, and not the BF16_Optimizer (which moves gradients into its own fp32 buffers
    during backward). Elsewhere (ZeRO-2/3, overlap_comm, bf16 without ZeRO) the model keeps the
    per-micro-batch autograd all-reduce.
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if state.tp_size == 1:  # nothing is sequence parallel without a TP group
        return None
    module = engine.module
    if not any(getattr(m, "sequence_parallel", False) for m in module.modules()):
        return None
    opt = engine.optimizer
    hooks_reduce = getattr(opt, "overlap_comm", False) or getattr(opt, "partition_gradients", False)
    if engine.zero_optimization_stage() > 1 or hooks_reduce or isinstance(opt, BF16_Optimizer):
        return None
    params = defer_sequence_parallel_grads(module)
    use_accum = getattr(opt, "use_grad_accum_attribute", False)

    def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
        return getattr(p, "grad_accum", None) if use_accum else p.grad

    return params, grad_of


def _install_sequence_parallel_reduction(engine: Any, state: Any, params: list, grad_of: Any) -> None:
    """Pipeline engine only: put the coalesced TP sum just before DeepSpeed's data-parallel
    reduction, by wrapping ``allreduce_gradients``, which the pipeline engine's reduce-gradients
    instruction calls. It must come before, because under ZeRO-1 that reduction moves the gradients
    into the optimizer's partitioned buffers (a sum on ``.grad`` after it is lost; tried:
    ``tests/distributed/test_tp_train.py``'s sequence-parallel ZeRO-1 run then clips with another
    norm). At pp = 1 the loop orders the two itself (:meth:`Engine._reduce_gradients`)."""
    original = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            reduce_sequence_parallel_grads(params, state.tp_group, grad_of)
        return original(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients


class PhaseObserver(Protocol):
    """What :meth:`Engine.observe_phases` reports to (the fake-CUDA audit is one)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A context the engine runs phase ``name`` in (``step``, ``forward``, ``backward``,
        ``optimizer``)."""

    def step_ended(self, loss: torch.Tensor) -> None:
        """Called after each step with its loss (a float64 0-dim device tensor)."""


class Engine:
    """A DeepSpeed engine (plain or pipeline) behind the few calls the trainer makes.

    Losses and norms stay on the device as tensors; nothing here reads them to the host.

    Args:
        engine: what ``deepspeed.initialize`` returned.
        state: the job's :class:`~megaformer.parallel.state.ParallelState`.
        pipelined: ``engine`` is a ``PipelineEngine``.
        masked_lm: ``model.objective`` is mlm (losses averaged over the step's masked tokens); None:
            read from the module's ``config`` (a ``PipelineModule`` has none: pass it).
    """

    def __init__(self, engine: Any, state: Any, pipelined: bool, masked_lm: bool | None = None) -> None:
        self.engine = engine
        self.state = state
        self.pipelined = pipelined
        self.gas = engine.gradient_accumulation_steps()
        # model.objective mlm: losses averaged over the step's masked tokens.
        if masked_lm is None:
            config = getattr(getattr(engine, "module", None), "config", None)
            masked_lm = getattr(config, "objective", "clm") == "mlm"
        self.masked_lm = masked_lm
        self._fp32_plain = not (
            engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()
        )
        self._grad_norm: Any = None
        self._step_hooks: list[Any] = []  # pp = 1: run by the loop between backward and step
        self.observer: PhaseObserver | None = None  # see observe_phases
        if pipelined and self._fp32_plain:
            _install_pipeline_fp32_clipping(engine, state)
        sp_grads = _deferred_sequence_parallel_grads(engine, state)
        self._sp_grads = None  # pp = 1: (params, grad_of) the loop sums over TP before the reduction
        if sp_grads is not None and pipelined:
            _install_sequence_parallel_reduction(engine, state, *sp_grads)
        elif sp_grads is not None:
            # backward() then leaves the data-parallel reduction to the loop (_reduce_gradients),
            # as DeepSpeed's PipelineEngine does for its own schedule.
            engine.enable_backward_allreduce = False
            self._sp_grads = sp_grads
        self.coalesced_sp_grads = sp_grads is not None

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def observe_phases(self, observer: PhaseObserver | None) -> None:
        """Report this engine's phases to ``observer`` (None: stop): each step as ``"step"`` (then
        :meth:`PhaseObserver.step_ended` with its loss) and, at pp = 1, each micro-batch's
        ``"forward"`` (evaluation's too), ``"backward"`` and ``"optimizer"``. The pipeline engine
        runs its own schedule: mark its phases with :func:`wrap_pipeline_instructions`. What the
        fake-CUDA dry run's audit uses instead of replacing the engine's methods."""
        self.observer = observer

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.observer is None else self.observer.phase(name)

    def optimizer_summary(self) -> str:
        """DeepSpeed's optimizer wrapper of this run, for the start-up log: its class name (e.g.
        ``BF16_Optimizer``: bf16 with fp32 gradient accumulation at ZeRO ≤ 1;
        ``DeepSpeedZeroOptimizer``; ``FP16_Optimizer``; the torch optimizer itself without one),
        with ``(immediate_grad_update)`` when the BF16 optimizer adds each gradient to its fp32
        buffer during backward (``bf16.immediate_grad_update`` in the JSON)."""
        opt = self.engine.optimizer
        name = type(opt).__name__
        if getattr(opt, "immediate_grad_update", False):
            name += " (immediate_grad_update)"
        return name

    def train_step(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over ``gas`` micro-batches of this data-parallel rank.

        Returns:
            The step's mean training loss (nats/token) over its micro-batches and the data-parallel
            ranks (the masked LM: over all their masked tokens, :meth:`_masked_lm_train_step`): a
            float64 0-dim tensor on the device (read it only when logging).

        Raises:
            LossScaleExhaustedError: fp16 overflow at the minimum loss scale (the run has diverged).
        """
        try:
            with self._phase("step"):
                loss = self._train_step(micro_batches)
            if self.observer is not None:
                self.observer.step_ended(loss)
            return loss
        except Exception as e:  # DeepSpeed raises a bare Exception there
            if _MIN_SCALE_MESSAGE in str(e):
                raise LossScaleExhaustedError(
                    f"fp16 gradients overflowed at the minimum loss scale ({self.loss_scale():g}): {e}"
                ) from None
            raise

    def _train_step(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.pipelined:
            # Every stage gets the iterator; the first stage reads the tokens, the last the labels.
            # The loss returned is the last stage's, averaged over data-parallel ranks and
            # broadcast to every stage by DeepSpeed.
            if self.masked_lm:
                micro_batches = self._weighted_masked_batches(micro_batches, self.gas)
            loss = self.engine.train_batch(micro_batches)
            self._grad_norm = self.engine.get_global_grad_norm()
            return loss.detach().double()
        if self.masked_lm:
            return self._masked_lm_train_step(micro_batches)
        total = None
        self._grad_norm = None
        for _ in range(self.gas):
            tokens, labels = next(micro_batches)
            with self._phase("forward"):
                loss = self.engine(tokens, labels)
            with self._phase("backward"):
                self.engine.backward(loss)
            if self._sp_grads is not None:
                self._reduce_gradients()
            # fp64 on the device: the mean of gas micro-batch losses, free of summation-order noise
            total = loss.detach().double() if total is None else total + loss.detach().double()
            if self.engine.is_gradient_accumulation_boundary():
                self._gradient_work()  # the gradients are complete (reduced over data-parallel ranks)
            with self._phase("optimizer"):
                self.engine.step()
        if self._grad_norm is None:
            self._grad_norm = self.engine.get_global_grad_norm()
        return self._mean_over_dp(total / self.gas)

    def _masked_lm_train_step(
        self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """:meth:`_train_step` of the masked LM: the loss of the step is the summed cross-entropy of
        its masked tokens (every micro-batch, every data-parallel rank) over their count, fairseq's
        ``sample_size`` normalisation, not the mean of the micro-batches' means.

        The model returns each micro-batch's mean over its own ``n`` masked tokens
        (:class:`~megaformer.model.MaskedLMLoss`); DeepSpeed averages the backward over the ``gas``
        micro-batches and the ``dp`` ranks. So the step's ``gas`` micro-batches are read first, their
        masked tokens counted and the count summed over the data-parallel ranks (``N``), and each
        micro-batch's loss is back-propagated times ``n · gas · dp / N``: the gradient is that of
        ``Σ NLL / N``. The returned loss is ``Σ NLL / N`` too (float64, on the device)."""
        batches = [next(micro_batches) for _ in range(self.gas)]
        counts, mean_count = self._masked_counts(batches)
        total = None
        self._grad_norm = None
        for (tokens, labels), n in zip(batches, counts, strict=True):
            with self._phase("forward"):
                loss = self.engine(tokens, labels)
            weight = (n * self.gas / mean_count).to(loss.dtype)
            with self._phase("backward"):
                self.engine.backward(loss * weight)
            if self._sp_grads is not None:
                self._reduce_gradients()
            nll = loss.detach().double() * n  # this micro-batch's summed NLL
            total = nll if total is None else total + nll
            if self.engine.is_gradient_accumulation_boundary():
                self._gradient_work()
            with self._phase("optimizer"):
                self.engine.step()
        if self._grad_norm is None:
            self._grad_norm = self.engine.get_global_grad_norm()
        summed = self._mean_over_dp(total)  # Σ NLL / dp
        return summed / mean_count.to(summed.device)

    def _masked_counts(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each micro-batch's masked-token count ``n`` and ``N / dp`` (their sum over the
        data-parallel ranks, averaged; at least 1), float64 on ``device`` (None: where the labels
        are): one all-reduce, no host sync."""

        counts = [(labels.to(device) != IGNORE_INDEX).sum().double() for _, labels in batches]
        mean_count = mean_over_group(torch.stack(counts).sum(), self.state.dp_group, self.state.dp_size)
        return counts, mean_count.to(counts[0].device).clamp(min=1.0)

    def _weighted_masked_batches(
        self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int
    ) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        """The masked LM under a pipeline: the next ``count`` micro-batches, each with the weight
        ``n · count · dp / N`` beside its labels (``(tokens, (labels, weight))``, ``n`` its masked
        tokens, ``N`` those of all ``count`` micro-batches of every data-parallel rank), for
        :class:`~megaformer.model.MaskedLMLoss` to scale its mean by. DeepSpeed's pipeline engine
        averages the loss and the gradients over the micro-batches and the data-parallel ranks, so
        both become fairseq's ``Σ NLL / N``, as :meth:`_masked_lm_train_step` makes them at pp = 1.

        Every stage reads the micro-batches and computes the same weights (its data-parallel group's
        all-reduce, before the schedule starts: no collective inside it); only the last stage uses
        them. Counted on the engine's device, one all-reduce, no host sync.
        """
        batches = [next(micro_batches) for _ in range(count)]
        counts, mean_count = self._masked_counts(batches, self.engine.device)
        return iter(
            [
                (tokens, (labels, (n * count / mean_count).float()))
                for (tokens, labels), n in zip(batches, counts, strict=True)
            ]
        )

    def _reduce_gradients(self) -> None:
        """pp = 1 with coalesced sequence-parallel gradients, after each micro-batch's ``backward``
        (which skipped it): at the accumulation boundary the TP sum of the sequence-parallel
        gradients, then DeepSpeed's data-parallel reduction, in the order ``backward`` would have
        run it (``allreduce_gradients`` also tells a ZeRO optimizer whether this is the boundary,
        so it is called on every micro-batch, as ``backward`` calls it)."""
        params, grad_of = self._sp_grads
        if self.engine.is_gradient_accumulation_boundary():
            reduce_sequence_parallel_grads(params, self.state.tp_group, grad_of)
        self.engine.allreduce_gradients()

    def _gradient_work(self) -> None:
        """pp = 1, between the last backward of a step and ``engine.step()``, the gradients complete
        (reduced over data-parallel ranks, the sequence-parallel ones summed over TP before that):
        the fp32 norm (DeepSpeed clips fp32 gradients without reporting it: ours, TP-aware), then
        the hooks of :meth:`before_optimizer_step`. ``step()`` itself does nothing to the gradients
        before its update (clipping, the optimizer, ``zero_grad``)."""
        if self._fp32_plain:
            tp_group = self.state.split_tp_group
            self._grad_norm = grad_norm_squared(self.engine.module.parameters(), tp_group).sqrt()
        for hook in self._step_hooks:
            hook()

    def eval_loss(
        self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int
    ) -> torch.Tensor:
        """Mean loss over ``count`` micro-batches of this rank and over the data-parallel ranks (the
        masked LM: the summed loss of all their masked tokens over their count).

        Returns:
            A float64 0-dim device tensor; the same on every rank.
        """
        if self.pipelined:
            if self.masked_lm:
                micro_batches = self._weighted_masked_batches(micro_batches, count)
            loss = self.engine.eval_batch(micro_batches, num_micro_batches=count)
            return loss.detach().double()
        self.engine.eval()
        total = None
        masked = None  # the masked LM: its masked-token count (the loss is Σ NLL / Σ count)
        with torch.no_grad():
            for _ in range(count):
                tokens, labels = next(micro_batches)
                with self._phase("forward"):
                    loss = self.engine(tokens, labels).detach().double()
                if self.masked_lm:
                    n = (labels != IGNORE_INDEX).sum().double()
                    loss = loss * n
                    masked = n if masked is None else masked + n
                total = loss if total is None else total + loss
        self.engine.train()
        if masked is not None:
            summed = self._mean_over_dp(total)
            return summed / self._mean_over_dp(masked).to(summed.device).clamp(min=1.0)
        return self._mean_over_dp(total / count)

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        # Over the data-parallel group only: the TP ranks of one replica hold the same value.
        return mean_over_group(value, self.state.dp_group, self.state.dp_size)

    def grad_norm(self) -> torch.Tensor | float | None:
        """The last step's global gradient norm (a device tensor or a float), or None if unknown."""
        return self._grad_norm

    def loss_scale(self) -> float | None:
        """The fp16 dynamic loss scale now (None outside fp16)."""
        if not self.engine.fp16_enabled():
            return None
        scale = self.engine._get_optimizer_loss_scale()
        return None if scale is None else float(scale)

    def lr(self) -> float:
        """The learning rate the next optimizer update will use, from the optimizer's first param
        group (every group follows the same schedule). A host value: no device sync."""
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def apply_schedule(self) -> float:
        """Set the optimizer's learning rate to the schedule's at the scheduler's position (see
        :func:`megaformer.training.schedule.apply_schedule`); return it. For a resumed run, whose
        optimizer state brought back the rate of the schedule it was saved with."""

        return apply_schedule(self.engine.lr_scheduler)

    def before_optimizer_step(self, hook: Any) -> None:
        """Call ``hook()`` at every optimizer update, after the gradients are complete (averaged
        over data-parallel ranks, ZeRO-reduced) and before clipping, the optimizer step and
        ``zero_grad``; with the plain engine and the pipeline engine alike. In fp16 the gradients
        still carry the loss scale then. At pp = 1 the loop calls it (:meth:`_gradient_work`); the
        pipeline engine runs backward and the update inside ``train_batch``, so there it wraps
        ``_take_model_step``."""
        if not self.pipelined:
            self._step_hooks.append(hook)
            return
        take_model_step = self.engine._take_model_step

        def hooked(*args: Any, **kwargs: Any) -> Any:
            hook()
            return take_model_step(*args, **kwargs)

        self.engine._take_model_step = hooked

    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far for fp16 overflow (0 outside fp16)."""
        return int(self.engine.skipped_steps)

    def save(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        """Write this rank's part of the DeepSpeed checkpoint ``ckpt_dir/tag``, without DeepSpeed's
        ``latest`` tag (its rank 0 writes it without waiting for the other ranks' files: the
        checkpointer moves ``latest`` once every file is written and in the manifest)."""
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, ckpt_dir: str, tag: str) -> tuple[str, dict]:
        """Load ``ckpt_dir/tag`` (module, optimizer, scheduler); return (path, client_state).

        Raises:
            ConfigError: DeepSpeed could not load it.
        """
        path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise ConfigError(f"train.resume: DeepSpeed could not load {tag} from {ckpt_dir}")
        return path, client_state


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    ds_config: dict,
    state: Any,
    pipelined: bool,
    masked_lm: bool | None = None,
) -> Engine:
    """``deepspeed.initialize`` with our optimizer, schedule and layout, wrapped in :class:`Engine`.

    The plain engine takes ``state`` as its ``mpu`` (gradients averaged and ZeRO partitioned over
    the data-parallel group); the pipeline engine builds its groups from the module's topology.
    """
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=None if pipelined else state.mpu(),
        dist_init_required=False,
    )
    return Engine(engine, state, pipelined, masked_lm=masked_lm)
