"""The Triton kernels of ``model.fused_kernels`` compiled for the GPU (the CPU tests run them in
Triton's interpreter, another program): against the eager operations at the 125M recipe's widths
(d 768, ffn 3,072), bf16 and fp32, and a block with the kernels against the eager block, eager and
compiled. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaformer.config.schema import ModelConfig

D, FFN = 768, 3072


def _grads(fn, inputs, grad_out):
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in ins]


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ffn_kernel_on_the_gpu_as_accurate_as_eager(dtype):
    from megaformer.model import kernels

    assert not kernels.interpreted()
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(4096, FFN, device="cuda", generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(FFN, device="cuda", generator=g)).to(dtype)
    b = torch.randn(FFN, device="cuda", generator=g).to(dtype)
    dy = torch.randn(4096, FFN, device="cuda", generator=g).to(dtype)

    def fused(u, w, b):
        return kernels.layer_norm_activation(
            u, w, b, activation="gelu", normalized_size=FFN, eps=1e-5, tp_group=None
        )

    def eager(u, w, b):
        return F.layer_norm(F.gelu(u), (FFN,), w, b, 1e-5)

    ours, ref = _grads(fused, (u, w, b), dy), _grads(eager, (u, w, b), dy)
    exact = _grads(eager, [t.double() for t in (u, w, b)], dy.double())
    for what, o, r, e in zip(("y", "du", "dw", "db"), ours, ref, exact):
        assert _err(o, e) <= 2 * _err(r, e) + 1e-5, (what, _err(o, e), _err(r, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_attn_kernel_on_the_gpu_as_accurate_as_eager(dtype):
    from megaformer.model import kernels

    g = torch.Generator(device="cuda").manual_seed(1)
    a, x, dh = (torch.randn(4096, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    w = (1 + 0.5 * torch.randn(D, device="cuda", generator=g)).to(dtype)
    b = torch.randn(D, device="cuda", generator=g).to(dtype)
    keep = torch.rand(4096, D, device="cuda", generator=g) >= 0.1
    scale = 1.0 / 0.9

    def fused(a, x, w, b):
        return kernels.layer_norm_dropout_residual(a, x, w, b, keep=keep, scale=scale, eps=1e-5)

    def eager(a, x, w, b):
        return x + F.layer_norm(a, (D,), w, b, 1e-5) * keep * scale

    ours, ref = _grads(fused, (a, x, w, b), dh), _grads(eager, (a, x, w, b), dh)
    exact = _grads(eager, [t.double() for t in (a, x, w, b)], dh.double())
    for what, o, r, e in zip(("h", "da", "dx", "dw", "db"), ours, ref, exact):
        assert _err(o, e) <= 2 * _err(r, e) + 1e-5, (what, _err(o, e), _err(r, e))


@pytest.mark.parametrize(("setting", "compiled"), [("on", False), ("auto", True)])
def test_block_with_kernels_equals_the_eager_block_on_the_gpu(setting, compiled):
    """``on`` eager, and ``auto`` compiled (the recipes' path on a GPU: the self check runs at trace
    time and must pass, so the kernels are what ran)."""
    from megaformer.model import NormFormerBlock, kernels

    shape = {"vocab_size": 50304, "hidden_size": D, "num_layers": 12, "num_attention_heads": 12}
    config = ModelConfig(**shape, seq_len=256, hidden_dropout=0.1)
    eager = NormFormerBlock(dataclasses.replace(config, fused_kernels="off"), layer_index=3, seed=5).cuda()
    fused = NormFormerBlock(dataclasses.replace(config, fused_kernels=setting), layer_index=3, seed=5).cuda()
    fused.load_state_dict(eager.state_dict())
    if compiled:
        fused.compile(fullgraph=True, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, 256, D, device="cuda", generator=g)
    grad = torch.randn(4, 256, D, device="cuda", generator=g)
    outs = []
    for block in (eager, fused):
        block.train()
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(grad)
        outs.append([y.detach(), xi.grad] + [p.grad for p in block.parameters()])
    if setting == "auto":
        assert kernels._SELF_CHECKS.get(("cuda", x.device.index, torch.float32), "not run") is None
    for o, r in zip(outs[1], outs[0]):
        scale = float(r.abs().max()) or 1.0
        assert _err(o, r) <= 1e-4 * scale, (_err(o, r), scale)
