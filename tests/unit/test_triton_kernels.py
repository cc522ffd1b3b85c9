"""The Triton kernels of NormFormer's extra operations (:mod:`megaformer.model.kernels`,
``model.fused_kernels``) against the eager operations they replace, on the CPU in Triton's
interpreter (``TRITON_INTERPRET=1``: set by this module where Triton is not imported yet, else the
tests run in a fresh process; tests/support/triton_interpreter.py).

- FFN_LN fused with the activation (GELU erf form, squared ReLU): forward and backward against
  ``F.layer_norm(act(u))`` in fp32 (tight) and bf16 (against an fp64 reference: within twice
  eager's own bf16 error), at row widths that are not powers of two (320 = 80·4, 192 = 3·64).
- POSTATTN_LN with its dropout and residual add, the same way, with and without a keep mask.
- The TP path (statistics of the full row from per-shard kernels, merged and all-reduced in torch):
  shards simulated by splitting the width, the collectives replaced by their results (the stack an
  all-gather returns, the sum an all-reduce returns), against fp64 at |mean| / std = 1, 300, 3,000
  (within 10× of ``F.layer_norm``'s fp32 error, the bound of the eager sharded LayerNorm's test).
- A NormFormer block with ``model.fused_kernels='on'`` equals the eager block (outputs, every
  parameter's gradient, dropout on: the same masks).

Shapes are small: the interpreter runs each program in NumPy, one after the other.
"""

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
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt pins triton==3.6.0)")

import megaformer.model.kernels as kernels
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerBlock
from megaformer.parallel import layers, mappings

if IN_PROCESS and not kernels.interpreted():  # the kernels were imported before the mode was set
    kernels = importlib.reload(kernels)
    sys.modules["megaformer.model.kernels"] = kernels
# Triton's own library (tl.sum ...) is decorated when Triton is imported: when that happened before the
# mode was set, reloading the kernels is not enough (their calls into it reach for a GPU driver), so
# the tests run in a fresh process instead.
IN_PROCESS = IN_PROCESS and kernels.interpreted() and triton_interpreter.library_interpreted()

EPS = 1e-5
ACTS = {"gelu": F.gelu, "relu2": lambda u: F.relu(u).square()}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(fn, inputs, grad_out):
    """``[out, *grads of inputs]`` of ``fn(*inputs)`` back-propagating ``grad_out``."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in ins]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _ffn_inputs(n: int, dtype: torch.dtype, rows: tuple[int, ...] = (2, 5), seed: int = 0):
    u = (1.5 * torch.randn(*rows, n, generator=_gen(seed))).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=_gen(seed + 1))).to(dtype)
    b = torch.randn(n, generator=_gen(seed + 2)).to(dtype)
    dy = torch.randn(*rows, n, generator=_gen(seed + 3)).to(dtype)
    return u, w, b, dy


def _eager_ffn(act: str, n: int):
    return lambda u, w, b: F.layer_norm(ACTS[act](u), (n,), w, b, EPS)


def _fused_ffn(act: str, n: int):
    return lambda u, w, b: kernels.layer_norm_activation(
        u, w, b, activation=act, normalized_size=n, eps=EPS, tp_group=None
    )


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("n", [320, 192])
def test_ffn_ln_activation_equals_eager_fp32(act, n):
    u, w, b, dy = _ffn_inputs(n, torch.float32)
    ours = _grads(_fused_ffn(act, n), (u, w, b), dy)
    ref = _grads(_eager_ffn(act, n), (u, w, b), dy)
    for what, o, r in zip(("y", "du", "dw", "db"), ours, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, what
        torch.testing.assert_close(o, r, rtol=1e-5, atol=2e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("n", [320, 192])
def test_ffn_ln_activation_bf16_as_accurate_as_eager(act, n):
    """bf16 rounds differently in the two paths; both are held to an fp64 reference of the same
    bf16 inputs, ours within twice eager's error (and near eager: a few bf16 ulps)."""
    u, w, b, dy = _ffn_inputs(n, torch.bfloat16, seed=10)
    ours = _grads(_fused_ffn(act, n), (u, w, b), dy)
    ref = _grads(_eager_ffn(act, n), (u, w, b), dy)
    exact = _grads(_eager_ffn(act, n), [t.double() for t in (u, w, b)], dy.double())
    for what, o, r, e in zip(("y", "du", "dw", "db"), ours, ref, exact):
        assert o.dtype == torch.bfloat16 and o.shape == r.shape, what
        assert _max_err(o, e) <= 2 * _max_err(r, e) + 1e-6, (what, _max_err(o, e), _max_err(r, e))
        torch.testing.assert_close(o.float(), r.float(), rtol=3e-2, atol=3e-2 * float(e.abs().max()))


def _eager_post_attn(n: int, keep: torch.Tensor | None, p: float):
    def fn(a, x, w, b):
        y = F.layer_norm(a, (n,), w, b, EPS)
        if keep is not None:  # ATen's CPU dropout: noise = keep / (1 - p) in the dtype, times y
            y = y * keep.to(y.dtype).div_(1 - p)
        return x + y

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [320, 192])
@pytest.mark.parametrize("dropout", [False, True])
def test_post_attn_ln_dropout_residual_equals_eager(dtype, n, dropout):
    p = 0.25
    a, w, b, dh = _ffn_inputs(n, dtype, seed=20)
    x = torch.randn(a.shape, generator=_gen(25)).to(dtype)
    keep = torch.rand(a.shape, generator=_gen(26)) >= p if dropout else None
    scale = float(torch.ones((), dtype=dtype).div_(1 - p))  # eager's CPU factor, rounded to the dtype

    def fused(a, x, w, b):
        return kernels.layer_norm_dropout_residual(a, x, w, b, keep=keep, scale=scale, eps=EPS)

    ours = _grads(fused, (a, x, w, b), dh)
    ref = _grads(_eager_post_attn(n, keep, p), (a, x, w, b), dh)
    names = ("h", "da", "dx", "dw", "db")
    if dtype == torch.float32:
        for what, o, r in zip(names, ours, ref):
            torch.testing.assert_close(o, r, rtol=1e-5, atol=2e-5, msg=lambda m, what=what: f"{what}: {m}")
        return
    exact = _grads(_eager_post_attn(n, keep, p), [t.double() for t in (a, x, w, b)], dh.double())
    for what, o, r, e in zip(names, ours, ref, exact):
        assert o.dtype == torch.bfloat16, what
        assert _max_err(o, e) <= 2 * _max_err(r, e) + 1e-6, (what, _max_err(o, e), _max_err(r, e))


def test_empty_rows_and_refused_inputs():
    u = torch.zeros(0, 192)
    w, b = torch.ones(192), torch.zeros(192)
    assert kernels.layer_norm_activation(
        u, w, b, activation="gelu", normalized_size=192, eps=EPS, tp_group=None
    ).shape == (0, 192)
    with pytest.raises(KeyError, match="'none'"):
        kernels.layer_norm_activation(u, w, b, activation="none", normalized_size=192, eps=EPS, tp_group=None)
    with pytest.raises(ValueError, match="residual"):
        kernels.layer_norm_dropout_residual(
            torch.zeros(2, 192),
            torch.zeros(2, 192, dtype=torch.bfloat16),
            w,
            b,
            keep=None,
            scale=1.0,
            eps=EPS,
        )


# --- the TP path: shards simulated ---------------------------------------------------------------


class _SimGroup:
    """A stand-in TP group of ``size`` ranks, this one ``rank``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _sharded_run(u, w, b, dy, tp, act, n, monkeypatch):
    """Each simulated rank runs the real autograd function on its slice of the width; the two
    collectives return what they would over the group: the all-gather the stack of every rank's
    shard statistics (computed beforehand with the same kernel), the all-reduce the sum of every
    rank's two backward sums (likewise). Returns y, du, dw, db, concatenated over the ranks."""
    k = n // tp
    shards = [
        (u[..., r * k : (r + 1) * k], w[r * k : (r + 1) * k], b[r * k : (r + 1) * k]) for r in range(tp)
    ]
    dys = [dy[..., r * k : (r + 1) * k] for r in range(tp)]
    code = kernels.ACTIVATION_CODES[act]
    # What every rank contributes to the forward's all-gather: [2, rows] (shard mean, shard M2).
    moments = [torch.stack(kernels._act_moments_impl(s[0].reshape(-1, k), code)) for s in shards]
    gathered = torch.stack(moments)  # (tp, 2, rows), rank order
    rank_now = {}

    def world_size(group):
        return 1 if group is None else group.size

    def all_gather_stacked(x, group):
        torch.testing.assert_close(x, moments[group.rank], rtol=0, atol=0)  # what this rank sends
        return gathered.clone()

    monkeypatch.setattr(layers, "tp_world_size", world_size)
    monkeypatch.setattr(kernels, "tp_world_size", world_size)
    monkeypatch.setattr(mappings, "all_gather_stacked", all_gather_stacked)
    # The statistics every rank then holds, for the backward sums every rank contributes.
    mean, rstd = layers.merge_shard_statistics(moments[0][0], moments[0][1], k, n, EPS, _SimGroup(0, tp))
    sums = sum(
        kernels._norm_act_bwd_sums_impl(d.reshape(-1, k), s[0].reshape(-1, k), s[1], mean, rstd, code)
        for d, s in zip(dys, shards)
    )

    def all_reduce(t, group=None, **_):
        assert group is not None and group.rank == rank_now["r"]
        t.copy_(sums)

    monkeypatch.setattr(kernels.dist, "all_reduce", all_reduce)
    outs = []
    for r, ((ur, wr, br), dyr) in enumerate(zip(shards, dys)):
        rank_now["r"] = r
        group = _SimGroup(r, tp)
        outs.append(
            _grads(
                lambda u_, w_, b_, group=group: kernels.layer_norm_activation(
                    u_, w_, b_, activation=act, normalized_size=n, eps=EPS, tp_group=group
                ),
                (ur, wr, br),
                dyr,
            )
        )
    return [torch.cat([o[i] for o in outs], dim=-1) for i in range(4)]


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_statistics_against_fp64(tp, monkeypatch):
    """FFN_LN(GELU(u)) with the width split over ``tp`` simulated ranks, rows whose activation has
    |mean| / std = 1, 300 and 3,000 (a shifted input: GELU is then the identity up to rounding),
    against fp64: within 10x of ``F.layer_norm``'s own fp32 error (as the eager sharded LayerNorm's
    test, tests/distributed/test_tp_layers.py); ``E[a²] − E[a]²`` in fp32 fails this at 300."""
    n = 320
    w = 1 + 0.5 * torch.randn(n, generator=_gen(30))
    b = torch.randn(n, generator=_gen(31))
    dy = torch.randn(3, 4, n, generator=_gen(32))
    for mean in (1.0, 300.0, 3000.0):
        u = mean + torch.randn(3, 4, n, generator=_gen(33))
        exact = _grads(_eager_ffn("gelu", n), [t.double() for t in (u, w, b)], dy.double())
        torch_fp32 = _grads(_eager_ffn("gelu", n), (u, w, b), dy)
        ours = _sharded_run(u, w, b, dy, tp, "gelu", n, monkeypatch)
        for what, o, t, e in zip(("y", "du", "dw", "db"), ours, torch_fp32, exact):
            assert _max_err(o, e) <= 10 * _max_err(t, e) + 1e-7, (mean, what, _max_err(o, e), _max_err(t, e))


def test_sharded_path_equals_the_unsharded_kernel(monkeypatch):
    """At width 192 over 2 simulated ranks (96 each), squared ReLU: the same outputs and gradients
    as the one-rank kernel, to fp32 rounding."""
    u, w, b, dy = _ffn_inputs(192, torch.float32, seed=40)
    whole = _grads(_fused_ffn("relu2", 192), (u, w, b), dy)
    sharded = _sharded_run(u, w, b, dy, 2, "relu2", 192, monkeypatch)
    for what, s, o in zip(("y", "du", "dw", "db"), sharded, whole):
        torch.testing.assert_close(s, o, rtol=1e-5, atol=2e-5, msg=lambda m, what=what: f"{what}: {m}")


# --- the block ---------------------------------------------------------------------------------


def _block(fused: str, **overrides) -> NormFormerBlock:
    # d = 80 and ffn = 320: neither a power of two; 4 heads of 20.
    config = ModelConfig(
        vocab_size=97, hidden_size=80, num_layers=2, num_attention_heads=4, seq_len=8, fused_kernels=fused
    )
    return NormFormerBlock(dataclasses.replace(config, **overrides), layer_index=1, seed=7)


@pytest.mark.parametrize(
    "overrides",
    [
        {"hidden_dropout": 0.2, "attention_dropout": 0.1},  # training with dropout: eager's masks
        {"resid_scale": True, "activation": "relu2"},
    ],
    ids=["dropout", "relu2-resid-scale"],
)
def test_block_with_fused_kernels_equals_the_eager_block(overrides):
    eager, fused = _block("off", **overrides), _block("on", **overrides)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 8, 80, generator=_gen(50))
    grad = torch.randn(2, 8, 80, generator=_gen(51))
    outs = []
    for block in (eager, fused):
        block.train()
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, {k: p.grad for k, p in block.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(
            g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the same generator states after: the fused path drew the masks eager drew
    assert all(
        torch.equal(a, b)
        for a, b in zip(eager.dropout_rng._states.values(), fused.dropout_rng._states.values())
    )


def test_block_in_eval_and_bf16_with_fused_kernels():
    eager, fused = _block("off"), _block("on")
    fused.load_state_dict(eager.state_dict())
    eager, fused = eager.to(torch.bfloat16).eval(), fused.to(torch.bfloat16).eval()
    x = torch.randn(2, 8, 80, generator=_gen(60)).to(torch.bfloat16)
    with torch.no_grad():
        y0, y1 = eager(x), fused(x)
    assert y1.dtype == torch.bfloat16
    torch.testing.assert_close(y1.float(), y0.float(), rtol=2e-2, atol=4e-2)


def test_auto_stays_eager_on_cpu(monkeypatch):
    """``auto`` (the default) takes the eager path for CPU tensors: nothing of the CPU suite changes."""
    block = _block("auto")
    assert ModelConfig().fused_kernels == "auto"
    called = []
    monkeypatch.setattr(kernels, "layer_norm_activation", lambda *a, **k: called.append(1))
    monkeypatch.setattr(kernels, "layer_norm_dropout_residual", lambda *a, **k: called.append(1))
    block(torch.randn(1, 8, 80))
    assert block._fused_kernels(torch.zeros(1)) is None and not called


def test_zero3_partitioned_parameters_keep_the_eager_path():
    """ZeRO-3 gathers a module's parameters in hooks around its forward; the kernels read the
    LayerNorms' weights without calling those modules, so a block whose norms carry DeepSpeed's
    partition tag (``ds_id``) stays eager, even with ``on``."""
    block = _block("on")
    assert block._fused_kernels(torch.zeros(1)) is kernels
    block.ffn_ln.weight.ds_id = 7
    assert block._fused_kernels(torch.zeros(1)) is None


def test_the_switch_is_validated():
    from megaformer.config import ConfigError
    from megaformer.config.load import check_model_config

    with pytest.raises(ConfigError, match=r"model.fused_kernels='yes': use 'auto', 'on' or 'off'"):
        check_model_config(ModelConfig(fused_kernels="yes"))


def test_self_check_passes_here_and_auto_falls_back_when_it_fails(monkeypatch):
    """The check ``auto`` runs once per device and dtype agrees on this CPU (interpreter); a failing
    check warns once and leaves ``auto`` on the eager path (a stand-in CUDA input: the decision
    reads only its device and dtype)."""
    import types
    import warnings

    from megaformer.model import normformer

    kernels._SELF_CHECKS.pop(("cpu", None, torch.float32), None)
    assert kernels.self_check("cpu", None, torch.float32) is None
    block = _block("auto")
    cuda_input = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    monkeypatch.setattr(normformer, "fused_kernels_available", lambda: True)
    monkeypatch.setitem(kernels._SELF_CHECKS, ("cuda", 0, torch.bfloat16), None)
    assert block._fused_kernels(cuda_input) is kernels
    failing = kernels.layer_norm_activation

    def broken(*args, **kwargs):
        raise RuntimeError("CompilationError: at 1:2")

    kernels._SELF_CHECKS.pop(("cuda", 0, torch.bfloat16))
    monkeypatch.setattr(kernels, "layer_norm_activation", broken)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: t)  # the check's inputs stay here
    with pytest.warns(UserWarning, match="the blocks run eager there: RuntimeError: CompilationError"):
        assert block._fused_kernels(cuda_input) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert block._fused_kernels(cuda_input) is None  # cached: said once
    monkeypatch.setattr(kernels, "layer_norm_activation", failing)
    assert _block("off")._fused_kernels(cuda_input) is None


@pytest.fixture(autouse=True)
def _interpreter_here(request):
    if not IN_PROCESS and request.node.originalname != "test_in_a_fresh_process":
        pytest.skip("Triton was imported before its interpreter could be chosen: test_in_a_fresh_process")


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_in_a_fresh_process():
    """This module's tests, run in a new pytest process under Triton's interpreter, where this one
    could not choose it."""
    if IN_PROCESS:
        pytest.skip("this process runs the kernels in Triton's interpreter: the tests ran here")
    triton_interpreter.run_in_fresh_process(__file__, "test_in_a_fresh_process")
