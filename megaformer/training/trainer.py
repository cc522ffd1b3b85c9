"""The training loop: model + AdamW + schedule into ``deepspeed.initialize``, data, metrics, checkpoints.

One optimizer step = ``global_batch_size`` samples: each data-parallel rank runs
``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` samples through the DeepSpeed
engine, which averages gradients over the data-parallel group, clips, scales (fp16) and steps.

Under tensor parallelism (``parallel.tp_size`` > 1) the world is a ``tp × pp × dp`` grid
(:class:`~megaformer.parallel.state.ParallelState`): the ranks of one TP group read the same samples
and hold slices of one model; data is sharded over the data-parallel rank only, and the state is
DeepSpeed's ``mpu``, so gradients are averaged (and ZeRO partitions) over the data-parallel group.

With ``parallel.pp_size`` > 1 the model is a DeepSpeed ``PipelineModule`` over the layer list of
:mod:`megaformer.pipeline` on the same grid (``ParallelState.topology()``), trained by the pipeline
engine: one ``engine.train_batch`` per optimizer step, the gradient-accumulation steps being the
pipeline's micro-batches; the loss it returns is the last stage's, averaged over the data-parallel
ranks and broadcast to every stage. At ``pp_size`` = 1 the same layer list runs as a
:class:`~megaformer.pipeline.SequentialLM` in the plain engine.

The samples of step ``s`` are fixed by ``(seed, s)``: on resume the loop continues with exactly the
samples it would have seen.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data_tools.files import atomic_write_json
from megaformer.config import RunConfig, to_dict, validate_layout
from megaformer.data.gpt_dataset import GPTSamples, build_train_valid, samples_unigram_entropy
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.state import ParallelState
from megaformer.parallel.utils import grad_norm as tp_grad_norm
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.distributed import init_distributed, pick_backend
from megaformer.training.metrics import MetricsWriter, StepTimer, format_step_line
from megaformer.training.rng_state import load_rng_state, save_rng_state
from megaformer.training.schedule import build_scheduler, lr_at


@dataclass(frozen=True)
class Layout:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    device: torch.device
    dp_group: Any = None
    """The data-parallel process group (None: the whole world, as when tp = pp = 1)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def micro_batch(
    samples: GPTSamples, first: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``first .. first+count-1`` as (tokens, labels), each int64 [count, seq_len]."""
    rows = np.stack([samples[i] for i in range(first, first + count)])
    batch = torch.from_numpy(rows).to(device)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def _log(layout: Layout, message: str) -> None:
    if layout.is_main:
        print(f"[megaformer] {message}", flush=True)


def _mean_over_dp(value: float, layout: Layout) -> float:
    if layout.dp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=layout.device)
    # Over the data-parallel group only: the TP ranks of one replica hold the same value.
    dist.all_reduce(t, group=layout.dp_group)
    return float(t.item()) / layout.dp_size


def _fp32_grad_norm(model: torch.nn.Module, tp_group: Any = None) -> float:
    """L2 norm of the whole model's gradients (fp32, no ZeRO: DeepSpeed clips without reporting the
    norm); at TP > 1 sharded parameters are summed over ``tp_group``, replicated ones counted once."""
    return tp_grad_norm(model.parameters(), tp_group)


def _loss_scale(engine: Any) -> float | None:
    if not engine.fp16_enabled():
        return None
    for obj in (engine.optimizer, getattr(engine.optimizer, "loss_scaler", None)):
        for attr in ("cur_scale", "loss_scale"):
            value = getattr(obj, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
    return None


def resolve_resume(cfg: RunConfig, ckpt_dir: str) -> str | None:
    """The checkpoint directory to load from, or None to start fresh.

    ``none``: never. ``auto``: ``ckpt_dir`` if it has a ``latest`` tag. Otherwise a directory that
    must hold a ``latest`` tag.

    Raises:
        ConfigError: ``train.resume`` names a directory without a DeepSpeed checkpoint.
    """
    from megaformer.config import ConfigError

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


def _eval_batches(samples: GPTSamples, cfg: RunConfig, layout: Layout):
    """The validation micro-batches of this data-parallel rank, as (tokens, labels)."""
    mbs = cfg.train.micro_batch_size
    for b in range(cfg.train.eval_batches):
        yield micro_batch(samples, (b * layout.dp_size + layout.dp_rank) * mbs, mbs, layout.device)


def _train_batches(samples: GPTSamples, cfg: RunConfig, layout: Layout, step: int, gas: int):
    """Step ``step``'s ``gas`` micro-batches of this data-parallel rank, as (tokens, labels)."""
    t = cfg.train
    for micro in range(gas):
        first = step * t.global_batch_size + (micro * layout.dp_size + layout.dp_rank) * t.micro_batch_size
        yield micro_batch(samples, first, t.micro_batch_size, layout.device)


def evaluate(engine: Any, samples: GPTSamples, cfg: RunConfig, layout: Layout) -> float:
    """Mean validation loss (nats/token) over ``eval_batches`` micro-batches per data-parallel rank."""
    mbs = cfg.train.micro_batch_size
    if cfg.parallel.pp_size > 1:
        # Last stage's loss, averaged over the micro-batches and the data-parallel ranks, then
        # broadcast to every stage by DeepSpeed.
        loss = engine.eval_batch(
            _eval_batches(samples, cfg, layout), num_micro_batches=cfg.train.eval_batches
        )
        return float(loss)
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for b in range(cfg.train.eval_batches):
            first = (b * layout.dp_size + layout.dp_rank) * mbs
            tokens, labels = micro_batch(samples, first, mbs, layout.device)
            total += float(engine(tokens, labels))
    engine.train()
    return _mean_over_dp(total / cfg.train.eval_batches, layout)


def _count_parameters(model: torch.nn.Module, tp_size: int, state: ParallelState, count: Any) -> int:
    """Parameters of the whole model: this stage's, summed over the pipeline stages (the tied
    embedding's copy on the last stage, marked ``ds_pipe_replicated`` by DeepSpeed, counted once)."""
    if state.pp_size == 1:
        return count(model, tp_size)
    local = torch.nn.Module()
    local.params = torch.nn.ParameterList(
        p for p in model.parameters() if not getattr(p, "ds_pipe_replicated", False)
    )
    total = torch.tensor([count(local, tp_size)], dtype=torch.int64)
    dist.all_reduce(total, group=state.pp_group)
    return int(total.item())


def _init_weights_from(model: torch.nn.Module, cfg: RunConfig, state: ParallelState, layout: Layout) -> int:
    """Load ``train.init_from``'s module weights (saved at any tp / pp / dp layout) into this
    rank's model (its TP slice of its stage); return the checkpoint's step.

    Raises:
        ConfigError: a checkpoint of another model configuration.
    """
    from megaformer.config import ConfigError
    from megaformer.tools.reshard import consolidate, load_full, resolve_tag_dir

    tag_dir = resolve_tag_dir(cfg.train.init_from)
    # Only this rank's stage's parameters, memory-mapped: at 2.7B, 8 ranks of a node holding the
    # whole fp32 model each would need ~86 GB of host memory.
    full, saved, extra = consolidate(tag_dir, names={name for name, _ in model.named_parameters()})
    if saved["model"] != to_dict(cfg)["model"]:
        diff = {
            k: (v, to_dict(cfg)["model"][k])
            for k, v in saved["model"].items()
            if to_dict(cfg)["model"].get(k) != v
        }
        raise ConfigError(f"train.init_from='{cfg.train.init_from}': saved with another model config {diff}")
    load_full(model, full, cfg.model, state.tp_rank, state.tp_size)
    step = int(extra["step"] or 0)
    _log(
        layout,
        f"initialised weights from {tag_dir} (saved at tp {extra['tp_size']} × pp {extra['pp_size']}, "
        f"step {step}); continuing at step {step} with a fresh optimizer (AdamW moments restart at zero)",
    )
    return step


def _pipeline_fp32_clipping(engine: Any, state: ParallelState) -> None:
    """Replace the pipeline engine's fp32 gradient clipping (no ZeRO, no fp16/bf16 optimizer) by a
    correct one that also records the norm for ``engine.get_global_grad_norm()``.

    DeepSpeed 0.19's ``clip_grad_norm_`` counts a parameter that is not tensor-parallel only where
    the rank in its "model parallel" group (TP × PP) is 0, i.e. on the first stage alone: the later
    stages' blocks, norms and the tied embedding's copy drop out of the norm, so pp = 2 clipped
    with another norm than pp = 1. Here: each stage's TP-aware norm (the tied embedding's copy
    marked ``ds_pipe_replicated`` skipped), squares summed over the pipeline group, clip coefficient
    ``min(1, clip / (norm + 1e-6))`` as DeepSpeed's. The data-parallel all-reduce is already done.
    """
    max_norm = engine.gradient_clipping()
    tp_group = state.tp_group if state.tp_size > 1 else None

    def clip_and_record() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        owned = [p for p in params if not getattr(p, "ds_pipe_replicated", False)]
        square = torch.tensor([tp_grad_norm(owned, tp_group) ** 2], dtype=torch.float64)
        dist.all_reduce(square, group=state.pp_group)
        norm = float(square.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_record


def train(cfg: RunConfig) -> dict[str, Any]:
    """Run the configured pretraining job in this process (one of ``WORLD_SIZE``).

    Returns:
        The run summary (also written to ``<output.dir>/summary.json`` by rank 0).

    Raises:
        ConfigError: a layout the world size cannot satisfy (before any process group starts),
            or a ``train.resume`` without a checkpoint.
        DataFormatError: a missing or corrupt dataset.
    """
    import deepspeed

    from megaformer.model import count_parameters, param_groups
    from megaformer.pipeline import LMLoss, SequentialLM, build_pipeline_module, checkpointed, layer_specs

    t = cfg.train
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp_size = validate_layout(cfg, world_size)  # before any process group exists
    backend = pick_backend(cfg.parallel.backend)
    rank, world_size, local_rank = init_distributed(backend)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    par = cfg.parallel
    state = ParallelState.build(par.tp_size, par.pp_size, dp_size)
    layout = Layout(rank, world_size, local_rank, state.dp_rank, dp_size, device, dp_group=state.dp_group)

    run_dir = cfg.output.dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    tb_dir = os.path.join(run_dir, "tensorboard")
    load_dir = resolve_resume(cfg, ckpt_dir)
    if layout.is_main:
        os.makedirs(ckpt_dir, exist_ok=True)
        atomic_write_json(os.path.join(run_dir, "config.json"), to_dict(cfg))

    torch.manual_seed(t.seed)
    dropout_rng = DropoutRNG(
        t.seed, tp_rank=state.tp_rank, dp_rank=state.dp_rank, pp_rank=state.pp_rank, device=device
    )
    rng_layout = {
        "tp": cfg.parallel.tp_size,
        "pp": cfg.parallel.pp_size,
        "dp": dp_size,
        "tp_rank": state.tp_rank,
        "pp_rank": state.pp_rank,
        "dp_rank": state.dp_rank,
    }
    tp_group = state.tp_group if par.tp_size > 1 else None
    sequence_parallel = par.sequence_parallel and par.tp_size > 1
    pipelined = par.pp_size > 1
    if t.activation_checkpointing:
        from deepspeed.runtime.activation_checkpointing import checkpointing

        # Under TP the checkpointed block inputs are replicated across the TP group: keep only a
        # 1/tp slice per rank (all-gathered before recomputation). Sequence-parallel inputs are
        # already sliced and differ per rank, so they are stored whole.
        checkpointing.configure(
            state.mpu() if tp_group is not None else None,
            partition_activations=tp_group is not None and not sequence_parallel,
        )
    if pipelined:
        model = build_pipeline_module(
            cfg.model,
            topology=state.topology(),
            tp_group=tp_group,
            seed=t.seed,
            partition_method=par.partition_method,
            activation_checkpointing=t.activation_checkpointing,
            sequence_parallel=sequence_parallel,
            dropout_rng=dropout_rng,
        )
    else:
        model = SequentialLM(
            layer_specs(
                cfg.model,
                tp_group=tp_group,
                seed=t.seed,
                sequence_parallel=sequence_parallel,
                dropout_rng=dropout_rng,
            ),
            LMLoss(cfg.model, tp_group),
            checkpoint_fn=checkpointed(dropout_rng) if t.activation_checkpointing else None,
        )
    n_params = _count_parameters(model, par.tp_size, state, count_parameters)
    init_step = None
    if load_dir is None and t.init_from:
        init_step = _init_weights_from(model, cfg, state, layout)
    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps
    )
    scheduler = build_scheduler(optimizer, t)
    if init_step:
        import warnings

        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(init_step):
                scheduler.step()
    ds_config = build_deepspeed_config(cfg, dp_size)
    if t.precision == "fp16" and device.type == "cpu" and os.environ.get("MEGAFORMER_CPU_FP16") == "1":
        # DeepSpeed refuses fp16 on CPU ("Type fp16 is not supported on your device"); the tests set
        # this variable to run the fp16 path (FP16_Optimizer, dynamic loss scaling) on gloo anyway.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        # The pipeline engine builds its groups from the module's topology and takes no mpu.
        mpu=None if pipelined else state.mpu(),
        dist_init_required=False,
    )
    if pipelined and not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        _pipeline_fp32_clipping(engine, state)
    gas = engine.gradient_accumulation_steps()
    seq_len = cfg.model.seq_len
    _log(
        layout,
        f"model: {n_params:,} parameters | world {world_size} on {backend} | tp {par.tp_size}"
        f"{' (sequence parallel)' if par.sequence_parallel and par.tp_size > 1 else ''} | "
        f"pp {par.pp_size}{f' ({par.partition_method})' if pipelined else ''} | dp {dp_size} | "
        f"micro_batch_size {t.micro_batch_size} × grad accumulation {gas} × dp {dp_size} = "
        f"global_batch_size {t.global_batch_size} | seq_len {seq_len} | {t.precision} | ZeRO {t.zero_stage}",
    )

    train_samples, valid_samples, info = build_train_valid(
        cfg.data.prefix,
        seq_len,
        train_samples=t.steps * t.global_batch_size,
        valid_samples=t.eval_batches * t.micro_batch_size * dp_size,
        valid_fraction=cfg.data.valid_fraction,
        seed=t.seed,
        blend=cfg.data.blend,
        cache_dir=cfg.data.index_cache_dir or os.path.join(run_dir, "index_cache"),
    )
    _log(
        layout,
        f"data: {cfg.data.blend or cfg.data.prefix} | "
        f"train {info['train_documents']} docs / {info['train_tokens']:,} tokens | "
        f"valid {info['valid_documents']} docs / {info['valid_tokens']:,} tokens | "
        f"sample-index cache: {info['index_cache_hits']} hit, {info['index_cache_builds']} built",
    )

    start_step = 0
    if load_dir is not None:
        # One tag for every rank, read once: `latest` may move on if another job still writes there.
        tag = [None]
        if rank == 0:
            with open(os.path.join(load_dir, "latest"), encoding="utf-8") as f:
                tag[0] = f.read().strip()
        dist.broadcast_object_list(tag, src=0)
        path, client_state = engine.load_checkpoint(load_dir, tag=tag[0])
        if path is None:
            from megaformer.config import ConfigError

            raise ConfigError(f"train.resume: DeepSpeed could not load {tag[0]} from {load_dir}")
        start_step = int(client_state["step"])
        _log(layout, f"resumed from {path} at step {start_step}")
        restored, why = load_rng_state(os.path.join(load_dir, tag[0]), rank, rng_layout, dropout_rng, device)
        if not restored:  # from any rank: rank 0's line below speaks for the count only
            print(f"[megaformer] rank {rank}: {why}", flush=True)
        count = torch.tensor([int(restored)], dtype=torch.int64, device=device)
        dist.all_reduce(count)
        _log(layout, f"restored generator states on {int(count.item())}/{world_size} ranks")
    elif init_step is not None:
        start_step = init_step

    metrics = MetricsWriter(
        tb_dir, enabled=layout.is_main, hparams=to_dict(cfg), purge_step=start_step or None
    )
    tokens_per_step = t.global_batch_size * seq_len
    timer = StepTimer()
    started = time.perf_counter()
    valid_loss = math.nan
    last_saved = start_step if load_dir is not None else -1
    step_times: list[float] = []

    def save(step: int) -> None:
        client_state = {"step": step, "consumed_samples": step * t.global_batch_size, "config": to_dict(cfg)}
        # Before DeepSpeed's save, which writes the `latest` tag last: a checkpoint that `latest`
        # names always has every rank's generator state.
        save_rng_state(os.path.join(ckpt_dir, f"global_step{step}"), rank, rng_layout, dropout_rng, device)
        engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state=client_state)
        _log(layout, f"saved checkpoint {os.path.join(ckpt_dir, f'global_step{step}')}")

    for step in range(start_step, t.steps):
        loss_sum = 0.0
        grad_norm = None
        if pipelined:
            # Every stage gets the iterator; the first stage reads the tokens, the last the labels.
            loss_sum = gas * float(engine.train_batch(_train_batches(train_samples, cfg, layout, step, gas)))
        for tokens, labels in () if pipelined else _train_batches(train_samples, cfg, layout, step, gas):
            loss = engine(tokens, labels)
            engine.backward(loss)
            loss_sum += float(loss.detach())
            if engine.is_gradient_accumulation_boundary() and not (
                engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()
            ):
                grad_norm = _fp32_grad_norm(engine.module, state.tp_group)
            engine.step()
        if grad_norm is None:
            reported = engine.get_global_grad_norm()
            grad_norm = float(reported) if reported is not None else None
        step_time = timer.lap()
        step_times.append(step_time)
        done = step + 1
        # The pipeline engine's loss is already the data-parallel mean (on every stage).
        train_loss = loss_sum / gas if pipelined else _mean_over_dp(loss_sum / gas, layout)
        values = {
            "train/loss": train_loss,
            # the lr used by the update just taken (the scheduler has already advanced)
            "train/lr": lr_at(step, t),
            "train/grad_norm": grad_norm,
            "train/loss_scale": _loss_scale(engine),
            "train/tokens_per_s": tokens_per_step / step_time,
            "train/step_time_s": step_time,
        }
        metrics.scalars(done, values)
        if done % t.log_interval == 0 or done == t.steps or done == start_step + 1:
            _log(layout, format_step_line(done, t.steps, values))
        if done % t.eval_interval == 0 or done == t.steps:
            valid_loss = evaluate(engine, valid_samples, cfg, layout)
            metrics.scalars(done, {"valid/loss": valid_loss, "valid/ppl": math.exp(min(valid_loss, 50.0))})
            _log(
                layout,
                f"step {done}/{t.steps} | valid loss {valid_loss:.4f} | valid ppl {math.exp(valid_loss):.2f}",
            )
            metrics.flush()
        if t.save_interval and done % t.save_interval == 0 and done != t.steps:
            save(done)
            last_saved = done
        timer.lap()  # do not charge evaluation and checkpoints to the next step
    if last_saved != t.steps:
        save(t.steps)
    metrics.close()

    elapsed = time.perf_counter() - started
    # Median step time: robust to the first steps' warm-up and to evaluation pauses.
    median_step = float(np.median(step_times)) if step_times else math.nan
    summary = {
        "steps": t.steps,
        "resumed_from_step": start_step,
        "parameters": n_params,
        "world_size": world_size,
        "train_seconds": elapsed,
        "tokens_per_s": tokens_per_step / median_step if step_times else math.nan,
        "final_valid_loss": valid_loss,
        "final_valid_ppl": math.exp(valid_loss) if math.isfinite(valid_loss) else math.nan,
        "tensorboard_dir": os.path.abspath(tb_dir),
        "checkpoint_dir": os.path.abspath(os.path.join(ckpt_dir, f"global_step{t.steps}")),
    }
    if layout.is_main:
        summary["unigram_entropy"] = samples_unigram_entropy(train_samples)
        atomic_write_json(os.path.join(run_dir, "summary.json"), summary)
        _log(
            layout,
            f"done: {t.steps} steps in {elapsed:.1f} s | {summary['tokens_per_s']:,.0f} tokens/s | "
            f"valid loss {valid_loss:.4f} (ppl {summary['final_valid_ppl']:.2f}) vs unigram entropy "
            f"{summary['unigram_entropy']:.4f} nats",
        )
        _log(layout, f"TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
        _log(layout, f"checkpoint: {summary['checkpoint_dir']}")
    return summary
