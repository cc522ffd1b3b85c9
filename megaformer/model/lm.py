"""The NormFormer LM: one declarative layer plan, one module tree built from it.

:func:`model_layers` is the only listing of the model. Each entry (a :class:`LayerDef`) is a module
class with its constructor arguments, and for the tied input / output embedding a key shared by both
ends::

    0            LayerDef(NormFormerEmbedding, tied_key="embed")     tokens [B, T] -> hidden [B, T, d]
    1 .. L       LayerDef(NormFormerBlock, i)   (i = 0 .. L-1)       hidden -> hidden
    L + 1        LayerDef(FinalNorm)                                 hidden -> normalised hidden
                 (identity, no parameters, under norm_scheme post_ln / deepnorm)
    L + 2        LayerDef(NormFormerEmbedding, tied_key="embed", forward_fn=tied_output_logits)
                                                                     hidden -> logits [B, T, V_pad/tp]
                 (untied: LayerDef(OutputProjection); model.objective mlm: forward_fn=masked_lm_logits,
                 RoBERTa's LM head, whose parameters the embedding module holds as lm_head.*; with
                 model.mlm_head_positions masked: forward_fn=masked_lm_features, the head's features
                 and the decoder's weights, which the loss decodes at the masked positions only)
    loss         LMLoss                                              logits, labels -> mean cross-entropy
                 (model.objective mlm: MaskedLMLoss, the masked positions only)

(``L`` = ``num_layers``; with sequence parallelism ``hidden`` is ``[B, T / tp, d]``.)

:class:`NormFormerLM` builds the plan in one process. Tied entries share one module registered as
``tied_modules.<key>``; every other entry is registered under its index in the list. That is exactly
DeepSpeed ``PipelineModule``'s naming, so the parameter names (``tied_modules.embed.token.weight``,
``1.qkv.weight``, ..., ``<L+1>.norm.weight``, ``<L+2>.proj.weight``) are the checkpoint's at every
(tp, pp, dp) layout, and :mod:`megaformer.pipeline` cuts pipeline stages from the same plan (one
``LayerSpec`` per entry). Every parameter is drawn from a generator seeded by the base seed and its
seed name (see :mod:`megaformer.model.normformer`), so the same seed gives bitwise the same weights
however the plan is split into stages or TP shards.

This module imports no DeepSpeed: the pipeline adapter does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megaformer.config.load import check_model_config
from megaformer.config.schema import ModelConfig
from megaformer.model.normformer import (
    FinalNorm,
    MaskedLMFeatures,
    NormFormerBlock,
    NormFormerEmbedding,
    OutputProjection,
    lm_loss,
    masked_lm_features,
    masked_lm_logits,
    tied_output_logits,
)
from megaformer.parallel import mask_padded_vocab
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.utils import tp_rank, tp_world_size


@dataclass(frozen=True)
class LayerDef:
    """One entry of the layer plan: how to build one layer and how to call it.

    Attributes:
        module: the ``nn.Module`` class.
        args, kwargs: its constructor arguments (``module(*args, **kwargs)``).
        tied_key: entries with the same key share ONE module (built from the first of them), as
            DeepSpeed's ``TiedLayerSpec``; None for an ordinary layer.
        forward_fn: for a tied entry, ``forward_fn(module, x)`` is called instead of ``module(x)``
            (the tied output projection reads the embedding's weight).
        tied_weight_attr: for a tied entry, the dotted name of the shared weight, or a tuple of
            them (DeepSpeed all-reduces their gradients between the stages that hold a copy and
            broadcasts them from the first such stage after a load).

    Raises:
        ValueError: a ``forward_fn`` or ``tied_weight_attr`` on an untied entry, or a tied entry
            without ``tied_weight_attr`` (DeepSpeed's ``LayerSpec`` has no such fields).
    """

    module: type[nn.Module]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    tied_key: str | None = None
    forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    tied_weight_attr: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.tied_key is None and (self.forward_fn is not None or self.tied_weight_attr is not None):
            raise ValueError(f"{self.module.__name__}: forward_fn / tied_weight_attr need a tied_key")
        if self.tied_key is not None and self.tied_weight_attr is None:
            raise ValueError(f"{self.module.__name__}: tied entry '{self.tied_key}' needs tied_weight_attr")

    def build(self) -> nn.Module:
        """A fresh module ``module(*args, **kwargs)``."""
        return self.module(*self.args, **dict(self.kwargs))


def _tied_head(config: ModelConfig) -> Callable[..., Any]:
    """The tied last entry's ``forward_fn``: the causal LM's decoder, the masked LM's head with its
    decoder (``model.mlm_head_positions`` all), or the head alone, decoded in the loss (masked)."""
    if config.objective != "mlm":
        return tied_output_logits
    return masked_lm_features if config.mlm_head_positions == "masked" else masked_lm_logits


def model_layers(
    config: ModelConfig,
    *,
    tp_group: ProcessGroup | None = None,
    seed: int = 1234,
    sequence_parallel: bool = False,
    dropout_rng: DropoutRNG | None = None,
) -> list[LayerDef]:
    """The model's layer plan (see the module docstring for the list).

    Args:
        config: the model configuration.
        tp_group: tensor-parallel group, or None for a single process.
        seed: base seed of every parameter's init.
        sequence_parallel: Megatron sequence parallelism (no effect with one TP rank).
        dropout_rng: dropout generator states, one object shared by the embedding and every block;
            None builds one from ``seed`` and the TP rank.

    Returns:
        ``num_layers + 3`` entries; nothing is built yet.

    Raises:
        ConfigError: a config the loader would refuse (:func:`megaformer.config.load.check_model_config`).
    """
    check_model_config(config)  # the loader's rules: a config built without it is checked too
    sp = sequence_parallel and tp_world_size(tp_group) > 1
    # One generator for all blocks: separate ones, all seeded alike, would repeat the same masks.
    rng = dropout_rng or DropoutRNG(seed, tp_rank=tp_rank(tp_group))
    common = {"tp_group": tp_group, "seed": seed, "sequence_parallel": sp, "dropout_rng": rng}
    tied = embedding_tied_weights(config)
    embed = LayerDef(NormFormerEmbedding, (config,), common, tied_key="embed", tied_weight_attr=tied)
    plan = [embed]
    plan += [LayerDef(NormFormerBlock, (config, i), common) for i in range(config.num_layers)]
    plan.append(LayerDef(FinalNorm, (config,), {"tp_group": tp_group, "sequence_parallel": sp}))
    if config.tie_embeddings:
        plan.append(
            LayerDef(
                NormFormerEmbedding,
                (config,),
                common,
                tied_key="embed",
                forward_fn=_tied_head(config),
                tied_weight_attr=tied,
            )
        )
    else:
        output_kwargs = {k: common[k] for k in ("tp_group", "seed", "sequence_parallel")}
        plan.append(LayerDef(OutputProjection, (config,), output_kwargs))
    return plan


def embedding_tied_weights(config: ModelConfig) -> str | tuple[str, ...]:
    """What the first and the last pipeline stage share of the tied embedding module: the token
    table; under ``model.objective`` mlm also RoBERTa's LM head (``lm_head.*``), which the module
    holds and only the last stage computes with. Tying the head's parameters too keeps the copy
    on the first stage (the one DeepSpeed saves and counts in the gradient norm) equal to the
    last stage's: their gradients are summed between the two stages (the first stage's are
    zeros: :attr:`~megaformer.model.normformer.NormFormerEmbedding.head_grads_here`) and both
    take the same update."""
    if config.objective != "mlm":
        return "token.weight"
    head = ("dense.weight", "dense.bias", "layer_norm.weight", "layer_norm.bias", "bias")
    return ("token.weight", *(f"lm_head.{name}" for name in head))


def layer_prefixes(plan: list[LayerDef]) -> list[str | None]:
    """Each entry's parameter-name prefix in the model (and in every checkpoint):
    ``tied_modules.<key>.`` for a tied entry's first occurrence, ``<index>.`` for an ordinary
    entry, None for a repeated tied entry (its parameters are the first occurrence's)."""
    seen: set[str] = set()
    prefixes: list[str | None] = []
    for idx, layer in enumerate(plan):
        if layer.tied_key is None:
            prefixes.append(f"{idx}.")
        elif layer.tied_key in seen:
            prefixes.append(None)
        else:
            seen.add(layer.tied_key)
            prefixes.append(f"tied_modules.{layer.tied_key}.")
    return prefixes


def vocab_param_names(config: ModelConfig) -> tuple[str, ...]:
    """Names of the parameters whose dim 0 is the padded vocabulary (token embedding, untied output
    projection), read off the plan (each layer class lists its own in ``VOCAB_PARAMS``)."""
    plan = model_layers(config)
    names = tuple(
        prefix + name
        for layer, prefix in zip(plan, layer_prefixes(plan), strict=True)
        if prefix is not None
        for name in getattr(layer.module, "VOCAB_PARAMS", ())
    )
    # The masked LM's vocabulary bias (MaskedLMHead.bias) is held by the embedding module.
    return names + (("tied_modules.embed.lm_head.bias",) if config.objective == "mlm" else ())


def _checkpointed_call(
    checkpoint_fn: Callable[..., torch.Tensor], block: NormFormerBlock, x: torch.Tensor
) -> torch.Tensor:
    # Only training recomputes; evaluation under no_grad has nothing to recompute.
    return checkpoint_fn(block, x) if block.training else block(x)


class NormFormerLM(nn.Module):
    """THE NormFormer / Pre-LN causal LM: the plan of :func:`model_layers` built in one process.

    The trainer trains it (pp = 1), checkpoints and :mod:`megaformer.checkpoint.reshard` use its
    parameter names, :mod:`megaformer.tools.generate` samples from it, and pipeline stages
    (:mod:`megaformer.pipeline`) are cut from the same plan.

    Args:
        config: the model configuration.
        tp_group: tensor-parallel group, or None for a single process.
        seed: base seed; every parameter's full tensor is drawn from a generator seeded by this and
            the parameter's seed name, so the same seed gives the same model at any TP degree.
        sequence_parallel: Megatron sequence parallelism for the LayerNorm / dropout / residual
            regions (no effect with one TP rank); sequences must then divide by the TP size.
        dropout_rng: dropout generator states (the trainer builds one from the seed and this
            process's TP / DP / PP ranks); None builds one from ``seed`` and the TP rank.
        checkpoint_fn: activation checkpointing, ``checkpoint_fn(block, x)`` (e.g.
            :func:`megaformer.pipeline.checkpointed`), applied to every :class:`NormFormerBlock` in
            training mode; never to the embedding (its input is an integer tensor: no gradient to
            carry). None: no recomputation.

    Parameter names: ``tied_modules.embed.*`` (token embedding, learned positions), ``<1..L>.*``
    (the blocks), ``<L+1>.norm.*`` (final LayerNorm), ``<L+2>.proj.weight`` (untied output only).

    Raises:
        ConfigError: a config the loader would refuse (:func:`megaformer.config.load.check_model_config`).
        ValueError: heads, FFN width or padded vocabulary not dividing by the TP size.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
        dropout_rng: DropoutRNG | None = None,
        checkpoint_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.tp_size = tp_world_size(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.dropout_rng = dropout_rng or DropoutRNG(seed, tp_rank=tp_rank(tp_group))
        self.padded_vocab_size = config.padded_vocab_size(self.tp_size)
        self.layer_defs: tuple[LayerDef, ...] = tuple(
            model_layers(
                config,
                tp_group=tp_group,
                seed=seed,
                sequence_parallel=self.sequence_parallel,
                dropout_rng=self.dropout_rng,
            )
        )
        # Registered before the numbered layers, as in PipelineModule: the same parameter order,
        # hence the same optimizer-state order in checkpoints.
        self.tied_modules = nn.ModuleDict()
        self._forward_fns: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for idx, layer in enumerate(self.layer_defs):
            if layer.tied_key is not None:
                if layer.tied_key not in self.tied_modules:
                    self.tied_modules[layer.tied_key] = layer.build()
                module = self.tied_modules[layer.tied_key]
                fn = module if layer.forward_fn is None else partial(layer.forward_fn, module)
            else:
                module = layer.build()
                self.add_module(str(idx), module)
                fn = module
                if checkpoint_fn is not None and isinstance(module, NormFormerBlock):
                    fn = partial(_checkpointed_call, checkpoint_fn, module)
            self._forward_fns.append(fn)
        self.loss_fn = lm_loss(config, tp_group)  # LMLoss, or MaskedLMLoss under model.objective mlm

    @property
    def embedding(self) -> NormFormerEmbedding:
        """The token (and position) embedding; also the tied output projection's weight."""
        return self.tied_modules["embed"]

    @property
    def blocks(self) -> list[NormFormerBlock]:
        """The decoder layers, in order (``blocks[i]`` is registered as ``<i + 1>``)."""
        return [m for m in self.children() if isinstance(m, NormFormerBlock)]

    @property
    def final_norm(self) -> FinalNorm:
        """The LayerNorm after the last block."""
        return getattr(self, str(self.config.num_layers + 1))

    @property
    def output(self) -> OutputProjection | None:
        """The untied output projection, or None with ``tie_embeddings``."""
        last = getattr(self, str(self.config.num_layers + 2), None)
        return last if isinstance(last, OutputProjection) else None

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss, or this TP rank's logits.

        Args:
            tokens: ``LongTensor[B, T]``, ``T <= seq_len`` (divisible by the TP size under sequence
                parallelism), values in ``[0, vocab_size)``.
            labels: ``LongTensor[B, T]`` next-token targets, or None. Under ``model.objective`` mlm:
                each position's original token where it was chosen for prediction, -100
                (:data:`~megaformer.data.mlm.IGNORE_INDEX`) elsewhere.

        Returns:
            with labels, the ``float32`` scalar mean cross-entropy in nats over all ``B·T`` tokens (mlm:
            over the masked positions, :class:`~megaformer.model.normformer.MaskedLMLoss`)
            (the same on every TP rank); without labels, ``float32[B, T, padded_vocab/tp]``: this
            rank's contiguous vocabulary slice of the logits, the padded columns (global index
            ``>= vocab_size``) set to ``-inf`` so that no sampler can pick them.

        Raises:
            ValueError: more than ``seq_len`` tokens, a length not divisible by the TP size under
                sequence parallelism, or labels of another shape than tokens.
        """
        x = tokens
        for fn in self._forward_fns:
            x = fn(x)
        if labels is None:
            if isinstance(x, MaskedLMFeatures):  # model.mlm_head_positions masked: decode everywhere
                x = x.logits()
            return mask_padded_vocab(x, self.tp_group, self.config.vocab_size)
        return self.loss_fn(x, labels)
