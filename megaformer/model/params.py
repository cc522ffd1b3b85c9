"""Optimizer parameter groups and parameter counts for the models of :mod:`megaformer.model`."""

from __future__ import annotations

from torch import nn

PARAM_ORDERS = ("declared", "aligned")
"""The orders :func:`param_groups` can list a group's parameters in (a checkpoint's manifest names
the one its optimizer state was saved in: ``optimizer_param_order``)."""

ALIGN_ELEMENTS = 16
"""A parameter whose element count is a multiple of this keeps the next one in a flat buffer
aligned: 32 bytes in bf16/fp16, 64 in fp32 (cuBLAS and Triton want 16)."""


def aligned_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` with the ones whose size is not a multiple of :data:`ALIGN_ELEMENTS` moved to the
    end (a stable partition: each part keeps its order).

    Why: DeepSpeed's bf16/fp16 optimizers (BF16_Optimizer, ZeRO-1/2) copy each group's parameters
    into one flat buffer, in the group's order, with no padding between them, and make every
    parameter a view into it. One odd-sized parameter, e.g. HeadScale's γ (``num_heads`` = 12
    elements, 24 bytes in bf16, at 125M), shifts every later parameter of the group off a 16-byte
    boundary. On an H200 (bench/results/gpu/2026-11-26-h200) half the 125M NormFormer layers'
    weights were 8 bytes off; cuBLAS then ran those GEMMs with sm80 CUTLASS kernels at about half
    the speed of the Hopper ones, and NormFormer's step took 1.21x Pre-LN's.
    """
    head = [p for p in params if p.numel() % ALIGN_ELEMENTS == 0]
    tail = [p for p in params if p.numel() % ALIGN_ELEMENTS != 0]
    return head + tail


def param_groups(
    model: nn.Module, weight_decay: float, decay_params: str = "matrices", order: str = "declared"
) -> list[dict]:
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
        each parameter once (tied parameters are not repeated); ready for ``torch.optim.AdamW``
        or ``deepspeed.initialize(model_parameters=...)``. ``order="declared"``: each group in
        the model's parameter order; ``"aligned"``: then :func:`aligned_order` (what training
        uses, so that DeepSpeed's flat buffers keep every parameter aligned).

    Raises:
        ValueError: ``decay_params`` other than ``"matrices"`` / ``"all"``, or ``order`` not one of
            :data:`PARAM_ORDERS`.
    """
    if decay_params not in ("matrices", "all"):
        raise ValueError(f"train.weight_decay_params={decay_params!r}; use 'matrices' or 'all'")
    if order not in PARAM_ORDERS:
        raise ValueError(f"parameter order {order!r}; use one of {', '.join(PARAM_ORDERS)}")
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        exempt = decay_params == "matrices" and getattr(p, "no_weight_decay", False)
        (no_decay if exempt else decay).append(p)
    if order == "aligned":
        decay, no_decay = aligned_order(decay), aligned_order(no_decay)
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
