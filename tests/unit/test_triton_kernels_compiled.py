"""A compiled NormFormer block (``train.compile``: ``fullgraph=True``, inductor) with
``model.fused_kernels='on'`` equals the eager block without them, on the CPU with the kernels in
Triton's interpreter: the kernels' custom operators, their fake functions and the TP-free autograd
functions hold in one graph with dropout on. Marked slow (about a minute of compilation on the
2-core machine); the kernels themselves are tested in tests/unit/test_triton_kernels.py."""

# ruff: noqa: E402  (the imports after Triton's mode is chosen)
from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import pytest

from tests.support import triton_interpreter

# Triton's interpreter must be chosen before Triton is imported; where that is too late (another
# test module of this session imported it), the tests run in a fresh process (the last test).
# Kernels run here only where the interpreter was chosen before this process imported anything (the
# fresh process of test_in_a_fresh_process sets it in its environment): a full session imports
# Triton earlier through torch._dynamo, and a reload then still reached for a GPU driver.
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" and triton_interpreter.enable()

import torch

pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt pins triton==3.6.0)")

import megaformer.model.kernels as kernels
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerBlock
from megaformer.model.compile import why_not_compiled

if IN_PROCESS and not kernels.interpreted():  # the kernels were imported before the mode was set
    kernels = importlib.reload(kernels)
    sys.modules["megaformer.model.kernels"] = kernels
# Triton's own library (tl.sum ...) is decorated when Triton is imported: when that happened before the
# mode was set, reloading the kernels is not enough (their calls into it reach for a GPU driver), so
# the tests run in a fresh process instead.
IN_PROCESS = IN_PROCESS and kernels.interpreted() and triton_interpreter.library_interpreted()


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


@pytest.fixture(autouse=True)
def _interpreter_here(request):
    if not IN_PROCESS and request.node.originalname != "test_in_a_fresh_process":
        pytest.skip("Triton was imported before its interpreter could be chosen: test_in_a_fresh_process")


@pytest.mark.slow
def test_in_a_fresh_process():
    """This module's tests, run in a new pytest process under Triton's interpreter, where this one
    could not choose it."""
    if IN_PROCESS:
        pytest.skip("this process runs the kernels in Triton's interpreter: the tests ran here")
    triton_interpreter.run_in_fresh_process(__file__, "test_in_a_fresh_process")
