"""The NormFormer / Pre-LN (or Post-LN, DeepNorm) decoder LM, built from :mod:`megaformer.parallel` layers.

:func:`model_layers` is the model's one layer plan; :class:`NormFormerLM` builds it in one process
(the trainer's model at pp = 1, and what tests, benchmarks, ``generate`` and ``reshard`` use);
:mod:`megaformer.pipeline` turns the same plan into DeepSpeed pipeline stages.
"""

from megaformer.config.schema import NORM_SCHEMES
from megaformer.model.compile import compile_blocks, compile_wanted, why_not_compiled
from megaformer.model.lm import LayerDef, NormFormerLM, layer_prefixes, model_layers, vocab_param_names
from megaformer.model.normformer import (
    FinalNorm,
    LMLoss,
    MaskedLMFeatures,
    MaskedLMHead,
    MaskedLMLoss,
    NormFormerBlock,
    NormFormerEmbedding,
    OutputProjection,
    QKVLayerNorm,
    ReplicatedLayerNorm,
    deepnorm_alpha,
    deepnorm_beta,
    lm_loss,
    masked_lm_features,
    masked_lm_logits,
    set_selective_recompute,
    sinusoidal_positions,
    tied_output_logits,
)
from megaformer.model.params import PARAM_ORDERS, aligned_order, count_parameters, param_groups

__all__ = [
    "NORM_SCHEMES",
    "PARAM_ORDERS",
    "FinalNorm",
    "LMLoss",
    "LayerDef",
    "MaskedLMFeatures",
    "MaskedLMHead",
    "MaskedLMLoss",
    "NormFormerBlock",
    "NormFormerEmbedding",
    "NormFormerLM",
    "OutputProjection",
    "QKVLayerNorm",
    "ReplicatedLayerNorm",
    "aligned_order",
    "compile_blocks",
    "compile_wanted",
    "count_parameters",
    "deepnorm_alpha",
    "deepnorm_beta",
    "layer_prefixes",
    "lm_loss",
    "masked_lm_features",
    "masked_lm_logits",
    "model_layers",
    "param_groups",
    "set_selective_recompute",
    "sinusoidal_positions",
    "tied_output_logits",
    "vocab_param_names",
    "why_not_compiled",
]
