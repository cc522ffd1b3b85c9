"""The training loop: model + AdamW + schedule into ``deepspeed.initialize``, data, metrics, checkpoints.

One optimizer step = ``global_batch_size`` samples: each data-parallel rank runs
``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` samples through the DeepSpeed
engine, which averages gradients over the data-parallel group, clips, scales (fp16) and steps.

Under tensor parallelism (``parallel.tp_size`` > 1) the world is a ``tp × pp × dp`` grid
(:class:`~megaformer.parallel.state.ParallelState`): the ranks of one TP group read the same samples
and hold slices of one model; data is sharded over the data-parallel rank only, and the state is
DeepSpeed's ``mpu``, so gradients are averaged (and ZeRO partitions) over the data-parallel group.

The samples of step ``s`` are fixed by ``(seed, s)``: on resume the loop continues with exactly the
samples it would have seen.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megaformer.config import RunConfig, to_dict, validate_layout
from megaformer.data.gpt_dataset import GPTSamples, build_train_valid, unigram_entropy
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.state import ParallelState
from megaformer.parallel.utils import grad_norm as tp_grad_norm
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.distributed import init_distributed, pick_backend
from megaformer.training.metrics import MetricsWriter, StepTimer, format_step_line
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


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


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


def evaluate(engine: Any, samples: GPTSamples, cfg: RunConfig, layout: Layout) -> float:
    """Mean validation loss (nats/token) over ``eval_batches`` micro-batches per data-parallel rank."""
    mbs = cfg.train.micro_batch_size
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for b in range(cfg.train.eval_batches):
            first = (b * layout.dp_size + layout.dp_rank) * mbs
            tokens, labels = micro_batch(samples, first, mbs, layout.device)
            total += float(engine(tokens, labels))
    engine.train()
    return _mean_over_dp(total / cfg.train.eval_batches, layout)


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

    from megaformer.model import NormFormerLM, count_parameters, param_groups

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
        _atomic_write_text(os.path.join(run_dir, "config.json"), json.dumps(to_dict(cfg), indent=2) + "\n")

    torch.manual_seed(t.seed)
    dropout_rng = DropoutRNG(
        t.seed, tp_rank=state.tp_rank, dp_rank=state.dp_rank, pp_rank=state.pp_rank, device=device
    )
    model = NormFormerLM(
        cfg.model,
        tp_group=state.tp_group if par.tp_size > 1 else None,
        seed=t.seed,
        sequence_parallel=par.sequence_parallel,
        dropout_rng=dropout_rng,
    )
    n_params = count_parameters(model, par.tp_size)
    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps
    )
    scheduler = build_scheduler(optimizer, t)
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
        mpu=state.mpu(),
        dist_init_required=False,
    )
    gas = engine.gradient_accumulation_steps()
    seq_len = cfg.model.seq_len
    _log(
        layout,
        f"model: {n_params:,} parameters | world {world_size} on {backend} | tp {par.tp_size}"
        f"{' (sequence parallel)' if par.sequence_parallel and par.tp_size > 1 else ''} | dp {dp_size} | "
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
        f"valid {info['valid_documents']} docs / {info['valid_tokens']:,} tokens",
    )

    start_step = 0
    if load_dir is not None:
        path, client_state = engine.load_checkpoint(load_dir)
        if path is None:
            from megaformer.config import ConfigError

            raise ConfigError(f"train.resume: DeepSpeed could not load a checkpoint from {load_dir}")
        start_step = int(client_state["step"])
        _log(layout, f"resumed from {path} at step {start_step}")

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
        engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state=client_state)
        _log(layout, f"saved checkpoint {os.path.join(ckpt_dir, f'global_step{step}')}")

    for step in range(start_step, t.steps):
        loss_sum = 0.0
        grad_norm = None
        for micro in range(gas):
            first = step * t.global_batch_size + (micro * dp_size + layout.dp_rank) * t.micro_batch_size
            tokens, labels = micro_batch(train_samples, first, t.micro_batch_size, device)
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
        train_loss = _mean_over_dp(loss_sum / gas, layout)
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
        summary["unigram_entropy"] = unigram_entropy(train_samples.dataset)
        _atomic_write_text(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2) + "\n")
        _log(
            layout,
            f"done: {t.steps} steps in {elapsed:.1f} s | {summary['tokens_per_s']:,.0f} tokens/s | "
            f"valid loss {valid_loss:.4f} (ppl {summary['final_valid_ppl']:.2f}) vs unigram entropy "
            f"{summary['unigram_entropy']:.4f} nats",
        )
        _log(layout, f"TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
        _log(layout, f"checkpoint: {summary['checkpoint_dir']}")
    return summary
