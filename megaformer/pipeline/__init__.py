"""The model as a DeepSpeed pipeline: LayerSpecs for pp > 1, the same list run sequentially for pp = 1."""

from megaformer.pipeline.module import (
    PARTITION_METHODS,
    EmbeddingPipe,
    FinalNormPipe,
    LMLoss,
    OutputPipe,
    SequentialLM,
    build_pipeline_module,
    checkpointed,
    layer_specs,
    output_logits,
    vocab_param_names,
)

__all__ = [
    "PARTITION_METHODS",
    "EmbeddingPipe",
    "FinalNormPipe",
    "LMLoss",
    "OutputPipe",
    "SequentialLM",
    "build_pipeline_module",
    "checkpointed",
    "layer_specs",
    "output_logits",
    "vocab_param_names",
]
