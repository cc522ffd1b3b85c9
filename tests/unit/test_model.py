"""NormFormerLM (the one model: the trainer's, the checkpoints') / NormFormerBlock on one process:
shapes, causality, parameter counts per switch, the block against an independent reference of the
paper's equations, vocabulary padding, checkpoint names."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from megaformer.config.schema import ConfigError, ModelConfig
from megaformer.model import NormFormerBlock, NormFormerLM, count_parameters, param_groups
from tests.tiny_model import TINY_MODEL

torch.set_num_threads(1)

TINY = TINY_MODEL
ALL_OFF = dict(post_attn_ln=False, head_scale=False, ffn_ln=False, resid_scale=False)
ALL_ON = dict(post_attn_ln=True, head_scale=True, ffn_ln=True, resid_scale=True)


def cfg(**kw) -> ModelConfig:
    return dataclasses.replace(TINY, **kw)


def batch(config: ModelConfig, b: int = 2, t: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = t or config.seq_len
    tokens = torch.randint(0, config.vocab_size, (b, t), generator=g)
    labels = torch.randint(0, config.vocab_size, (b, t), generator=g)
    return tokens, labels


# --- 1. shapes, gradients, causality ----------------------------------------------------------------


@pytest.mark.parametrize("switches", [ALL_OFF, ALL_ON], ids=["pre-ln", "all-on"])
@pytest.mark.parametrize(
    "variant", [{}, dict(position_embedding="learned", activation="relu2", tie_embeddings=False)]
)
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient(switches, variant):
    config = cfg(**switches, **variant)
    model = NormFormerLM(config)
    tokens, labels = batch(config, b=3, t=10)
    logits = model(tokens)
    assert logits.shape == (3, 10, config.padded_vocab_size()) == (3, 10, 112)
    assert logits.dtype == torch.float32
    loss = model(tokens, labels)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        # Every parameter but the (never used) padded embedding rows gets a nonzero gradient.
        assert p.grad.abs().sum() > 0, name


def test_causal_changing_token_t_leaves_earlier_logits_unchanged():
    config = cfg(**ALL_ON)
    model = NormFormerLM(config).eval()
    tokens, _ = batch(config, b=1)
    t = 7
    changed = tokens.clone()
    changed[0, t] = (tokens[0, t] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:, : config.vocab_size], b[:, t:, : config.vocab_size])


def test_sequence_longer_than_seq_len_is_refused():
    model = NormFormerLM(TINY)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_labels_of_another_shape_are_refused():
    model = NormFormerLM(TINY)
    tokens, labels = batch(TINY, b=2, t=8)
    with pytest.raises(ValueError, match="labels"):
        model(tokens, labels[:, :-1])


def test_unknown_activation_is_a_config_error():
    with pytest.raises(ConfigError, match="activation"):
        NormFormerLM(cfg(activation="swish"))


# --- 2. parameter counts per switch ---------------------------------------------------------------


def baseline_count(c: ModelConfig) -> int:
    """Pre-LN GPT with tied embeddings and sinusoidal positions, by formula."""
    d, f, v = c.hidden_size, c.ffn_size, c.padded_vocab_size()
    per_layer = (
        2 * d  # LN1
        + 3 * d * d + 3 * d  # fused QKV
        + d * d + d  # W_O
        + 2 * d  # LN2
        + d * f + f  # W1
        + f * d + d  # W2
    )  # fmt: skip
    return v * d + c.num_layers * per_layer + 2 * d  # embedding, layers, final LN


@pytest.mark.parametrize(
    ("change", "extra"),
    [
        (dict(post_attn_ln=True), lambda c: c.num_layers * 2 * c.hidden_size),
        (dict(head_scale=True), lambda c: c.num_layers * c.num_attention_heads),
        (dict(ffn_ln=True), lambda c: c.num_layers * 2 * c.ffn_size),
        (dict(resid_scale=True), lambda c: c.num_layers * c.hidden_size),
        (dict(position_embedding="learned"), lambda c: c.seq_len * c.hidden_size),
        (dict(tie_embeddings=False), lambda c: c.padded_vocab_size() * c.hidden_size),
        (dict(activation="relu2"), lambda c: 0),
    ],
    ids=["post_attn_ln", "head_scale", "ffn_ln", "resid_scale", "learned_pos", "untied", "relu2"],
)
def test_each_switch_adds_exactly_its_parameters(change, extra):
    base = cfg(**ALL_OFF)
    assert count_parameters(NormFormerLM(base)) == baseline_count(base)
    changed = dataclasses.replace(base, **change)
    assert count_parameters(NormFormerLM(changed)) == baseline_count(base) + extra(base)


def test_default_config_parameter_count():
    c = ModelConfig()  # post_attn_ln, head_scale, ffn_ln on
    expected = baseline_count(c) + c.num_layers * (2 * c.hidden_size + c.num_attention_heads + 2 * c.ffn_size)
    assert count_parameters(NormFormerLM(c)) == expected == 16_047_632


# --- 3. the block against the paper's equations ----------------------------------------------------


def reference_block(blk: NormFormerBlock, x: torch.Tensor) -> torch.Tensor:
    """NormFormer layer (arXiv:2110.09456, Fig. 1 / Sec. 2) written out with explicit softmax attention."""
    c = blk.config
    B, T, d = x.shape
    nh, hs = c.num_attention_heads, c.head_dim
    ln = lambda z, m: F.layer_norm(z, (z.shape[-1],), m.weight, m.bias, c.layernorm_eps)  # noqa: E731
    qkv = (ln(x, blk.ln1) @ blk.qkv.weight.T + blk.qkv.bias).view(
        B, T, nh, 3, hs
    )  # fused rows [heads, 3, hs]
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # (B, T, nh, hs)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hs)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)  # (B, T, nh, hs)
    if c.head_scale:
        heads = heads * blk.head_scale.view(1, 1, nh, 1)  # g_i head_i, before W_O
    a = heads.reshape(B, T, d) @ blk.out_proj.weight.T + blk.out_proj.bias
    if c.post_attn_ln:
        a = ln(a, blk.post_attn_ln)
    h = x + a
    f = ln(h, blk.ln2) @ blk.fc1.weight.T + blk.fc1.bias
    f = F.relu(f) ** 2 if c.activation == "relu2" else F.gelu(f)
    if c.ffn_ln:
        f = ln(f, blk.ffn_ln)
    f = f @ blk.fc2.weight.T + blk.fc2.bias
    if c.resid_scale:
        h = blk.resid_scale * h
    return h + f


def randomize_scales(module: torch.nn.Module, seed: int = 0) -> None:
    """Give every 1-D parameter (norms, biases, g, λ) random values, so no switch hides behind init 1/0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


SWITCH_COMBOS = [dict(zip(ALL_OFF, bits)) for bits in itertools.product([False, True], repeat=4)]


@pytest.mark.parametrize(
    "switches", SWITCH_COMBOS, ids=lambda s: "-".join(k for k, v in s.items() if v) or "pre-ln"
)
def test_block_matches_reference_equations_for_every_switch_combination(switches):
    config = cfg(**switches, activation="relu2" if switches["resid_scale"] else "gelu")
    blk = NormFormerBlock(config, layer_index=0)
    randomize_scales(blk)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(blk(x), reference_block(blk, x), rtol=1e-5, atol=1e-5)


def test_pre_ln_baseline_has_no_normformer_modules():
    blk = NormFormerBlock(cfg(**ALL_OFF), layer_index=0)
    assert blk.post_attn_ln is None and blk.head_scale is None
    assert blk.ffn_ln is None and blk.resid_scale is None


def test_head_scale_acts_before_w_o():
    # g_0 = 0 must equal W_O never seeing head 0: zero the W_O input columns of head 0 instead.
    config = cfg(**{**ALL_OFF, "head_scale": True})
    blk = NormFormerBlock(config, layer_index=0)
    x = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(2))
    hs = config.head_dim
    with torch.no_grad():
        blk.head_scale[0] = 0.0
        scaled = blk.attention(x)
        blk.head_scale.fill_(1.0)
        blk.out_proj.weight[:, :hs] = 0.0
        zeroed = blk.attention(x)
    torch.testing.assert_close(scaled, zeroed, rtol=0, atol=1e-6)


def test_resid_scale_scales_only_the_ffn_residual():
    config = cfg(**ALL_ON)
    blk = NormFormerBlock(config, layer_index=0)
    x = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = x + blk.post_attn_ln(blk.attention(x))  # the attention residual is not scaled
        y1 = blk(x)
        blk.resid_scale.fill_(2.0)
        y2 = blk(x)
    torch.testing.assert_close(y2 - y1, h, rtol=1e-5, atol=1e-5)


def test_output_projections_use_gpt2_scaled_init():
    config = cfg(num_layers=8, hidden_size=64, ffn_hidden_size=256)
    blk = NormFormerBlock(config, layer_index=0)
    scaled = config.init_std / math.sqrt(2 * config.num_layers)
    assert blk.out_proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert blk.fc2.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert blk.fc1.weight.std().item() == pytest.approx(config.init_std, rel=0.1)


def test_block_built_alone_equals_block_inside_the_model():
    # Pipeline stages build blocks one by one; they must get the same weights as the full model.
    model = NormFormerLM(TINY, seed=7)
    alone = NormFormerBlock(TINY, layer_index=1, seed=7)
    for (name, a), b in zip(model.blocks[1].state_dict().items(), alone.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    other = NormFormerLM(TINY, seed=8)
    assert not torch.equal(other.blocks[1].qkv.weight, model.blocks[1].qkv.weight)
    assert not torch.equal(model.blocks[0].qkv.weight, model.blocks[1].qkv.weight)


def test_parameter_names_are_the_checkpoint_names():
    """``tied_modules.embed.*``, ``<plan index>.*``: the names of every checkpoint, at every layout."""
    config = cfg(**ALL_ON, position_embedding="learned", tie_embeddings=False)
    model = NormFormerLM(config)
    block = ["head_scale", "resid_scale", "ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias",
             "out_proj.weight", "out_proj.bias", "post_attn_ln.weight", "post_attn_ln.bias",
             "ln2.weight", "ln2.bias", "fc1.weight", "fc1.bias", "ffn_ln.weight", "ffn_ln.bias",
             "fc2.weight", "fc2.bias"]  # fmt: skip
    expected = ["tied_modules.embed.position", "tied_modules.embed.token.weight"]
    expected += [f"{i}.{name}" for i in (1, 2) for name in block]
    expected += ["3.norm.weight", "3.norm.bias", "4.proj.weight"]
    assert [n for n, _ in model.named_parameters()] == expected
    assert list(model.state_dict()) == expected  # the sinusoidal table would be a non-saved buffer
    assert model.blocks == [getattr(model, "1"), getattr(model, "2")]
    assert model.final_norm is getattr(model, "3") and model.output is getattr(model, "4")
    assert NormFormerLM(cfg()).output is None  # tied: the embedding projects


# --- 4. vocabulary padding -------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_padded_vocab_gets_no_probability_mass_and_loss_matches_torch(tie):
    config = cfg(tie_embeddings=tie)
    model = NormFormerLM(config)
    tokens, labels = batch(config)
    logits = model(tokens)
    probs = logits.softmax(-1)
    assert torch.all(probs[..., config.vocab_size :] == 0)
    expected = F.cross_entropy(
        logits[..., : config.vocab_size].reshape(-1, config.vocab_size), labels.reshape(-1)
    )
    torch.testing.assert_close(model(tokens, labels), expected, rtol=1e-6, atol=1e-6)


# --- optimizer groups ------------------------------------------------------------------------------


def test_param_groups_put_norms_biases_and_scales_in_no_decay():
    model = NormFormerLM(cfg(**ALL_ON, position_embedding="learned", tie_embeddings=False))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay_names == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert any("head_scale" in n for n in no_decay_names) and any("resid_scale" in n for n in no_decay_names)
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # accepted as is


def test_parameters_carry_tensor_parallel_tags():
    model = NormFormerLM(cfg(**ALL_ON))
    for name, p in model.named_parameters():
        assert hasattr(p, "tensor_model_parallel"), name
        if p.tensor_model_parallel:
            assert p.partition_dim in (0, 1), name
    blk = model.blocks[0]
    assert blk.qkv.weight.tensor_model_parallel and blk.qkv.weight.partition_dim == 0
    assert blk.out_proj.weight.partition_dim == 1 and not blk.out_proj.bias.tensor_model_parallel
    assert blk.ffn_ln.weight.tensor_model_parallel and blk.head_scale.tensor_model_parallel
    assert not blk.post_attn_ln.weight.tensor_model_parallel and not blk.resid_scale.tensor_model_parallel


def test_embedding_scales_tokens_by_sqrt_d_and_adds_sinusoids():
    """fairseq's input: sqrt(d)·E[token] + sinusoid, E ~ N(0, d^-0.5), so both have unit scale."""
    from megaformer.model.normformer import sinusoidal_positions

    config = cfg()
    model = NormFormerLM(config, seed=3)
    tokens, _ = batch(config)
    d = config.hidden_size
    weight = model.embedding.token.weight
    expected = math.sqrt(d) * weight[tokens] + sinusoidal_positions(config.seq_len, d)[: tokens.shape[1]]
    torch.testing.assert_close(model.embedding(tokens), expected)
    real_rows = weight[: config.vocab_size]
    assert real_rows.std().item() == pytest.approx(d**-0.5, rel=0.05)
    unscaled = NormFormerLM(
        dataclasses.replace(config, scale_embedding=False, embedding_init_std=0.02), seed=3
    )
    assert unscaled.embedding.token.weight[: config.vocab_size].std().item() == pytest.approx(0.02, rel=0.05)
    torch.testing.assert_close(
        unscaled.embedding(tokens),
        unscaled.embedding.token.weight[tokens] + sinusoidal_positions(config.seq_len, d)[: tokens.shape[1]],
    )
