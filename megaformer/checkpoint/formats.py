"""DeepSpeed's checkpoint format, as far as the checkpoint package reads it: the file names of a
``global_stepN`` directory and the data classes DeepSpeed pickles into its module files.

These are DeepSpeed's conventions, written down once here so that nothing in
:mod:`megaformer.checkpoint` has to import the training package's adapter; this module is, with
:mod:`megaformer.training.ds_adapter` and :mod:`megaformer.pipeline.module`, one of the places
allowed to import DeepSpeed (``tests/unit/test_boundaries.py``), and only to list its classes.
``tests/unit/test_ds_adapter_contract.py`` checks the names against the installed DeepSpeed.
"""

from __future__ import annotations

import re

MODEL_STATES_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
"""A plain engine's per-TP-rank module file in a ``global_stepN`` directory (group: TP rank)."""
LAYER_STATES_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
"""The pipeline engine's per-layer, per-TP-rank module file (groups: layer index, TP rank)."""


MODEL_STATES_GLOB = "mp_rank_*_model_states.pt"
LAYER_STATES_GLOB = "layer_*-model_*-model_states.pt"


def model_states_name(tp_rank: int) -> str:
    """File name of TP rank ``tp_rank``'s module weights in a plain engine's checkpoint."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


CHECKPOINT_DATA_CLASS_NAMES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The qualified names of :func:`checkpoint_data_classes`, known without importing DeepSpeed (a tool
that reads weights imports it only when a file names one of them; the contract test keeps the two
equal)."""


def checkpoint_data_classes() -> list[type]:
    """DeepSpeed's data classes that its optimizer state at ZeRO stage 0 puts into the module file.

    Each is a plain data holder: an ``Enum``, a dataclass, and the loss scalers, whose pickles
    restore attributes (``__dict__``) and call nothing. Empty when DeepSpeed is absent (then no
    such file can have been written here).
    """
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # pragma: no cover - deepspeed is a requirement
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
