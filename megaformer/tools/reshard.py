"""Reshard a checkpoint to another tensor-parallel degree.

    python -m megaformer.tools.reshard --input CKPT_DIR --output OUT_DIR --tp N [--tag global_step20]

``CKPT_DIR`` is a run's ``checkpoints/`` directory (the tag comes from its ``latest`` file, or
``--tag``) or one ``global_stepN`` directory. The module weights of every ``mp_rank_XX_model_states.pt``
(one file per TP rank, written by DeepSpeed with our ``mpu``) are consolidated to full tensors, then
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

Only module weights are carried: optimizer and scheduler states are not resharded (restart the
optimizer, or use DeepSpeed's universal checkpoints for that). ZeRO-3 checkpoints keep no weights in
the model-states files and are refused.
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import re
import sys
from typing import Any

import torch

from megaformer.config.schema import ModelConfig

_MP_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")


class ReshardError(ValueError):
    """A checkpoint that cannot be resharded; the message names the file and the reason."""


def resolve_tag_dir(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory holding the ``mp_rank_XX_model_states.pt`` files.

    Raises:
        ReshardError: no such directory, or no ``latest`` file to pick the tag from.
    """
    if tag is not None:
        path = os.path.join(ckpt_dir, tag)
    elif glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt")):
        path = ckpt_dir
    else:
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            raise ReshardError(
                f"{ckpt_dir}: neither mp_rank_XX_model_states.pt files nor a 'latest' file; pass a "
                "run's checkpoints/ directory, a global_stepN directory, or --tag"
            )
        with open(latest, encoding="utf-8") as f:
            path = os.path.join(ckpt_dir, f.read().strip())
    if not os.path.isdir(path):
        raise ReshardError(f"{path}: checkpoint directory not found")
    return path


def _model_files(tag_dir: str) -> list[str]:
    files = {}
    for path in glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")):
        files[int(_MP_FILE.search(path).group(1))] = path
    if not files:
        raise ReshardError(f"{tag_dir}: no mp_rank_XX_model_states.pt files")
    if sorted(files) != list(range(len(files))):
        raise ReshardError(
            f"{tag_dir}: model-state files of ranks {sorted(files)}; expected 0..{len(files) - 1}"
        )
    return [files[r] for r in range(len(files))]


def partition_dims(config: ModelConfig) -> dict[str, int | None]:
    """``{parameter name: partition_dim}`` (None for replicated) from the TP=1 model's tags."""
    from megaformer.model import NormFormerLM

    with torch.device("meta"):
        model = NormFormerLM(config, tp_group=None)
    return {
        name: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
        for name, p in model.named_parameters()
    }


def _vocab_rows(name: str) -> bool:
    """Parameters whose dim 0 is the padded vocabulary."""
    return name in ("embedding.token.weight", "output.weight")


def consolidate(tag_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Full, unpadded module weights of a checkpoint saved at any TP degree.

    Returns:
        ``(full_state, run_config, extra)``: the full tensors (vocabulary rows cut to
        ``model.vocab_size``; dtype as saved), the run config dict stored by the trainer, and
        ``{"step": ...}`` from the client state.

    Raises:
        ReshardError: a checkpoint without the trainer's config, a pipeline checkpoint, a ZeRO-3
            checkpoint (no weights in the model-states files), or replicas that differ.
    """
    files = _model_files(tag_dir)
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    run_config = states[0].get("config")
    if not isinstance(run_config, dict) or "model" not in run_config:
        raise ReshardError(f"{files[0]}: no 'config' in the client state; not written by megaformer.train")
    tp = int(run_config["parallel"]["tp_size"])
    if int(run_config["parallel"].get("pp_size", 1)) != 1:
        raise ReshardError(f"{files[0]}: pipeline-parallel checkpoints (pp_size > 1) are not supported")
    if len(files) != tp:
        raise ReshardError(f"{tag_dir}: {len(files)} model-state files for parallel.tp_size={tp}")
    config = ModelConfig(**run_config["model"])
    dims = partition_dims(config)
    modules = [s["module"] for s in states]
    full: dict[str, torch.Tensor] = {}
    for name, dim in dims.items():
        if name not in modules[0]:
            raise ReshardError(f"{files[0]}: parameter '{name}' missing from the module state")
        parts = [m[name] for m in modules]
        if any(p.numel() == 0 for p in parts):
            raise ReshardError(
                f"{files[0]}: '{name}' is empty: a ZeRO-3 checkpoint keeps its weights in the optimizer "
                "files; save with train.zero_stage <= 2 or consolidate with DeepSpeed's zero_to_fp32 first"
            )
        if dim is None:
            for r, p in enumerate(parts[1:], start=1):
                if not torch.equal(p, parts[0]):
                    raise ReshardError(f"{files[r]}: replicated parameter '{name}' differs from TP rank 0's")
            tensor = parts[0]
        else:
            tensor = torch.cat(parts, dim=dim)
        if _vocab_rows(name):
            tensor = tensor[: config.vocab_size]
        full[name] = tensor.clone()
    return full, run_config, {"step": states[0].get("step")}


def split(full: dict[str, torch.Tensor], config: ModelConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """Per-rank module state dicts for ``tp`` ranks from full, unpadded weights.

    Raises:
        ValueError: heads, FFN width or padded vocabulary not divisible by ``tp`` (names the sizes).
    """
    from megaformer.parallel.utils import divide

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
        if _vocab_rows(name):
            pad = tensor.new_zeros((padded - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad], dim=0)
        for r in range(tp):
            if dim is None:
                shards[r][name] = tensor.clone()
            else:
                size = divide(tensor.shape[dim], tp)
                shards[r][name] = tensor.narrow(dim, r * size, size).clone().contiguous()
    return shards


def reshard(input_dir: str, output_dir: str, tp: int, tag: str | None = None) -> str:
    """Write ``input_dir``'s weights for ``tp`` ranks under ``output_dir``; return the tag directory."""
    tag_dir = resolve_tag_dir(input_dir, tag)
    full, run_config, extra = consolidate(tag_dir)
    config = ModelConfig(**run_config["model"])
    new_config = copy.deepcopy(run_config)
    new_config["parallel"]["tp_size"] = tp
    shards = split(full, config, tp)
    name = os.path.basename(os.path.normpath(tag_dir))
    out = os.path.join(output_dir, name)
    os.makedirs(out, exist_ok=True)
    for r, module in enumerate(shards):
        state = {
            "module": module,
            # What DeepSpeed's load_checkpoint(load_module_only=True) reads besides the module.
            "dp_world_size": 1,
            "mp_world_size": tp,
            "buffer_names": [],
            "step": extra["step"],
            "config": new_config,
            "resharded_from": os.path.abspath(tag_dir),
        }
        path = os.path.join(out, f"mp_rank_{r:02d}_model_states.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    with open(os.path.join(output_dir, "latest"), "w", encoding="utf-8") as f:
        f.write(name)
    return out


def load_module(
    model: torch.nn.Module, ckpt_dir: str, tp_rank: int, tag: str | None = None
) -> dict[str, Any]:
    """Load TP rank ``tp_rank``'s module weights of a checkpoint saved at the model's TP degree.

    Returns the run config stored with the weights. Raises ``RuntimeError`` (from
    ``load_state_dict``, strict) when the shapes do not match the model's TP degree: reshard first.
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    state = torch.load(
        os.path.join(tag_dir, f"mp_rank_{tp_rank:02d}_model_states.pt"),
        map_location="cpu",
        weights_only=False,
    )
    model.load_state_dict(state["module"], strict=True)
    return state.get("config", {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megaformer.tools.reshard",
        description="Rewrite a checkpoint's module weights for another tensor-parallel degree.",
    )
    parser.add_argument("--input", required=True, help="checkpoints/ directory or one global_stepN directory")
    parser.add_argument("--output", required=True, help="directory to write <tag>/mp_rank_XX_model_states.pt")
    parser.add_argument("--tp", type=int, required=True, help="target tensor-parallel degree")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the input's 'latest')")
    args = parser.parse_args(argv)
    if args.tp < 1:
        print(f"error: --tp={args.tp}: must be >= 1", file=sys.stderr)
        return 2
    try:
        out = reshard(args.input, args.output, args.tp, args.tag)
    except (ReshardError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} for tp={args.tp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
