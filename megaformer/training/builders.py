"""The parts a run is assembled from, each built by one function: layout, model, optimizer, data.

Order in :func:`megaformer.training.trainer.train`: preflight (no process group) -> :func:`build_layout`
(process groups) -> :func:`build_data` (sample indices; a data problem stops the run before the model
exists) -> :func:`build_model` -> :func:`build_optimizer` -> ``ds_adapter.initialize``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from data_tools.stats import mixture_unigram_entropy
from megaformer.config import RunConfig
from megaformer.data.gpt_dataset import WHOLE_HELDOUT, build_train_valid
from megaformer.data.heldout import build_heldout_data, ordered_samples
from megaformer.data.loader import valid_num_samples
from megaformer.data.mlm import as_masked_lm
from megaformer.model import (
    NormFormerLM,
    compile_blocks,
    compile_wanted,
    count_parameters,
    param_groups,
    set_selective_recompute,
    why_not_compiled,
)
from megaformer.parallel.comm import all_reduce_ints
from megaformer.parallel.layout import Layout, log
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.state import ParallelState
from megaformer.pipeline import build_pipeline_module, checkpointed, configure_recompute, pipe_topology
from megaformer.training.data_checks import index_seq_len
from megaformer.training.distributed import pick_backend
from megaformer.training.ds_adapter import init_distributed, is_pipe_replica
from megaformer.training.schedule import build_scheduler


def build_layout(cfg: RunConfig, dp_size: int) -> Layout:
    """Start the process groups (DeepSpeed's ``init_distributed``) and build the tp × pp × dp grid.

    The backend (``parallel.backend``; ``auto``: NCCL with CUDA, else gloo) was checked by the
    preflight. Every group gets ``parallel.timeout_minutes``.
    """
    import datetime

    par = cfg.parallel
    timeout = datetime.timedelta(minutes=par.timeout_minutes)  # every group: the world and ours
    backend = pick_backend(par.backend)
    rank, world_size, local_rank = init_distributed(backend, timeout)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    state = ParallelState.build(par.tp_size, par.pp_size, dp_size, timeout=timeout)
    return Layout(rank, world_size, local_rank, backend, device, state)


def build_model(cfg: RunConfig, layout: Layout, dropout_rng: DropoutRNG) -> torch.nn.Module:
    """The model of this rank: :class:`~megaformer.model.NormFormerLM` at pp = 1, else this stage of
    the DeepSpeed ``PipelineModule`` cut from the same layer plan. Moved to ``layout.device``.

    ``train.recompute`` (or ``train.activation_checkpointing``): ``full`` recomputes each block (under
    TP without sequence parallelism the saved block inputs are partitioned across the TP group);
    ``selective`` recomputes only each block's attention core. Also applies ``train.tf32`` and
    ``train.compile`` (:func:`compile_model`).
    """

    t, par = cfg.train, cfg.parallel
    tp_group = layout.tp_group
    sequence_parallel = par.sequence_parallel and par.tp_size > 1
    full = t.recompute_mode == "full"
    configure_tf32(t.tf32)
    if full:
        # Sequence-parallel block inputs are already sliced and differ per rank: stored whole.
        configure_recompute(
            layout.state.mpu() if tp_group is not None else None,
            partition_activations=tp_group is not None and not sequence_parallel,
        )
    common = dict(
        tp_group=tp_group, seed=t.seed, sequence_parallel=sequence_parallel, dropout_rng=dropout_rng
    )
    if par.pp_size > 1:
        model = build_pipeline_module(
            cfg.model,
            topology=pipe_topology(layout.state),
            partition_method=par.partition_method,
            activation_checkpointing=full,
            **common,
        )
    else:
        ckpt = checkpointed(dropout_rng) if full else None
        model = NormFormerLM(cfg.model, checkpoint_fn=ckpt, **common)
    if t.recompute_mode == "selective":
        set_selective_recompute(model)
    model = model.to(layout.device)
    compile_model(model, cfg, layout)
    return model


def compile_model(model: torch.nn.Module, cfg: RunConfig, layout: Layout) -> int:
    """``train.compile``: compile each decoder block in place (regional compilation,
    :func:`megaformer.model.compile_blocks`; ``auto`` = on for CUDA). Where it cannot work here
    (ZeRO-3, no compiler) or a block fails to compile, the blocks run eager and the log says why.
    The loss's cross-entropy is fused wherever inductor works, ZeRO-3 included
    (:func:`megaformer.parallel.vocab_parallel_cross_entropy` ``fused``). Returns the number of
    blocks compiled (0: eager)."""

    t = cfg.train
    if not compile_wanted(t.compile, layout.device):
        return 0
    if why_not_compiled(layout.device) is None:  # the loss has no ZeRO-3 hooks inside: fused at any stage
        losses = [m.loss_fn for m in model.modules() if hasattr(getattr(m, "loss_fn", None), "fused")]
        for loss_fn in losses:
            loss_fn.fused = True
        if losses:
            log(layout, f"train.compile={t.compile}: the cross-entropy runs as two fused kernels")
    reason = why_not_compiled(layout.device, zero_stage=t.zero_stage)
    if reason is not None:
        log(layout, f"train.compile={t.compile}: the blocks run eager: {reason}")
        return 0
    n = compile_blocks(model, log=lambda message: log(layout, message))
    log(layout, f"train.compile={t.compile}: {n} blocks compiled with inductor (on the first step)")
    return n


def count_parameters_global(model: torch.nn.Module, layout: Layout) -> int:
    """Parameters of the whole model (every TP shard and pipeline stage), the same on every rank.

    Sharded parameters count ``tp`` times (:func:`megaformer.model.count_parameters`); this stage's
    counts are summed over the pipeline group, the tied embedding's copy on the last stage (marked
    ``ds_pipe_replicated`` by DeepSpeed) counted once. The sum is a collective on the group's
    communication device.
    """

    state = layout.state
    local = torch.nn.Module()
    local.params = torch.nn.ParameterList(p for p in model.parameters() if not is_pipe_replica(p))
    count = count_parameters(local, state.tp_size)
    if state.pp_size == 1:
        return count
    return all_reduce_ints([count], group=state.pp_group)[0]


def adamw_implementation(model: torch.nn.Module) -> dict[str, bool]:
    """``torch.optim.AdamW``'s implementation switch for ``model``'s parameters: ``fused=True`` (one
    kernel per step for all parameters) when they are all on CUDA, ``foreach=True`` (multi-tensor
    ops; bitwise-equal to the per-parameter loop on CPU, a test) otherwise. DeepSpeed steps this
    optimizer on its own fp32 master copies / ZeRO partitions, which live on the same device."""
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    return {"fused": True} if on_cuda else {"foreach": True}


def configure_tf32(enabled: bool) -> None:
    """``train.tf32``: let fp32 matmuls and cuDNN convolutions use TF32 tensor cores (Ampere and
    newer; no effect on CPUs and older GPUs)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def build_optimizer(
    model: torch.nn.Module,
    cfg: RunConfig,
    start_step: int,
    schedule: Any = None,
    param_order: str = "aligned",
) -> tuple[Any, Any]:
    """AdamW (weight decay on the parameters ``train.weight_decay_params`` names: by default none on
    biases, norms and scales) and a LambdaLR following ``schedule``
    (:class:`~megaformer.training.schedule.Schedule`, default over ``train.steps``), advanced to
    ``start_step`` (for ``train.init_from``; a resume restores DeepSpeed's state).

    ``param_order``: the order of each group's parameters (:func:`megaformer.model.param_groups`):
    ``"aligned"`` for a new run; a resumed run takes the order its checkpoint was saved in
    (:func:`~megaformer.checkpoint.manager.saved_param_order`), since DeepSpeed's flat optimizer
    state follows it."""

    t = cfg.train
    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay, t.weight_decay_params, param_order),
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        **adamw_implementation(model),
    )
    scheduler = build_scheduler(optimizer, t, schedule)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start_step):
            scheduler.step()
    return optimizer, scheduler


@dataclass
class Data:
    """The run's training and validation samples and how this rank reads them."""

    train: Any
    """Indexable samples (``GPTSamples`` / ``BlendedSamples``), int64[seq_len + 1] each; under
    ``model.objective`` mlm ``MaskedLMSamples`` (or a blend of them), ``(input_ids, labels)`` each."""
    valid: Any
    info: dict
    unigram_entropy: float
    """Of the data the run reads (a blend: of its mixture), from the dataset sidecars (nats)."""
    test: Any = None
    """Test samples (data.test_prefix or data.split's test range), evaluated after the last step."""


def build_data(cfg: RunConfig, layout: Layout, stats: list, datasets: list[tuple[float, str]]) -> Data:
    """Open the datasets and build (or load from the cache) the sample indices, once per node.

    Each node's local rank 0 builds the indices into ``data.index_cache_dir`` (or finds them
    there) while the node's other ranks wait at a barrier; they then load them from the cache,
    memory-mapped (Megatron-LM builds its indices on one rank and has the others wait the same
    way). So a slow first build (minutes at 300B tokens) costs one rank's CPU and memory per node
    instead of every rank's, and the waiting ranks sit in a barrier under ``parallel.timeout_minutes``
    rather than in an NCCL collective. Where the cache cannot be written (a warning), the others
    build for themselves after the barrier, as before. Every rank gets the same indices.

    Validation reads the first ``eval_batches × global_batch_size`` held-out samples, the same at
    any data-parallel size.

    Raises:
        DataFormatError: too little held-out data for one evaluation, or a corrupt dataset.
    """
    import torch.distributed as dist

    together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not together:
        return _build_data(cfg, stats, datasets)
    data, error = None, None
    if layout.local_rank == 0:
        try:
            data = _build_data(cfg, stats, datasets)
        except Exception as e:  # still meet the others at the barrier: they fail the same way after
            error = e
    dist.barrier()  # the node's (and every node's) local rank 0 has written the indices
    if error is not None:
        raise error
    return data if data is not None else _build_data(cfg, stats, datasets)


def _build_data(cfg: RunConfig, stats: list, datasets: list[tuple[float, str]]) -> Data:
    """:func:`build_data` in this process alone."""

    t = cfg.train
    test = None
    eval_samples = valid_num_samples(t.eval_batches, t.global_batch_size)
    cache_dir = cfg.data.index_cache_dir or os.path.join(cfg.output.dir, "index_cache")
    mlm = cfg.model.objective == "mlm"
    # The masked LM's blocks are <s> + seq_len - 1 stream tokens: cut from causal samples of
    # seq_len - 1 (megaformer.data.mlm), wrapped below.
    seq_len = index_seq_len(cfg)
    if cfg.data.split or cfg.data.valid_prefix:
        train, valid, test, info = build_heldout_data(
            pairs=datasets,
            split=cfg.data.split,
            valid_prefix=cfg.data.valid_prefix,
            test_prefix=cfg.data.test_prefix,
            seq_len=seq_len,
            train_samples=t.steps * t.global_batch_size,
            eval_samples=_valid_samples(cfg, eval_samples),
            seed=t.seed,
            cache_dir=cache_dir,
        )
    else:
        train, valid, info = _train_valid(cfg, seq_len, _valid_samples(cfg, eval_samples), cache_dir)
        if cfg.data.test_prefix:
            test = ordered_samples(
                cfg.data.test_prefix, seq_len, eval_samples, key="data.test_prefix", seed=t.seed
            )
    if mlm:
        # held-out masks follow the held-out documents' seed: with data.split_seed set, runs of
        # several train.seed values are scored on the same masked positions too
        train, valid = as_masked_lm(train, seed=t.seed), as_masked_lm(valid, seed=cfg.split_seed)
        test = None if test is None else as_masked_lm(test, seed=cfg.split_seed)
    if len(stats) == 1:
        entropy = stats[0].unigram_entropy
    else:
        shares = [b["train_samples"] for b in info["blend"]]
        entropy = mixture_unigram_entropy(stats, [s / sum(shares) for s in shares])
    return Data(train, valid, info, entropy, test)


def _valid_samples(cfg: RunConfig, eval_samples: int) -> int:
    """Held-out samples to build: what the regular validations read, or more for the final one
    (``train.final_eval_batches``; 0 = :data:`~megaformer.data.gpt_dataset.WHOLE_HELDOUT`)."""

    t = cfg.train
    if t.final_eval_batches == 0:
        return WHOLE_HELDOUT
    return max(eval_samples, t.final_eval_batches * t.global_batch_size)


def _train_valid(cfg: RunConfig, seq_len: int, eval_samples: int, cache_dir: str) -> tuple[Any, Any, dict]:
    """Training samples of ``seq_len + 1`` tokens and ``data.valid_fraction`` of its documents held
    out for validation."""

    t = cfg.train
    return build_train_valid(
        cfg.data.prefix,
        seq_len,
        train_samples=t.steps * t.global_batch_size,
        valid_samples=eval_samples,
        valid_fraction=cfg.data.valid_fraction,
        seed=t.seed,
        split_seed=cfg.split_seed,
        blend=cfg.data.blend,
        cache_dir=cache_dir,
    )
