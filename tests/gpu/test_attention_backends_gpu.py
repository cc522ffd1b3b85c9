"""Attention with dropout on each fused kernel (``model.attention_backend``, issue 36 item 1) on a
real GPU, where the kernels exist (the CPU tests run the operator with stand-in kernels): the
compiled operator ``megaformer::fused_attention_dropout`` against eager SDPA pinned to the same
kernel, from the same generator state. Outputs, the q/k/v gradients (so the backward regenerated the
forward's mask) and the advanced states equal bitwise; the profiled forward and backward run the
kernel's forward once. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megaformer.parallel import rng_ops
from megaformer.parallel.rng import DropoutRNG

FORWARD_OPS = {
    "flash": "aten::_scaled_dot_product_flash_attention",
    "efficient": "aten::_scaled_dot_product_efficient_attention",
    "cudnn": "aten::_scaled_dot_product_cudnn_attention",
}


def _case(backend: str, dtype: torch.dtype, head_dim: int):
    if backend == "flash" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs compute capability 8.0+")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 4, 256, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(shape, device="cuda", generator=g, dtype=dtype)


def _run(fn, q, k, v, grad):
    rng = DropoutRNG(9, device="cuda")
    out = fn(rng, q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad), rng.state_dict()["sharded"]]


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_compiled_fused_attention_dropout_is_eager_bitwise(backend, dtype, head_dim):
    q, k, v, grad = _case(backend, dtype, head_dim)

    def core(rng, q, k, v):
        return rng.attention(q, k, v, 0.1, "sharded", is_causal=True, backend=backend)

    try:
        want = _run(core, q, k, v, grad)
    except RuntimeError as e:  # e.g. cuDNN's attention absent from this build or for this shape
        pytest.skip(f"{backend} cannot run here: {e}")
    torch._dynamo.reset()
    got = _run(torch.compile(core, fullgraph=True), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv", "state"), got, want, strict=True):
        assert torch.equal(a, b), (backend, name, float((a.float() - b.float()).abs().max()))
    # the mask was applied: the output is not attention without dropout
    assert not torch.equal(want[0], torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_the_fused_operator_runs_the_kernels_forward_once(backend):
    q, k, v, grad = _case(backend, torch.bfloat16, 64)
    state = DropoutRNG(9, device="cuda").state_dict()["sharded"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = rng_ops.fused_attention_dropout(q, k, v, 0.1, True, backend, state)[0]
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
    counts = {e.key: e.count for e in prof.key_averages() if "scaled_dot_product" in e.key}
    assert counts.get(FORWARD_OPS[backend]) == 1, counts
    assert counts.get(FORWARD_OPS[backend] + "_backward") == 1, counts
