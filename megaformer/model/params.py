"""Optimizer parameter groups and parameter counts for the models of :mod:`megaformer.model`."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split ``model``'s trainable parameters into a decayed and a not-decayed group.

    Parameters tagged ``no_weight_decay=True`` (biases, every LayerNorm gain and shift, HeadScale
    ``g`` and ResScale ``λ``; set where they are created) take no weight decay, as the paper's
    setup and GPT practice prescribe; weight matrices and embeddings take ``weight_decay``.

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...], "weight_decay": 0.0}]``
        in parameter order, each parameter once (tied parameters are not repeated); ready for
        ``torch.optim.AdamW`` or ``deepspeed.initialize(model_parameters=...)``.
    """
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if getattr(p, "no_weight_decay", False) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements held by THIS rank (each shared tensor counted once).

    At TP > 1 this is the local shard count; sum it over the TP group for sharded parameters only
    to get the full model size. Buffers (the sinusoidal position table) are not counted.
    """
    return sum(p.numel() for p in model.parameters())
