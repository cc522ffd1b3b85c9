"""The DeepSpeed config dict: engine knobs from an optional JSON, everything else from the YAML.

Batch sizes, precision, ZeRO stage and gradient clipping are set once, in the YAML run config; the
JSON holds only engine knobs (loss-scaler window, ZeRO bucket sizes, ...). A JSON that sets one of
the YAML's quantities is refused instead of silently winning or losing.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from megaformer.config import ConfigError, RunConfig

# JSON key -> the YAML key that owns it.
OWNED_BY_YAML = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (micro_batch_size × dp)",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr / adam_* / weight_decay (AdamW is built by megaformer)",
    "scheduler": "train.warmup_steps / lr_decay (the schedule is built by megaformer)",
}


def read_engine_json(path: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON of engine knobs.

    Raises:
        ConfigError: unreadable JSON, or a key the YAML owns (named, with the YAML key to use).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"train.deepspeed_config: {path} not found.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object.")
    for key, owner in OWNED_BY_YAML.items():
        if key in data:
            raise ConfigError(
                f"{path}: '{key}' is set by the YAML run config ({owner}); remove it from the JSON."
            )
    for section, owner in (("fp16", "train.precision"), ("bf16", "train.precision")):
        if isinstance(data.get(section), dict) and "enabled" in data[section]:
            raise ConfigError(f"{path}: '{section}.enabled' is set by {owner}; remove it from the JSON.")
    zero = data.get("zero_optimization")
    if isinstance(zero, dict) and "stage" in zero:
        raise ConfigError(
            f"{path}: 'zero_optimization.stage' is set by train.zero_stage; remove it from the JSON."
        )
    return data


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                "bf16": "bf16", "bfloat16": "bf16"}  # fmt: skip


def check_engine_combination(
    cfg: RunConfig, data: dict[str, Any], path: str = "train.deepspeed_config"
) -> None:
    """Refuse what DeepSpeed 0.19 accepts in its JSON and then crashes on at ``deepspeed.initialize``.

    ``data_types.grad_accum_dtype`` different from the model's dtype (``fp32`` accumulation of bf16
    or fp16 gradients) is implemented by DeepSpeed 0.19 only inside a ZeRO optimizer (stage ≥ 1:
    bf16 + fp32 accumulation at stage 1 is its ``BF16_Optimizer``); without ZeRO (``train.zero_stage
    = 0``, the pipeline engine's default too) its ``_do_optimizer_sanity_check`` raises
    ``NotImplementedError: unsupported mix of model_dtype=torch.bfloat16 and
    grad_accum_dtype=torch.float32`` (deepspeed/runtime/engine.py). Found by the fake-CUDA dry run
    (``configs/deepspeed/paper-bf16-a100.json`` at ZeRO-0).

    Raises:
        ConfigError: naming the JSON file and key, the YAML keys and both fixes.
    """
    accum = (data.get("data_types") or {}).get("grad_accum_dtype")
    t = cfg.train
    if accum is None or t.precision == "fp32" or t.zero_stage != 0:
        return
    accum_name = _DTYPE_NAMES.get(str(accum).lower(), str(accum))
    if accum_name == t.precision:
        return
    raise ConfigError(
        f"{path}: data_types.grad_accum_dtype={accum!r} with train.precision={t.precision} and "
        f"train.zero_stage=0: DeepSpeed {_deepspeed_minor()} accumulates {t.precision} gradients in "
        f"{accum_name} only inside a ZeRO optimizer and stops at start-up otherwise (NotImplementedError: "
        f"unsupported mix of model_dtype and grad_accum_dtype). Use train.zero_stage=1 (the same fp32 "
        f"accumulation, DeepSpeed's BF16 optimizer), or remove data_types.grad_accum_dtype from {path} "
        f"to accumulate in {t.precision}"
    )


def _deepspeed_minor() -> str:
    from importlib import metadata

    try:
        return ".".join(metadata.version("deepspeed").split(".")[:2])
    except metadata.PackageNotFoundError:
        return "0.19"


def build_deepspeed_config(cfg: RunConfig, dp_size: int) -> dict[str, Any]:
    """The dict passed to ``deepspeed.initialize(config=...)``.

    Args:
        cfg: the validated run config.
        dp_size: data-parallel degree (world size / (tp × pp)).

    Returns:
        A fresh dict; gradient_accumulation_steps = global_batch_size / (micro_batch_size × dp_size).

    Raises:
        ConfigError: a JSON key the YAML owns, or a combination DeepSpeed would crash on
            (:func:`check_engine_combination`).
    """
    t = cfg.train
    ds: dict[str, Any] = copy.deepcopy(read_engine_json(t.deepspeed_config)) if t.deepspeed_config else {}
    check_engine_combination(cfg, ds, t.deepspeed_config or "train.deepspeed_config")
    ds["train_batch_size"] = t.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.global_batch_size // (t.micro_batch_size * dp_size)
    ds["gradient_clipping"] = t.grad_clip
    ds.setdefault("steps_per_print", 10**9)  # our own console log replaces DeepSpeed's
    ds.setdefault("wall_clock_breakdown", False)
    # The optimizer is our torch AdamW (param groups without decay on norms/biases/scales); ZeRO
    # handles any torch optimizer but warns unless told it is intended.
    ds["zero_allow_untested_optimizer"] = True
    zero = dict(ds.get("zero_optimization", {}))
    zero["stage"] = t.zero_stage
    ds["zero_optimization"] = zero
    fp16 = dict(ds.get("fp16", {}))
    fp16["enabled"] = t.precision == "fp16"
    if fp16["enabled"]:
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)
        fp16.setdefault("loss_scale_window", 1000)
        fp16.setdefault("hysteresis", 2)
        fp16.setdefault("min_loss_scale", 1)
    ds["fp16"] = fp16
    bf16 = dict(ds.get("bf16", {}))
    bf16["enabled"] = t.precision == "bf16"
    ds["bf16"] = bf16
    p = cfg.parallel
    if p.pp_size > 1 and p.tp_size > 1 and p.sequence_parallel:
        # The pipeline engine sends 1/tp of an activation per TP rank and all-gathers it on the next
        # stage, which assumes the activation is replicated across the TP group; sequence-parallel
        # activations are per-rank slices, so they travel whole.
        pipeline = dict(ds.get("pipeline", {}))
        pipeline["pipe_partitioned"] = False
        pipeline["grad_partitioned"] = False
        ds["pipeline"] = pipeline
    return ds
