"""Attention with dropout runs its forward once per micro-batch on the GPU path (issue 36 item 1):
a NormFormer block compiled on fake CUDA holds the fused kernel's operator in its forward graph and
that kernel's own backward in its backward graph, and no operator that reruns the forward
(``megaformer::attention_dropout_backward``, which ``model.attention_backend=sdpa`` keeps, and the
code before the switch ran: the H200 profiles' 192 attention forwards for 96). Flash attention on an
A100 in bf16, the memory-efficient kernel on a V100 (no flash before sm80). The operators' own
forward and backward counts are checked on the CPU in ``tests/unit/test_attention_forwards.py``."""

from __future__ import annotations

import json

import pytest

from megaformer.perf.fakecuda.launch import run_python

# Each case compiles a block in a fresh fake-CUDA process (6-9 s on 2 cores): outside `check.sh --fast`.
pytestmark = pytest.mark.slow

FUSED = "megaformer.fused_attention_dropout.default"
RERUN = "megaformer.attention_dropout_backward.default"


def _graphs(gpu: str, backend: str) -> dict:
    proc = run_python(["-m", "tests.fakecuda.attention_forwards", gpu, backend], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("gpu", "kernel"), [("a100-80gb", "flash"), ("v100-32gb", "efficient")])
def test_compiled_attention_dropout_runs_one_forward_and_the_kernels_own_backward(shim, gpu, kernel):
    graphs = _graphs(gpu, "auto")
    assert graphs["forward"] == {f"{FUSED} {kernel}": 1}, graphs
    assert graphs["backward"] == {f"megaformer.fused_attention_dropout_backward.default {kernel}": 1}, graphs


def test_the_sdpa_setting_keeps_the_operator_that_reruns_the_forward(shim):
    graphs = _graphs("a100-80gb", "sdpa")
    assert graphs["forward"] == {"megaformer.attention_dropout.default": 1}, graphs
    assert graphs["backward"] == {RERUN: 1}, graphs
