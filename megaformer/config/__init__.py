"""Typed, validated run configuration (imports nothing else of the project)."""

from megaformer.config.load import data_parallel_size, load_config, to_dict, validate_layout
from megaformer.config.schema import (
    BudgetConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "BudgetConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "data_parallel_size",
    "load_config",
    "to_dict",
    "validate_layout",
]
