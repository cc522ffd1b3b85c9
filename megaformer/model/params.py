"""Optimizer parameter groups and parameter counts for the models of :mod:`megaformer.model`."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float, decay_params: str = "matrices") -> list[dict]:
    """``model``'s trainable parameters in optimizer groups, by ``train.weight_decay_params``.

    ``decay_params="matrices"`` (default): parameters tagged ``no_weight_decay=True`` (biases, every
    LayerNorm gain and shift, HeadScale ``g`` and ResScale ``λ``; set where they are created) take no
    weight decay, as GPT practice does (nanoGPT ``configure_optimizers``); weight matrices and
    embeddings take ``weight_decay``. ``"all"``: one group, every parameter decayed, as fairseq
    (``fairseq/optim/adam.py``: its Adam gets all parameters in one group), whose runs produced the
    paper's numbers.

    Returns:
        ``"matrices"``: ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...],
        "weight_decay": 0.0}]``; ``"all"``: ``[{"params": [...], "weight_decay": weight_decay}]``;
        in parameter order, each parameter once (tied parameters are not repeated); ready for
        ``torch.optim.AdamW`` or ``deepspeed.initialize(model_parameters=...)``.

    Raises:
        ValueError: ``decay_params`` other than ``"matrices"`` / ``"all"``.
    """
    if decay_params not in ("matrices", "all"):
        raise ValueError(f"train.weight_decay_params={decay_params!r}; use 'matrices' or 'all'")
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        exempt = decay_params == "matrices" and getattr(p, "no_weight_decay", False)
        (no_decay if exempt else decay).append(p)
    if decay_params == "all":
        return [{"params": decay, "weight_decay": weight_decay}]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def count_parameters(model: nn.Module, tp_size: int = 1) -> int:
    """Number of parameter elements of the whole model (each shared tensor counted once).

    With ``tp_size`` = 1 (the default) this is what THIS rank holds. With the model's TP degree it
    is the full model: sharded parameters (``tensor_model_parallel=True``, equal slices on every
    rank) count ``tp_size`` times, replicated ones once; the vocabulary padding of that TP degree
    is included. Buffers (the sinusoidal position table) are not counted.
    """
    return sum(
        p.numel() * (tp_size if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters()
    )
