"""Reshard a checkpoint to another tensor-parallel degree, or load it at another (tp, pp, dp) layout.

The functions; the command is :mod:`megaformer.tools.reshard`
(``python -m megaformer.tools.reshard --input CKPT_DIR --output OUT_DIR --tp N [--tag global_step20]``).

``CKPT_DIR`` is a run's ``checkpoints/`` directory (the tag comes from its ``latest`` file, or
``--tag``) or one ``global_stepN`` directory. The module weights (of every ``mp_rank_XX_model_states.pt``
at pp = 1: one file per TP rank, written by DeepSpeed with our ``mpu``; of every
``layer_LL-model_XX-model_states.pt`` at pp > 1: one file per layer and TP rank, written by the
pipeline engine) are consolidated to full tensors named as the parameters of
:class:`~megaformer.model.NormFormerLM` (``tied_modules.embed.*``, ``<layer index>.*``: the index of
the layer in :func:`~megaformer.model.model_layers`'s plan, which pipeline stages share), then
split again for ``N`` ranks and written to ``OUT_DIR/<tag>/mp_rank_XX_model_states.pt`` with a
``latest`` file, in DeepSpeed's file layout; :func:`load_module` loads them into a model built at
TP = ``N``. (The files carry the keys DeepSpeed's ``load_checkpoint(..., load_module_only=True)``
reads, but that path is not tested, and the trainer has no option yet to start from them.)

Mechanics: the seeded full-tensor init means a rank's parameter is a contiguous slice of the full
tensor along its ``partition_dim`` tag (``tensor_model_parallel=True``), or the full tensor itself
(replicated). The tags are read from the model built at TP = 1 on the ``meta`` device (no memory).
The vocabulary rows (token embedding, untied output layer) are padded to a multiple of
``make_vocab_size_divisible_by × tp``: padding is dropped when consolidating (it is zero and never
receives a gradient) and re-added, as zeros, for the new degree.

:func:`load_full` puts consolidated weights into a model built at any layout (a
:class:`~megaformer.model.NormFormerLM` or one pipeline stage's ``PipelineModule``): the trainer's
``train.init_from`` uses it, so a checkpoint saved at one (tp, pp, dp) layout starts a run at another.

Only module weights are carried: optimizer and scheduler states are not resharded (restart the
optimizer, or use DeepSpeed's universal checkpoints for that). The next step's loss needs only the
weights, so it equals the uninterrupted run's; the steps after it differ by the restarted AdamW
moments. ZeRO-3 checkpoints keep no weights in the model-states files and are refused.
"""

from __future__ import annotations

import copy
import glob
import os
from collections.abc import Collection
from typing import Any

import torch

from data_tools.files import atomic_write_text
from megaformer.checkpoint import integrity
from megaformer.checkpoint.formats import (
    LAYER_STATES_FILE,
    LAYER_STATES_GLOB,
    MODEL_STATES_FILE,
    MODEL_STATES_GLOB,
    model_states_name,
)
from megaformer.checkpoint.integrity import resolve_latest
from megaformer.checkpoint.safe_load import (
    CheckpointReadError,
    load_weights,
    refuse_untrusted,
    weight_files,
)
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM, layer_prefixes, model_layers, vocab_param_names
from megaformer.parallel.utils import divide

# DeepSpeed's checkpoint file layout, named in one place (the adapter pins the DeepSpeed version).
_MP_FILE, _LAYER_FILE = MODEL_STATES_FILE, LAYER_STATES_FILE


class ReshardError(CheckpointReadError):
    """A checkpoint that cannot be resharded; the message names the file and the reason.

    A subclass of :class:`~megaformer.checkpoint.safe_load.CheckpointReadError`, which callers catch
    to get this, a damaged file and a refused (untrusted) file alike."""


def resolve_tag_dir(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory holding the ``mp_rank_XX_model_states.pt`` files, from what a user passes:
    a run directory (``output.dir``, or an ``import_fairseq --output`` directory: both hold
    ``checkpoints/``), its ``checkpoints/`` directory (the tag ``latest`` names, or ``tag``), or one
    ``global_stepN`` directory.

    Raises:
        ReshardError: no such path (said as such, with what to pass), no checkpoint there, or no
            ``latest`` file to pick the tag from.
    """
    if not os.path.exists(ckpt_dir):
        raise ReshardError(
            f"{ckpt_dir}: no such file or directory; pass a run directory, its checkpoints/ directory "
            "or one global_stepN directory"
        )
    nested = os.path.join(ckpt_dir, "checkpoints")
    holds_checkpoint = glob.glob(os.path.join(ckpt_dir, "*model_states.pt")) or os.path.isfile(
        os.path.join(ckpt_dir, "latest")
    )
    if (
        not holds_checkpoint
        and os.path.isdir(nested)
        and (tag is None or not os.path.isdir(os.path.join(ckpt_dir, tag)))
    ):
        ckpt_dir = nested  # a run directory: its checkpoints/
    if tag is not None:
        path = os.path.join(ckpt_dir, tag)
    elif glob.glob(os.path.join(ckpt_dir, "*model_states.pt")):
        path = ckpt_dir
    else:
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            raise ReshardError(
                f"{ckpt_dir}: neither mp_rank_XX_model_states.pt files nor a 'latest' file; pass a "
                "run directory, its checkpoints/ directory, a global_stepN directory, or --tag"
            )

        path = resolve_latest(ckpt_dir)  # an empty or dangling tag: named, with the way out
    if not os.path.isdir(path):
        raise ReshardError(f"{path}: checkpoint directory not found")
    return path


def _model_files(tag_dir: str) -> list[str]:
    files = {}
    for path in glob.glob(os.path.join(tag_dir, MODEL_STATES_GLOB)):
        files[int(_MP_FILE.search(path).group(1))] = path
    if not files:
        raise ReshardError(f"{tag_dir}: no mp_rank_XX_model_states.pt files")
    if sorted(files) != list(range(len(files))):
        raise ReshardError(
            f"{tag_dir}: model-state files of ranks {sorted(files)}; expected 0..{len(files) - 1}"
        )
    return [files[r] for r in range(len(files))]


def _layer_model(config: ModelConfig, tp_group=None):
    """The model (:class:`~megaformer.model.NormFormerLM`), whose parameter names are the checkpoint's."""

    return NormFormerLM(config, tp_group=tp_group)


def partition_dims(config: ModelConfig) -> dict[str, int | None]:
    """``{parameter name: partition_dim}`` (None for replicated) from the TP=1 model's tags, for
    every parameter of :class:`~megaformer.model.NormFormerLM` (built on ``meta``: no memory)."""
    with torch.device("meta"):
        model = _layer_model(config)
    return {
        name: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
        for name, p in model.named_parameters()
    }


def _vocab_rows(name: str, config: ModelConfig) -> bool:
    """Parameters whose dim 0 is the padded vocabulary."""

    return name in vocab_param_names(config)


def _load(path: str, trust_code: bool = False) -> Any:
    """A checkpoint file, memory-mapped (tensors are read from disk only when touched, so a rank
    that needs a few of a checkpoint's parameters does not hold all of them), through the
    weights-only loader (:func:`~megaformer.checkpoint.safe_load.load_weights`: nothing in the file
    runs unless ``trust_code``)."""
    return load_weights(path, trust_code=trust_code)


def _pipeline_modules(
    tag_dir: str, config: ModelConfig, tp: int, names: Collection[str] | None = None, trust_code: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Per-TP-rank module dicts, in the model's naming, from a pipeline checkpoint's layer files
    (only the layers holding one of ``names``, when given). File ``layer_LL`` holds entry ``LL`` of
    the plan; a repeated tied entry (the tied output projection) holds nothing of its own."""

    prefixes = layer_prefixes(model_layers(config))
    files: dict[tuple[int, int], str] = {}
    for path in glob.glob(os.path.join(tag_dir, LAYER_STATES_GLOB)):
        m = _LAYER_FILE.search(path)
        files[(int(m.group(1)), int(m.group(2)))] = path
    layers = sorted({layer for layer, _ in files})
    modules: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for layer in layers:
        if layer >= len(prefixes):
            raise ReshardError(f"{tag_dir}: layer {layer} is not in a model of {len(prefixes)} layer entries")
        prefix = prefixes[layer]
        if prefix is None:
            continue  # a repeated tied entry: the same weights as the entry it repeats
        if names is not None and not any(name.startswith(prefix) for name in names):
            continue
        for r in range(tp):
            if (layer, r) not in files:
                raise ReshardError(f"{tag_dir}: layer {layer} has no file for TP rank {r}")
            state = _load(files[(layer, r)], trust_code)
            modules[r].update({prefix + k: v for k, v in state.items()})
    return modules


def consolidate(
    tag_dir: str, names: Collection[str] | None = None, trust_code: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Full, unpadded module weights of a checkpoint saved at any (tp, pp, dp) layout.

    ``names`` (the model's parameter names) limits the result to those parameters: a pipeline
    stage loading its own layers reads and holds only them (files are memory-mapped, and layer
    files of other stages are not opened), not the whole model. Files are read with the
    weights-only unpickler unless ``trust_code`` (:mod:`megaformer.checkpoint.safe_load`).

    Returns:
        ``(full_state, run_config, extra)``: the full tensors in the model's naming (vocabulary rows
        cut to ``model.vocab_size``; dtype as saved), the run config dict stored by the trainer,
        and ``{"step": ...}`` from the client state.

    Raises:
        ReshardError: a checkpoint without the trainer's config, a ZeRO-3 checkpoint (no weights in
            the model-states files), missing layer files, or replicas that differ.
        UntrustedCheckpointError: a file refers to a type loading weights does not allow (names
            the file and the type), and ``trust_code`` is off.
        CheckpointReadError: a file is truncated or damaged.
    """
    files = _model_files(tag_dir)
    refuse_untrusted(weight_files(tag_dir), trust_code)  # every file scanned before any is loaded
    head = _load(files[0], trust_code)
    run_config = head.get("config")
    if not isinstance(run_config, dict) or "model" not in run_config:
        raise ReshardError(f"{files[0]}: no 'config' in the client state; not written by megaformer.train")
    tp = int(run_config["parallel"]["tp_size"])
    pp = int(run_config["parallel"].get("pp_size", 1))
    config = ModelConfig(**run_config["model"])
    if pp > 1:
        modules = _pipeline_modules(tag_dir, config, tp, names, trust_code)
    else:
        if len(files) != tp:
            raise ReshardError(f"{tag_dir}: {len(files)} model-state files for parallel.tp_size={tp}")
        modules = [head["module"]] + [_load(f, trust_code)["module"] for f in files[1:]]
    dims = partition_dims(config)
    full: dict[str, torch.Tensor] = {}
    for name, dim in dims.items():
        if names is not None and name not in names:
            continue
        if name not in modules[0]:
            raise ReshardError(f"{tag_dir}: parameter '{name}' missing from the module state")
        parts = [m[name] for m in modules]
        if any(p.numel() == 0 for p in parts):
            raise ReshardError(
                f"{files[0]}: '{name}' is empty: a ZeRO-3 checkpoint keeps its weights in the optimizer "
                "files; save with train.zero_stage <= 2 or consolidate with DeepSpeed's zero_to_fp32 first"
            )
        if dim is None:
            for p in parts[1:]:
                if not torch.equal(p, parts[0]):
                    raise ReshardError(f"{tag_dir}: replicated parameter '{name}' differs from TP rank 0's")
            tensor = parts[0]
        else:
            tensor = torch.cat(parts, dim=dim)
        if _vocab_rows(name, config):
            tensor = tensor[: config.vocab_size]
        full[name] = tensor.clone()
    return full, run_config, {"step": head.get("step"), "pp_size": pp, "tp_size": tp}


def load_full(
    model: torch.nn.Module, full: dict[str, torch.Tensor], config: ModelConfig, tp_rank: int, tp: int
) -> int:
    """Copy this TP rank's slice of the full weights into every parameter of ``model``.

    ``model`` is a :class:`~megaformer.model.NormFormerLM` or one stage of the ``PipelineModule``
    (the same parameter names), built at TP degree ``tp``; ``full`` maps names to full, unpadded
    tensors (:func:`consolidate`). Returns the number of parameters set.

    Raises:
        ReshardError: a parameter of the model is missing from ``full`` or has another shape.
    """
    padded = config.padded_vocab_size(tp)
    count = 0
    for name, p in model.named_parameters():
        if name not in full:
            raise ReshardError(f"parameter '{name}' is not in the checkpoint (another model config?)")
        tensor = full[name]
        if _vocab_rows(name, config):
            pad = tensor.new_zeros((padded - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad], dim=0)
        if getattr(p, "tensor_model_parallel", False):
            size = tensor.shape[p.partition_dim] // tp
            tensor = tensor.narrow(p.partition_dim, tp_rank * size, size)
        if tuple(tensor.shape) != tuple(p.shape):
            raise ReshardError(
                f"parameter '{name}': checkpoint slice {tuple(tensor.shape)} vs model {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(tensor)
        count += 1
    return count


def split(full: dict[str, torch.Tensor], config: ModelConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """Per-rank module state dicts for ``tp`` ranks from full, unpadded weights.

    Raises:
        ValueError: heads, FFN width or padded vocabulary not divisible by ``tp`` (names the sizes).
    """

    for what, size in (
        ("model.num_attention_heads", config.num_attention_heads),
        ("FFN width", config.ffn_size),
    ):
        if size % tp != 0:
            raise ValueError(f"{what}={size} is not divisible by tp={tp}; pick a degree that divides it")
    dims = partition_dims(config)
    padded = config.padded_vocab_size(tp)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, dim in dims.items():
        tensor = full[name]
        if _vocab_rows(name, config):
            pad = tensor.new_zeros((padded - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad], dim=0)
        for r in range(tp):
            if dim is None:
                shards[r][name] = tensor.clone()
            else:
                size = divide(tensor.shape[dim], tp)
                shards[r][name] = tensor.narrow(dim, r * size, size).clone().contiguous()
    return shards


def reshard(
    input_dir: str, output_dir: str, tp: int, tag: str | None = None, trust_code: bool = False
) -> str:
    """Write ``input_dir``'s weights for ``tp`` ranks under ``output_dir``; return the tag directory.

    The files written hold tensors and plain containers only (loadable with ``weights_only=True``).

    Raises:
        CheckpointError: a weights file differs from the manifest (names it and the newest intact
            ``global_stepN``); a damaged optimizer or generator-state file, which is not read, is
            only named in a warning on stderr.
        ReshardError: see :func:`consolidate`; UntrustedCheckpointError: see :func:`consolidate`.
    """

    tag_dir = resolve_tag_dir(input_dir, tag)
    # The weights files are verified before torch.load reads them; a damaged optimizer or
    # generator-state file (not read here) is named in a warning.
    integrity.verify(tag_dir, needs=integrity.NEEDS_WEIGHTS)
    full, run_config, extra = consolidate(tag_dir, trust_code=trust_code)
    config = ModelConfig(**run_config["model"])
    new_config = copy.deepcopy(run_config)
    new_config["parallel"]["tp_size"] = tp
    new_config["parallel"]["pp_size"] = 1
    shards = split(full, config, tp)
    name = os.path.basename(os.path.normpath(tag_dir))
    provenance = {
        "resharded_from_layout": {"tp": extra["tp_size"], "pp": extra["pp_size"]},
        "resharded_from": os.path.abspath(tag_dir),
    }
    # The config in the manifest too: launch/pretrain.sh checks a train.init_from of these weights
    # (another model shape, a spent step count) from the manifest before any worker starts.
    return write_module_checkpoint(
        output_dir, name, shards, new_config, extra["step"], provenance, new_config
    )


def write_module_checkpoint(
    output_dir: str,
    name: str,
    shards: list[dict[str, torch.Tensor]],
    run_config: dict[str, Any],
    step: int | None,
    provenance: dict[str, Any] | None = None,
    manifest_config: dict[str, Any] | None = None,
) -> str:
    """Write per-TP-rank module weights (:func:`split`) as ``output_dir/<name>/mp_rank_XX_model_states.pt``
    in DeepSpeed's layout (what :func:`consolidate`, ``train.init_from``, ``generate``, ``evaluate``
    and ``export_hf`` read), then its ``manifest.json`` and ``output_dir/latest``; return the tag
    directory. ``run_config``: the run config dict stored with the weights (the trainer's
    ``to_dict``); ``provenance``: extra client-state entries (where the weights came from);
    ``manifest_config``: the config recorded in the manifest (None: none), which the launcher's
    checks of a resume or ``train.init_from`` read before any worker starts."""

    out = os.path.join(output_dir, name)
    os.makedirs(out, exist_ok=True)
    for r, module in enumerate(shards):
        state = {
            "module": module,
            # What DeepSpeed's load_checkpoint(load_module_only=True) reads besides the module.
            "dp_world_size": 1,
            "mp_world_size": len(shards),
            "buffer_names": [],
            "step": step,
            "config": run_config,
            **(provenance or {}),
        }
        path = os.path.join(out, model_states_name(r))
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    files = integrity.checkpoint_files(out)
    integrity.write_manifest(out, integrity.describe_files(out, files), int(step or 0), manifest_config)
    atomic_write_text(os.path.join(output_dir, "latest"), name)
    return out


def load_module(
    model: torch.nn.Module, ckpt_dir: str, tp_rank: int, tag: str | None = None, trust_code: bool = False
) -> dict[str, Any]:
    """Load TP rank ``tp_rank``'s module weights of a checkpoint saved at the model's TP degree.

    Returns the run config stored with the weights. Raises ``RuntimeError`` (from
    ``load_state_dict``, strict) when the shapes do not match the model's TP degree: reshard first.
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    state = _load(os.path.join(tag_dir, model_states_name(tp_rank)), trust_code)
    model.load_state_dict(state["module"], strict=True)
    return state.get("config", {})
