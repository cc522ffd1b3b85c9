"""The model as a DeepSpeed ``PipelineModule`` (pp > 1), its stages cut from the one layer plan of
:func:`megaformer.model.model_layers`; at pp = 1 the trainer uses :class:`megaformer.model.NormFormerLM`."""

from megaformer.pipeline.module import (
    PARTITION_METHODS,
    build_pipeline_module,
    checkpointed,
    configure_recompute,
    layer_spec,
    layer_specs,
    pipe_topology,
    vocab_param_names,
)

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
