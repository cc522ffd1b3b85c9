"""The model as a DeepSpeed ``PipelineModule``: stages cut from the model's one layer plan.

:func:`~megaformer.model.model_layers` lists the model (embedding, one block per layer, final norm,
tied or untied output projection); :func:`layer_specs` turns each entry into a DeepSpeed spec,
nothing more::

    LayerDef(NormFormerEmbedding, tied_key="embed")     -> TiedLayerSpec("embed", NormFormerEmbedding)
    LayerDef(NormFormerBlock, i)   × num_layers         -> LayerSpec(NormFormerBlock, i)
    LayerDef(FinalNorm)                                 -> LayerSpec(FinalNorm)
    LayerDef(NormFormerEmbedding, tied_key="embed", forward_fn=tied_output_logits)
                                                        -> TiedLayerSpec("embed", ..., forward_fn=...)
      (untied: LayerDef(OutputProjection)               -> LayerSpec(OutputProjection))
    loss_fn = LMLoss                                    logits, labels -> mean cross-entropy

DeepSpeed can cut stages between any two entries (``parallel.partition_method``). A stage registers
the tied embedding as ``tied_modules.embed`` and every other layer under its index in the list, as
:class:`~megaformer.model.NormFormerLM` does, so a stage's parameters carry the names (and, from
the same seed, the values) of the same parameters of the whole model, and one mapping serves
checkpoints of every (tp, pp, dp) layout (see :mod:`megaformer.checkpoint.reshard`). At pp = 1 the trainer
uses :class:`~megaformer.model.NormFormerLM` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch.distributed import ProcessGroup

from megaformer.config.schema import ModelConfig
from megaformer.model import LayerDef, NormFormerBlock, lm_loss, model_layers, vocab_param_names
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.utils import tp_rank

PARTITION_METHODS = ("parameters", "uniform", f"type:{NormFormerBlock.__name__}")

__all__ = [
    "PARTITION_METHODS",
    "build_pipeline_module",
    "checkpointed",
    "configure_recompute",
    "layer_spec",
    "layer_specs",
    "pipe_topology",
    "vocab_param_names",
]


def pipe_topology(state: Any) -> Any:
    """DeepSpeed's ``PipeModelDataParallelTopology`` of a :class:`~megaformer.parallel.state.ParallelState`.

    Given to the ``PipelineModule``, whose engine builds its own groups from it (the engine takes
    no ``mpu`` with pipelines): the same rank layout as megaformer's groups.

    Raises:
        AssertionError: DeepSpeed lays this rank out differently from
            :func:`megaformer.parallel.state.rank_of` (a DeepSpeed change; the groups would disagree).
    """
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=state.pp_size, num_mp=state.tp_size, num_dp=state.dp_size)
    coord = topo.get_coord(state.rank)
    assert (coord.pipe, coord.data, coord.model) == (state.pp_rank, state.dp_rank, state.tp_rank), (
        f"DeepSpeed places rank {state.rank} at {coord}, megaformer at "
        f"pipe={state.pp_rank} data={state.dp_rank} model={state.tp_rank}"
    )
    return topo


def configure_recompute(mpu: Any, partition_activations: bool) -> None:
    """Configure DeepSpeed's activation checkpointing (``train.recompute_mode=full``) once per process.

    Args:
        mpu: the model-parallel unit (``ParallelState.mpu()``) at tp > 1, else None.
        partition_activations: split each stored block input over the TP group (False with
            sequence parallelism, whose block inputs are already sliced and differ per rank).
    """
    from deepspeed.runtime.activation_checkpointing import checkpointing

    checkpointing.configure(mpu, partition_activations=partition_activations)


def layer_spec(layer: LayerDef) -> LayerSpec:
    """The DeepSpeed spec of one plan entry: a ``TiedLayerSpec`` for a tied entry (same key,
    ``forward_fn`` and ``tied_weight_attr``), else a ``LayerSpec``; same class and arguments."""
    if layer.tied_key is not None:
        return TiedLayerSpec(
            layer.tied_key,
            layer.module,
            *layer.args,
            forward_fn=layer.forward_fn,
            tied_weight_attr=layer.tied_weight_attr,
            **layer.kwargs,
        )
    return LayerSpec(layer.module, *layer.args, **layer.kwargs)


def layer_specs(
    config: ModelConfig,
    *,
    tp_group: ProcessGroup | None = None,
    seed: int = 1234,
    sequence_parallel: bool = False,
    dropout_rng: DropoutRNG | None = None,
) -> list[LayerSpec]:
    """:func:`~megaformer.model.model_layers`'s plan as DeepSpeed specs, entry for entry (same
    arguments; see there). Raises what ``model_layers`` raises."""
    plan = model_layers(
        config, tp_group=tp_group, seed=seed, sequence_parallel=sequence_parallel, dropout_rng=dropout_rng
    )
    return [layer_spec(layer) for layer in plan]


def checkpointed(
    dropout_rng: DropoutRNG | None, checkpoint_fn: Callable | None = None
) -> Callable[..., torch.Tensor]:
    """An activation-checkpointing function (``checkpoint(run, *inputs)``) that replays dropout.

    DeepSpeed's checkpoint restores the default generators before the recomputation, but the
    blocks draw dropout from our :class:`DropoutRNG`, which keeps its own states: they are
    snapshotted before the first forward and put back for the recomputation (then advanced again),
    so the recomputed masks equal the original ones.

    Args:
        dropout_rng: the very object the blocks draw from (``NormFormerLM(dropout_rng=...)`` /
            :func:`build_pipeline_module`'s); None: nothing to replay.
        checkpoint_fn: the underlying ``checkpoint(run, *inputs)``; default DeepSpeed's
            ``activation_checkpointing.checkpointing.checkpoint``.

    Returns:
        ``checkpoint(run, *inputs)`` returning ``run(*inputs)`` (e.g. a block's ``[B, T, d]`` output),
        usable as ``NormFormerLM(checkpoint_fn=...)`` and as the pipeline's checkpoint function.
    """
    from deepspeed.runtime.activation_checkpointing import checkpointing

    base = checkpoint_fn or checkpointing.checkpoint

    def checkpoint(run: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if dropout_rng is None:
            return base(run, *inputs)
        snapshot = dropout_rng.state_dict()

        def replay(*args: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():  # the first (no-grad) forward
                return run(*args)
            with dropout_rng.replaying(snapshot):
                return run(*args)

        return base(replay, *inputs)

    return checkpoint


def build_pipeline_module(
    config: ModelConfig,
    *,
    topology,
    tp_group: ProcessGroup | None,
    seed: int,
    partition_method: str = "parameters",
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    dropout_rng: DropoutRNG | None = None,
) -> PipelineModule:
    """A DeepSpeed ``PipelineModule`` over :func:`layer_specs` on ``topology``: this rank builds
    only its stage's layers.

    Args:
        config: the model configuration.
        topology: DeepSpeed's ``ProcessTopology`` of the job (axes pipe, data, model).
        tp_group, seed, sequence_parallel, dropout_rng: as :class:`~megaformer.model.NormFormerLM`.
        partition_method: one of :data:`PARTITION_METHODS` (DeepSpeed's stage balancing).
        activation_checkpointing: recompute every :class:`NormFormerBlock` in the backward (never
            the embedding: checkpointing a layer whose input is an integer tensor fails in
            DeepSpeed, there is no gradient to carry); dropout masks are replayed (:func:`checkpointed`).

    Returns:
        The stage's module: ``forward(x)`` runs its layers; ``loss_fn`` (:class:`~megaformer.model.LMLoss`)
        turns the last stage's logits ``[B, T, V_pad/tp]`` and labels into the mean loss.

    Raises:
        ConfigError: what :func:`~megaformer.model.model_layers` raises.
        NotImplementedError: an unknown ``partition_method`` (from DeepSpeed).
    """
    # The blocks and the recomputation must see the same generator object to replay its masks.
    dropout_rng = dropout_rng or DropoutRNG(seed, tp_rank=tp_rank(tp_group))
    module = PipelineModule(
        layers=layer_specs(
            config, tp_group=tp_group, seed=seed, sequence_parallel=sequence_parallel, dropout_rng=dropout_rng
        ),
        topology=topology,
        loss_fn=lm_loss(config, tp_group),
        partition_method=partition_method,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=checkpointed(dropout_rng),
        checkpointable_layers=[NormFormerBlock.__name__],
    )
    # The masked LM's head is tied between the first and the last stage (embedding_tied_weights):
    # the first stage's copy, which only embeds, must give zero gradients for it, not None.
    tied = getattr(module, "tied_modules", {})
    if "embed" in tied and module.stage_id == 0:
        tied["embed"].head_grads_here = True
    return module
