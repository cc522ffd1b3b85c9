"""A compiled NormFormer block (``train.compile``: ``fullgraph=True``, inductor) with
``model.fused_kernels='on'`` equals the eager block without them, on the CPU with the kernels in
Triton's interpreter: the kernels' custom operators, their fake functions and the TP-free autograd
functions hold in one graph with dropout on. Marked slow (about a minute of compilation on the
2-core machine); the kernels themselves are tested in tests/unit/test_triton_kernels.py."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton builds the kernels (at their module's import)

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt pins triton==3.6.0)")

import megaformer.model.kernels as kernels
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerBlock
from megaformer.model.compile import why_not_compiled

if not kernels.interpreted():  # imported earlier in this process, built for a GPU: rebuild
    kernels = importlib.reload(kernels)
    sys.modules["megaformer.model.kernels"] = kernels


@pytest.mark.slow
def test_compiled_block_with_kernels_equals_the_eager_block():
    why = why_not_compiled(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    config = ModelConfig(
        vocab_size=97, hidden_size=80, num_layers=2, num_attention_heads=4, seq_len=8, hidden_dropout=0.2
    )
    eager = NormFormerBlock(dataclasses.replace(config, fused_kernels="off"), layer_index=1, seed=7)
    fused = NormFormerBlock(dataclasses.replace(config, fused_kernels="on"), layer_index=1, seed=7)
    fused.load_state_dict(eager.state_dict())
    fused.compile(fullgraph=True, dynamic=False)
    x = torch.randn(2, 8, 80, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 8, 80, generator=torch.Generator().manual_seed(2))
    outs = []
    for block in (eager, fused):
        block.train()
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(grad)
        outs.append([y.detach(), xi.grad] + [p.grad for p in block.parameters()])
    # inductor reorders the reductions around the kernels: close, not bitwise
    for o, r in zip(outs[1], outs[0]):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=5e-5)
    states = zip(eager.dropout_rng._states.values(), fused.dropout_rng._states.values())
    assert all(torch.equal(a, b) for a, b in states)  # the same draws
