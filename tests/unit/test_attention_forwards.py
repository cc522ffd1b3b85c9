"""Attention with dropout, one forward per micro-batch (issue 36 item 1), on the CPU.

``megaformer::fused_attention_dropout`` (the GPU path of ``model.attention_backend`` auto / flash /
efficient / cudnn) calls its kernel's ATen forward once and hands the saved output, log-sum-exp and
Philox seed and offset to the kernel's ATen backward; the ``sdpa`` operator reruns the forward in
backward. The fused kernels exist on CUDA only, so here the operator runs with CPU stand-ins for the
two ATen calls (``rng_ops._fused_forward`` / ``_fused_backward``) that count their calls and draw
from the generator as a kernel does: the operator's own plumbing (custom op, autograd formula,
saved tensors, generator state, eager and compiled) is what is tested. That the compiled block on
the GPU path holds this operator, and which kernel it names, is the fake-CUDA tier's
``tests/fakecuda/test_attention_forwards.py``; the kernels' masks against eager's, the GPU check's
probe (``bench/gpu_probe.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from megaformer.config import ConfigError
from megaformer.config.load import check_model_config
from megaformer.config.schema import ModelConfig
from megaformer.parallel import rng_ops
from megaformer.parallel.rng import DropoutRNG


@pytest.fixture
def kernel(monkeypatch) -> Counter:
    """CPU stand-ins for the fused kernel's ATen forward and backward, counting real (not fake)
    calls. The forward draws its "seed" from the current generator, as flash takes its Philox
    offset from it; out = q + k + v, so dq = dk = dv = the incoming gradient."""
    calls: Counter = Counter()

    def forward(q, k, v, p, is_causal, backend):
        if not is_fake(q):
            calls["forward"] += 1
            calls[backend] += 1
        seed = torch.randint(0, 2**31, (), dtype=torch.int64)
        return q + k + v, q.sum(-1, dtype=torch.float32), seed, seed.clone()

    def backward(grad, q, k, v, out, lse, seed, offset, p, is_causal, backend):
        if not is_fake(q):
            calls["backward"] += 1
            calls["seed"] = int(seed)
        return grad.clone(), grad.clone(), grad.clone()

    monkeypatch.setattr(rng_ops, "_fused_forward", forward)
    monkeypatch.setattr(rng_ops, "_fused_backward", backward)
    return calls


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, 4, 16, 8, generator=g))
    return q, k, v, torch.randn(2, 4, 16, 8, generator=g)


def _attention(q, k, v, state):
    return rng_ops.fused_attention_dropout(q, k, v, 0.1, True, "flash", state)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_fused_operator_runs_its_forward_once_and_its_own_backward(kernel, compiled):
    q, k, v, grad = _inputs()
    state = DropoutRNG(9).state_dict()["sharded"]
    fn = torch.compile(_attention, fullgraph=True, backend="aot_eager") if compiled else _attention
    out, _lse, seed, _offset, advanced = fn(q, k, v, state)
    torch.autograd.grad(out, (q, k, v), grad)
    assert (kernel["forward"], kernel["backward"], kernel["flash"]) == (1, 1, 1), kernel
    assert kernel["seed"] == int(seed)  # the backward got the seed the forward drew
    # the state advanced by the forward's draw, from the given state (which is left unchanged)
    torch.set_rng_state(state)
    torch.randint(0, 2**31, (), dtype=torch.int64)
    assert torch.equal(advanced, torch.get_rng_state())
    assert torch.equal(state, DropoutRNG(9).state_dict()["sharded"])


def test_compiled_and_eager_fused_operators_give_the_same_outputs_gradients_and_state(kernel):
    q, k, v, grad = _inputs()
    results = []
    for fn in (_attention, torch.compile(_attention, fullgraph=True, backend="aot_eager")):
        state = DropoutRNG(9).state_dict()["sharded"]
        out, _lse, _seed, _offset, advanced = fn(q, k, v, state)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad), advanced])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_sdpa_operator_reruns_the_forward_in_backward(monkeypatch):
    """What ``model.attention_backend=sdpa`` keeps (the code before the switch): two forwards."""
    calls = Counter()
    original = rng_ops._attention

    def counted(*args):
        calls["forward"] += 1
        return original(*args)

    monkeypatch.setattr(rng_ops, "_attention", counted)
    q, k, v, grad = _inputs()
    out, _ = rng_ops.attention_dropout(q, k, v, 0.1, True, DropoutRNG(9).state_dict()["sharded"])
    torch.autograd.grad(out, (q, k, v), grad)
    assert calls["forward"] == 2


@pytest.mark.parametrize(
    ("setting", "dtype", "head_dim", "capability", "want"),
    [
        ("auto", torch.bfloat16, 64, (9, 0), "flash"),  # H100 / H200
        ("auto", torch.float16, 80, (8, 0), "flash"),  # A100, the 2.7B recipe's head dim
        ("auto", torch.float16, 64, (7, 0), "efficient"),  # V100: no flash before sm80
        ("auto", torch.float32, 64, (9, 0), "efficient"),  # flash takes 16-bit only
        ("auto", torch.bfloat16, 264, (9, 0), "efficient"),  # over flash's 256
        ("auto", torch.bfloat16, 60, (9, 0), "efficient"),  # not a multiple of 8
        ("cudnn", torch.bfloat16, 64, (9, 0), "cudnn"),
        ("efficient", torch.bfloat16, 64, (9, 0), "efficient"),
        ("sdpa", torch.bfloat16, 64, (9, 0), None),
    ],
)
def test_the_kernel_each_setting_picks(setting, dtype, head_dim, capability, want):
    assert rng_ops.fused_attention_backend(setting, dtype, head_dim, capability) == want


def test_cpu_attention_with_dropout_is_unchanged_by_the_setting():
    """On a CPU the setting picks nothing: eager and compiled run the math kernel as before."""
    q, k, v, _ = _inputs()
    outs = [
        DropoutRNG(9).attention(q, k, v, 0.1, "sharded", is_causal=True, backend=b)
        for b in ("auto", "cudnn", "sdpa")
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_an_unknown_setting_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.attention_backend='triton': use 'auto', 'flash'"):
        check_model_config(ModelConfig(attention_backend="triton"))
    assert ModelConfig().attention_backend == "auto"


def test_the_backend_bench_runs_its_smoke_case_and_writes_its_rows(tmp_path):
    """``bench/attention_backends.py`` (the GPU's choice of kernel) checked on this CPU: ``--smoke``
    times the sdpa rows only (the fused kernels exist on CUDA) and writes them with the share of
    the no-dropout speed."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "attention_backends.py"
    spec = importlib.util.spec_from_file_location("attention_backends", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json", str(tmp_path / "ab.json")]) == 0
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["sdpa p=0.1 (rerun)", "sdpa p=0"]
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows)
    assert rows[0]["forward_share"] > 0 and "forward_share" not in rows[1]
