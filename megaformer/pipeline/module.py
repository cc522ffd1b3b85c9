"""The NormFormer LM as a list of layers: a DeepSpeed ``PipelineModule`` for pp > 1, a plain
sequential module for pp = 1, built from the same :class:`~deepspeed.pipe.LayerSpec` list.

Layer list (one spec per entry, so DeepSpeed can cut stages anywhere between blocks)::

    TiedLayerSpec("embed", EmbeddingPipe)            tokens [B, T] -> hidden [B, T, d]   (first stage)
    LayerSpec(NormFormerBlock, i)  × num_layers      hidden -> hidden
    LayerSpec(FinalNormPipe)                         hidden -> normalised hidden
    TiedLayerSpec("embed", EmbeddingPipe, forward_fn=output_logits)
                                                     hidden -> vocab-sharded logits      (last stage)
    loss_fn = LMLoss                                 logits, labels -> mean cross-entropy

With untied embeddings the last entry is an :class:`OutputPipe` instead. Every parameter is drawn
from a generator seeded by the base seed and its name (see :mod:`megaformer.parallel.utils`), so the
same seed gives the same weights however the layers are split into stages or shards.

Parameter names are the same with and without the engine: ``tied_modules.embed.<name>`` for the
tied embedding and ``<layer index>.<name>`` for every other layer (DeepSpeed's ``PipelineModule``
naming; :class:`SequentialLM` registers its layers the same way), so one mapping serves checkpoints
of every (tp, pp, dp) layout (see :mod:`megaformer.tools.reshard`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.distributed import ProcessGroup

from megaformer.config.schema import ModelConfig
from megaformer.model.normformer import NormFormerBlock, NormFormerEmbedding, replicated_layer_norm
from megaformer.parallel import ColumnParallelLinear, copy_to_tp_region, vocab_parallel_cross_entropy
from megaformer.parallel.mappings import gather_from_sequence_region
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.utils import derive_seed, tp_world_size

PARTITION_METHODS = ("parameters", "uniform", "type:NormFormerBlock")


class EmbeddingPipe(NormFormerEmbedding):
    """The first stage's embedding; on the last stage the same (tied) module projects to logits."""


def output_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Tied output projection: ``[B, T, d]`` (``[B, T / tp, d]`` with sequence parallelism) -> this
    TP rank's logits ``[B, T, V_pad / tp]``.

    ``copy_to_tp_region`` makes the backward all-reduce the hidden-state gradient across the TP
    group (each rank saw only its vocabulary slice); under sequence parallelism the all-gather of
    the sequence slices does that job (its backward is a reduce-scatter).
    """
    weight = embedding.token.weight  # (V_pad / tp, d)
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_region(hidden, embedding.tp_group)  # (B, T, d)
    else:
        hidden = copy_to_tp_region(hidden, embedding.tp_group)
    return F.linear(hidden, weight)


class FinalNormPipe(nn.Module):
    """The LayerNorm before the output projection (replicated across TP ranks)."""

    def __init__(
        self, config: ModelConfig, *, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        sp = sequence_parallel and tp_world_size(tp_group) > 1
        self.norm = replicated_layer_norm(
            config.hidden_size, config.layernorm_eps, tp_group=tp_group, sequence_parallel=sp
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class OutputPipe(nn.Module):
    """Untied output projection (column-parallel over the padded vocabulary, no bias)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(
            config.hidden_size,
            config.padded_vocab_size(tp_world_size(tp_group)),
            tp_group=tp_group,
            bias=False,
            init_std=config.init_std,
            seed=derive_seed(seed, "output"),
            num_valid_out_features=config.vocab_size,
            sequence_parallel=sequence_parallel and tp_world_size(tp_group) > 1,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


class LMLoss:
    """Mean next-token cross-entropy (nats) of vocabulary-sharded logits; padded columns masked.

    Called as ``loss_fn(logits_local [B, T, V_pad/tp], labels LongTensor[B, T]) -> float32 scalar``.
    """

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None) -> None:
        self.vocab_size = config.vocab_size
        self.tp_group = tp_group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits, labels, self.tp_group, self.vocab_size, inplace=True
        ).mean()


def layer_specs(
    config: ModelConfig,
    *,
    tp_group: ProcessGroup | None = None,
    seed: int = 1234,
    sequence_parallel: bool = False,
    dropout_rng: DropoutRNG | None = None,
) -> list[LayerSpec]:
    """The model as DeepSpeed layer specs (see the module docstring for the list).

    ``sequence_parallel`` and ``dropout_rng`` are passed to the layers as in
    :class:`~megaformer.model.NormFormerLM` (one ``dropout_rng`` object shared by every block).
    """
    sp = sequence_parallel and tp_world_size(tp_group) > 1
    embed = dict(tp_group=tp_group, seed=seed, sequence_parallel=sp)
    specs: list[LayerSpec] = [
        TiedLayerSpec("embed", EmbeddingPipe, config, **embed, tied_weight_attr="token.weight")
    ]
    specs += [
        LayerSpec(
            NormFormerBlock,
            config,
            i,
            tp_group=tp_group,
            seed=seed,
            sequence_parallel=sp,
            dropout_rng=dropout_rng,
        )
        for i in range(config.num_layers)
    ]
    specs.append(LayerSpec(FinalNormPipe, config, tp_group=tp_group, sequence_parallel=sp))
    if config.tie_embeddings:
        specs.append(
            TiedLayerSpec(
                "embed",
                EmbeddingPipe,
                config,
                **embed,
                forward_fn=output_logits,
                tied_weight_attr="token.weight",
            )
        )
    else:
        specs.append(LayerSpec(OutputPipe, config, **embed))
    return specs


def vocab_param_names(config: ModelConfig) -> tuple[str, ...]:
    """Names (layer-list naming) of the parameters whose dim 0 is the padded vocabulary."""
    names = ["tied_modules.embed.token.weight"]
    if not config.tie_embeddings:
        names.append(f"{config.num_layers + 2}.proj.weight")
    return tuple(names)


def checkpointed(
    dropout_rng: DropoutRNG | None, checkpoint_fn: Callable | None = None
) -> Callable[..., torch.Tensor]:
    """An activation-checkpointing function (``checkpoint(run, *inputs)``) that replays dropout.

    DeepSpeed's checkpoint restores the default generators before the recomputation, but the
    blocks draw dropout from our :class:`DropoutRNG`, which keeps its own states: they are
    snapshotted before the first forward and put back for the recomputation (then advanced again),
    so the recomputed masks equal the original ones.
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
            after = dropout_rng.state_dict()
            dropout_rng.load_state_dict(snapshot)
            try:
                return run(*args)
            finally:
                dropout_rng.load_state_dict(after)

        return base(replay, *inputs)

    return checkpoint


class SequentialLM(nn.Module):
    """The layer list run in one process, without the pipeline engine (``parallel.pp_size = 1``).

    Tied specs with the same key share one module (``tied_modules.<key>``), other layers are
    registered under their index in the list, as DeepSpeed's ``PipelineModule`` does, so the
    parameter names equal the pipeline's. ``forward(tokens LongTensor[B, T], labels LongTensor[B, T]
    | None)`` returns the mean loss, or the vocab-sharded logits when ``labels`` is None (padded
    columns not masked). With ``checkpoint_fn`` (see :func:`checkpointed`) every
    :class:`NormFormerBlock` is activation-checkpointed; the embedding never is.
    """

    def __init__(
        self,
        specs: list[LayerSpec],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        checkpoint_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self._forward_fns: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for idx, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                fn = spec.forward_fn
                self._forward_fns.append(module if fn is None else (lambda x, m=module, f=fn: f(m, x)))
            else:
                module = spec.build()
                self.add_module(str(idx), module)
                if checkpoint_fn is not None and isinstance(module, NormFormerBlock):
                    self._forward_fns.append(lambda x, m=module: checkpoint_fn(m, x) if m.training else m(x))
                else:
                    self._forward_fns.append(module)
        self.loss_fn = loss_fn

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = tokens
        for fn in self._forward_fns:
            x = fn(x)
        return x if labels is None else self.loss_fn(x, labels)


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
    """A DeepSpeed ``PipelineModule`` over :func:`layer_specs` on ``topology``.

    Activation checkpointing (when on) wraps every :class:`NormFormerBlock` and never the embedding:
    checkpointing a layer whose input is an integer tensor fails in DeepSpeed (no gradient to carry).
    """
    return PipelineModule(
        layers=layer_specs(
            config, tp_group=tp_group, seed=seed, sequence_parallel=sequence_parallel, dropout_rng=dropout_rng
        ),
        topology=topology,
        loss_fn=LMLoss(config, tp_group),
        partition_method=partition_method,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=checkpointed(dropout_rng),
        checkpointable_layers=["NormFormerBlock"],
    )
