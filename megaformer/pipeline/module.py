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
from megaformer.parallel.utils import derive_seed, tp_world_size

PARTITION_METHODS = ("parameters", "uniform", "type:NormFormerBlock")


class EmbeddingPipe(NormFormerEmbedding):
    """The first stage's embedding; on the last stage the same (tied) module projects to logits."""


def output_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Tied output projection: ``[B, T, d]`` -> this TP rank's logits ``[B, T, V_pad / tp]``.

    ``copy_to_tp_region`` makes the backward all-reduce the hidden-state gradient across the TP
    group (each rank saw only its vocabulary slice).
    """
    weight = embedding.token.weight  # (V_pad / tp, d)
    return F.linear(copy_to_tp_region(hidden, embedding.token.tp_group), weight)


class FinalNormPipe(nn.Module):
    """The LayerNorm before the output projection (replicated across TP ranks)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = replicated_layer_norm(config.hidden_size, config.layernorm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class OutputPipe(nn.Module):
    """Untied output projection (column-parallel over the padded vocabulary, no bias)."""

    def __init__(
        self, config: ModelConfig, *, tp_group: ProcessGroup | None = None, seed: int = 1234
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
    config: ModelConfig, *, tp_group: ProcessGroup | None = None, seed: int = 1234
) -> list[LayerSpec]:
    """The model as DeepSpeed layer specs (see the module docstring for the list)."""
    embed = dict(tp_group=tp_group, seed=seed)
    specs: list[LayerSpec] = [
        TiedLayerSpec("embed", EmbeddingPipe, config, **embed, tied_weight_attr="token.weight")
    ]
    specs += [
        LayerSpec(NormFormerBlock, config, i, tp_group=tp_group, seed=seed) for i in range(config.num_layers)
    ]
    specs.append(LayerSpec(FinalNormPipe, config))
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
        specs.append(LayerSpec(OutputPipe, config, tp_group=tp_group, seed=seed))
    return specs


class SequentialLM(nn.Module):
    """The layer list run in one process, without the pipeline engine (``parallel.pp_size = 1``).

    Tied specs with the same key share one module, as DeepSpeed's ``PipelineModule`` does.
    ``forward(tokens LongTensor[B, T], labels LongTensor[B, T] | None)`` returns the mean loss, or
    the vocab-sharded logits when ``labels`` is None (padded columns not masked).
    """

    def __init__(
        self, specs: list[LayerSpec], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.tied = nn.ModuleDict()
        self.layers = nn.ModuleList()
        self._forward_fns: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for spec in specs:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    self.tied[spec.key] = spec.build()
                module = self.tied[spec.key]
                fn = spec.forward_fn
                self._forward_fns.append(module if fn is None else (lambda x, m=module, f=fn: f(m, x)))
            else:
                module = spec.build()
                self.layers.append(module)
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
) -> PipelineModule:
    """A DeepSpeed ``PipelineModule`` over :func:`layer_specs` on ``topology``.

    Activation checkpointing (when on) wraps every :class:`NormFormerBlock` and never the embedding:
    checkpointing a layer whose input is an integer tensor fails in DeepSpeed (no gradient to carry).
    """
    return PipelineModule(
        layers=layer_specs(config, tp_group=tp_group, seed=seed),
        topology=topology,
        loss_fn=LMLoss(config, tp_group),
        partition_method=partition_method,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=["NormFormerBlock"],
    )
