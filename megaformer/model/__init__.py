"""NormFormer / Pre-LN decoder language models built from :mod:`megaformer.parallel` layers."""

from megaformer.model.normformer import NormFormerBlock, NormFormerEmbedding, NormFormerLM
from megaformer.model.params import count_parameters, param_groups

__all__ = ["NormFormerBlock", "NormFormerEmbedding", "NormFormerLM", "count_parameters", "param_groups"]
