"""Tensor-parallel building blocks (Megatron-style), independent of NormFormer.

Every layer and mapping takes its process group explicitly (``tp_group=None`` means a single
process); nothing here keeps global state. :class:`ParallelState` builds the groups of a
``tp × pp × dp`` job once and is DeepSpeed's ``mpu``; :class:`DropoutRNG` keeps the dropout
generator states of replicated and sharded regions.
"""

from megaformer.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayerNorm,
    VocabParallelEmbedding,
    mask_padded_vocab,
    sharded_layer_norm,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    sum_across_tp_region,
)
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.state import ParallelState, RankGrid
from megaformer.parallel.utils import divide, grad_norm, tp_rank, tp_world_size

__all__ = [
    "ColumnParallelLinear",
    "DropoutRNG",
    "ParallelState",
    "RankGrid",
    "RowParallelLinear",
    "ShardedLayerNorm",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "divide",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "grad_norm",
    "mask_padded_vocab",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "sharded_layer_norm",
    "sum_across_tp_region",
    "tp_rank",
    "tp_world_size",
    "vocab_parallel_cross_entropy",
]
