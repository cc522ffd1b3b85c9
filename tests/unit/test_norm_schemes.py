"""``model.norm_scheme`` (pre_ln / post_ln / deepnorm) and ``model.qkv_ln`` on one process: each
block against a tiny explicit reference written here in plain torch, DeepNorm's α and β, the final
LayerNorm of each scheme, parameter names and TP tags, the config errors, and that pre_ln is today's
model bit for bit."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megaformer.checkpoint.reshard import partition_dims
from megaformer.config import ConfigError, load_config
from megaformer.model import NormFormerBlock, NormFormerLM, count_parameters, deepnorm_beta
from megaformer.tools.generate import generate
from tests.tiny_model import TINY_MODEL

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]

TINY = TINY_MODEL
NF_OFF = dict(post_attn_ln=False, head_scale=False, ffn_ln=False, resid_scale=False)
POST_LN = dataclasses.replace(TINY, norm_scheme="post_ln", **NF_OFF)
DEEPNORM = dataclasses.replace(TINY, norm_scheme="deepnorm", **NF_OFF)
QKV_LN = dataclasses.replace(TINY, qkv_ln=True, resid_scale=True)  # NormFormer + 3 more LN (Table 4)


def _ln(z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(z, (z.shape[-1],), w, b, eps)


def _attention(q, k, v):
    """Causal softmax attention written out: q, k, v ``(B, T, nh, hs)`` -> ``(B, T, nh, hs)``."""
    T, hs = q.shape[1], q.shape[-1]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hs)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


def reference_block(blk: NormFormerBlock, x: torch.Tensor) -> torch.Tensor:
    """The schemes' equations with explicit attention; only the weights are read from ``blk``.

    post_ln:  h = LN1(x + MHA(x)), y = LN2(h + FFN(h))                (Vaswani et al. 2017)
    deepnorm: h = LN1(α x + MHA(x)), y = LN2(α h + FFN(h)), α=(2N)^¼  (Wang et al. 2022, Fig. 2)
    pre_ln + NormFormer + qkv_ln: the paper's layer with LN over each of q, k, v (all d features).
    """
    c = blk.config
    B, T, d = x.shape
    nh, hs = c.num_attention_heads, c.head_dim

    def mha(z):
        qkv = z @ blk.qkv.weight.T + blk.qkv.bias  # (B, T, 3d), rows [heads, 3, hs]
        q, k, v = qkv.view(B, T, nh, 3, hs).unbind(3)  # (B, T, nh, hs) each
        if c.qkv_ln:
            w = blk.qkv_ln.weight.view(nh, 3, hs)
            b = blk.qkv_ln.bias.view(nh, 3, hs)
            # LayerNorm over the d features of q (k, v), all heads together, own gain per feature.
            q, k, v = (
                _ln(t.reshape(B, T, d), w[:, i].reshape(d), b[:, i].reshape(d)).view(B, T, nh, hs)
                for i, t in enumerate((q, k, v))
            )
        heads = _attention(q, k, v)
        if c.head_scale:
            heads = heads * blk.head_scale.view(1, 1, nh, 1)
        return heads.reshape(B, T, d) @ blk.out_proj.weight.T + blk.out_proj.bias

    def ffn(z, ffn_ln=None):
        f = F.gelu(z @ blk.fc1.weight.T + blk.fc1.bias)
        if ffn_ln is not None:
            f = _ln(f, ffn_ln.weight, ffn_ln.bias)
        return f @ blk.fc2.weight.T + blk.fc2.bias

    if c.norm_scheme in ("post_ln", "deepnorm"):
        alpha = (2 * c.num_layers) ** 0.25 if c.norm_scheme == "deepnorm" else 1.0
        h = _ln(alpha * x + mha(x), blk.ln1.weight, blk.ln1.bias)
        return _ln(alpha * h + ffn(h), blk.ln2.weight, blk.ln2.bias)
    a = mha(_ln(x, blk.ln1.weight, blk.ln1.bias))
    if c.post_attn_ln:
        a = _ln(a, blk.post_attn_ln.weight, blk.post_attn_ln.bias)
    h = x + a
    f = ffn(_ln(h, blk.ln2.weight, blk.ln2.bias), blk.ffn_ln if c.ffn_ln else None)
    if c.resid_scale:
        h = blk.resid_scale * h
    return h + f


def _randomize_1d(module: torch.nn.Module, seed: int = 0) -> None:
    """Random gains, shifts and biases, so no LayerNorm hides behind its init 1 / 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("config", [POST_LN, DEEPNORM, QKV_LN], ids=["post_ln", "deepnorm", "qkv_ln"])
def test_block_matches_the_reference_equations(config):
    blk = NormFormerBlock(config, layer_index=1)
    _randomize_1d(blk)
    x = 3 * torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(blk(x), reference_block(blk, x), rtol=1e-5, atol=1e-5)


def test_deepnorm_alpha_and_beta_values_and_alpha_in_the_forward():
    for n, alpha, beta in ((2, 2**0.5, 0.5), (4, 8**0.25, 32**-0.25), (18, 6**0.5, 144**-0.25)):
        blk = NormFormerBlock(dataclasses.replace(DEEPNORM, num_layers=n), layer_index=0)
        assert blk.alpha == pytest.approx(alpha, rel=1e-12)
        assert deepnorm_beta(n) == pytest.approx(beta, rel=1e-12)
    # α acts: the same weights as a Post-LN block give another output unless x is scaled by α.
    deep = NormFormerBlock(DEEPNORM, layer_index=0)
    post = NormFormerBlock(POST_LN, layer_index=0)
    post.load_state_dict(deep.state_dict())
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(deep(x), post(x), atol=1e-3)
    assert NormFormerBlock(POST_LN, layer_index=0).alpha == 1.0


def test_deepnorm_init_scales_w_v_w_o_w1_w2_by_beta_and_keeps_q_k():
    """β·(this project's init) for W_V, W_O, W1, W2 (torchscale's DeepNet); q, k as plain N(0, σ²)."""
    config = dataclasses.replace(DEEPNORM, hidden_size=256, num_layers=6, seq_len=8)
    beta, std = (8 * 6) ** -0.25, config.init_std
    deep = NormFormerBlock(config, layer_index=3).requires_grad_(False)
    post = NormFormerBlock(dataclasses.replace(config, norm_scheme="post_ln"), layer_index=3)  # plain init
    nh, hs, d = config.num_attention_heads, config.head_dim, config.hidden_size
    wd, wp = deep.qkv.weight.view(nh, 3, hs, d), post.qkv.weight.view(nh, 3, hs, d)
    assert torch.equal(wd[:, :2], wp[:, :2])  # q, k untouched
    assert torch.equal(wd[:, 2], wp[:, 2] * beta)  # v scaled after the draw
    for name in ("out_proj", "fc1", "fc2"):
        a, b = getattr(deep, name).weight, getattr(post, name).weight
        torch.testing.assert_close(a, b * beta, rtol=1e-6, atol=0)  # same draw, std β·σ
        assert float(a.detach().std()) == pytest.approx(beta * std, rel=0.02), name
    assert float(wd[:, 0].detach().std()) == pytest.approx(std, rel=0.02)
    # pre_ln keeps GPT-2's 1/sqrt(2N) on W_O and W2; post_ln has no depth-dependent init.
    pre = NormFormerBlock(dataclasses.replace(config, norm_scheme="pre_ln"), layer_index=3)
    torch.testing.assert_close(pre.fc2.weight, post.fc2.weight / math.sqrt(12), rtol=1e-6, atol=0)
    assert torch.equal(pre.fc1.weight, post.fc1.weight) and torch.equal(pre.qkv.weight, post.qkv.weight)


def test_post_schemes_have_no_final_layer_norm_and_the_same_plan():
    for config in (POST_LN, DEEPNORM):
        model = NormFormerLM(config, seed=3)
        pre = NormFormerLM(dataclasses.replace(config, norm_scheme="pre_ln"), seed=3)
        names = [n for n, _ in model.named_parameters()]
        assert names == [n for n, _ in pre.named_parameters() if not n.startswith("3.norm.")]
        assert model.final_norm.norm is None and list(model.final_norm.parameters()) == []
        h = torch.randn(2, 4, 32)
        assert model.final_norm(h) is h
        assert count_parameters(model) == count_parameters(pre) - 2 * config.hidden_size


def test_qkv_ln_parameters_are_sharded_with_the_heads_and_counted():
    model = NormFormerLM(QKV_LN, seed=3)
    base = NormFormerLM(dataclasses.replace(QKV_LN, qkv_ln=False), seed=3)
    assert count_parameters(model) == count_parameters(base) + QKV_LN.num_layers * 2 * 3 * QKV_LN.hidden_size
    dims = partition_dims(QKV_LN)  # what reshard consolidates by
    for i in (1, 2):
        assert dims[f"{i}.qkv_ln.weight"] == dims[f"{i}.qkv_ln.bias"] == dims[f"{i}.qkv.bias"] == 0
    p = model.blocks[0].qkv_ln.weight
    assert p.no_weight_decay and p.shape == (3 * QKV_LN.hidden_size,)
    # Same seed, same values elsewhere: adding qkv_ln leaves every other parameter as it was.
    other = dict(model.named_parameters())
    for n, q in base.named_parameters():
        assert torch.equal(other[n], q), n


def test_qkv_ln_normalises_each_of_q_k_v_over_all_heads():
    blk = NormFormerBlock(QKV_LN, layer_index=0)
    qkv = 5 * torch.randn(2, 3, 3 * 32) + 2
    with torch.no_grad():
        y = blk.qkv_ln(qkv).view(2, 3, 4, 3, 8)  # [heads, 3, head_dim]
    for i in range(3):
        part = y[:, :, :, i].reshape(2, 3, 32)
        torch.testing.assert_close(part.mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
        torch.testing.assert_close(part.var(-1, unbiased=False), torch.ones(2, 3), atol=1e-3, rtol=0)
    per_head = y[:, :, 0, 0]  # one head's q is not normalised on its own
    assert float(per_head.mean(-1).abs().max()) > 1e-3


def _fingerprint(model: torch.nn.Module, tokens: torch.Tensor | None = None) -> str:
    """sha256 of the parameters' names and values, and of the logits on ``tokens`` if given."""
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    if tokens is not None:
        h.update(model(tokens).detach().numpy().tobytes())
    return h.hexdigest()


def _cpu_info() -> tuple[str, set[str]]:
    """(vendor_id, flags) of /proc/cpuinfo; ("", set()) where there is none."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return vendor, flags


_BEFORE_NORM_SCHEME = [  # the three Pre-LN models of the tests below
    TINY,
    dataclasses.replace(TINY, post_attn_ln=False, head_scale=False, ffn_ln=False),
    dataclasses.replace(TINY, resid_scale=True, tie_embeddings=False, position_embedding="learned"),
]
_TOKENS = (2, 16)
# sha256 of the parameters and logits of those models as the code of commit a4cc908 (before
# model.norm_scheme) computes them. The logits' last bits follow the matmul kernels oneDNN/MKL pick
# by vendor and instruction set, so each triple belongs to the CPU it was recorded on.
_AMD_AVX2 = [  # 2026-12-03, a worktree of a4cc908 itself (torch 2.13.0) on an AMD EPYC VM with AVX2
    # and no AVX-512, the CI machine's kind; the current code gives the same three there
    "a7d1c7b1765499135958fa670619fa2bdeb1b9de3901f42dd3f97aaa556ba7c1",
    "34bdea8656d46fae551bd6103afdea0693af520596b018bb0c6b1d7a3949bc3f",
    "409ba7fe6a3dc58f12053d84250cf30248253b8640a43690159e6a2a5a31c4e4",
]
_AT_THE_CHANGE = [  # recorded with b5062af (the change) on that session's x86 VM, without
    # AVX512-FP16/AMX (its vendor and AVX-512 were not written down)
    "0dd77ffa4bcad65b6db98abb0ea3125b81dcedf9ef8bd677edca837185a1e10d",
    "1bd64fe2397d8f58dd96c1e4e8f095a922453ca9ff6432641d4bc25c49b87c09",
    "8e8692771be9bdc719ec7812fb741f6b426906653e13471117b8d8ce7b9636f8",
]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 97, _TOKENS, generator=torch.Generator().manual_seed(1))


def test_pre_ln_parameters_are_bitwise_what_they_were_before_norm_scheme():
    """Parameter names and values hashed by the code of commit a4cc908 (before the change): exact on
    every CPU (initialisation draws from torch's CPU generator, no matmul kernel involved)."""
    expected = [
        "71f3781b52a0ca47a57a1e5d5cf46fb7c32aa0f97f78513ac76526d65a68fb0e",
        "42deb897d879b95ec7b5bff5e86df0d909782551cf7b7d7890923a3fefc06a06",
        "794ec050b532bef7ab3874f1720aa4d4f43c60b34661d7d0bad012d8af7590bb",
    ]
    for config, want in zip(_BEFORE_NORM_SCHEME, expected, strict=True):
        assert _fingerprint(NormFormerLM(config, seed=3)) == want


def test_pre_ln_logits_are_what_they_were_before_norm_scheme():
    """The logits against a4cc908's (tests/fixtures/pre_ln_logits_a4cc908.npz, computed by that
    commit's code on an AMD EPYC VM) to float32 rounding on any CPU; and bitwise, with the
    parameters, on the kind of CPU a4cc908's hashes were recorded on by that commit's own code (AMD,
    AVX2, no AVX-512: this project's CI machines). Elsewhere the hashes taken at the change pass
    too; on other kernels (Sapphire Rapids' AVX512-FP16/AMX, say) the bitwise half is skipped."""
    import numpy as np

    tokens = _tokens()
    recorded = np.load(REPO / "tests" / "fixtures" / "pre_ln_logits_a4cc908.npz")
    got = []
    for i, config in enumerate(_BEFORE_NORM_SCHEME):
        model = NormFormerLM(config, seed=3)
        with torch.no_grad():
            logits = model(tokens)
        # ~1e-6 of a logit of size ~1: a kernel's other summation order, not a changed model
        torch.testing.assert_close(logits, torch.from_numpy(recorded[f"config{i}"]), rtol=1e-5, atol=1e-5)
        got.append(_fingerprint(model, tokens))
    vendor, flags = _cpu_info()
    if vendor == "AuthenticAMD" and "avx2" in flags and "avx512f" not in flags:
        assert got == _AMD_AVX2  # the kind of CPU a4cc908's hashes were recorded on: bitwise
    elif got != _AT_THE_CHANGE:
        pytest.skip(f"logits match a4cc908's to float32 rounding; no bitwise hashes of this CPU ({vendor})")


@pytest.mark.parametrize("config", [POST_LN, DEEPNORM, QKV_LN], ids=["post_ln", "deepnorm", "qkv_ln"])
def test_every_scheme_trains_a_step_and_generates(config):
    model = NormFormerLM(config, seed=3)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    out = generate(model.eval(), config, [1, 2, 3], max_new_tokens=4, temperature=1.0, top_k=0, seed=5)
    assert len(out[0]) == 4 and max(out[0]) < config.vocab_size


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.norm_scheme=postln"], r"model.norm_scheme='postln': use 'pre_ln', 'post_ln' or 'deepnorm'"),
        (
            ["model.norm_scheme=post_ln"],
            r"model.norm_scheme='post_ln' with model.post_attn_ln=true, model.head_scale=true, "
            r"model.ffn_ln=true: .*set model.post_attn_ln=false, model.head_scale=false, model.ffn_ln=false",
        ),
        (
            ["model.norm_scheme=deepnorm", "model.post_attn_ln=false", "model.head_scale=false",
             "model.ffn_ln=false", "model.qkv_ln=true"],
            r"model.norm_scheme='deepnorm' with model.qkv_ln=true: .*set model.qkv_ln=false",
        ),
        (
            ["model.norm_scheme=post_ln", "model.post_attn_ln=false", "model.head_scale=false",
             "model.ffn_ln=false", "model.resid_scale=true"],
            r"with model.resid_scale=true: .*model.norm_scheme='pre_ln'",
        ),
    ],
)  # fmt: skip
def test_config_refuses_unknown_schemes_and_normformer_switches_off_pre_ln(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_config_accepts_every_scheme_and_the_model_refuses_a_bypassed_loader():
    off = ["model.post_attn_ln=false", "model.head_scale=false", "model.ffn_ln=false"]
    assert load_config(None, ["model.norm_scheme=post_ln", *off]).model.norm_scheme == "post_ln"
    assert load_config(None, ["model.norm_scheme=deepnorm", *off]).model.norm_scheme == "deepnorm"
    assert load_config(None, ["model.qkv_ln=true"]).model.qkv_ln  # with NormFormer: the ablation
    with pytest.raises(ConfigError, match=r"model.norm_scheme='deepnorm' with .*model\.head_scale=true"):
        NormFormerBlock(dataclasses.replace(DEEPNORM, head_scale=True), layer_index=0)
    with pytest.raises(ConfigError, match=r"model.norm_scheme='preln'"):
        NormFormerLM(dataclasses.replace(TINY, norm_scheme="preln"))
