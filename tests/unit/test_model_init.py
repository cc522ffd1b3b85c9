"""``model.init`` (legacy | gpt2 | fairseq), ``train.weight_decay_params`` and ``model.embedding_dropout``
on one process: each tensor's init statistics against the analytic value of the initialiser the
reference uses, the loss at init at the 125M shape, the optimizer groups, embedding dropout. TP = 2
(the same full tensors at every TP degree, the same embedding masks on every TP rank) is checked in
tests/distributed/test_tp_layers.py ("inits", "dropout_rng").

References (read from their sources, not run here; lines at fairseq commit 3d262bb and nanoGPT
commit 3adf61e):

- fairseq (transformer_lm, the NormFormer paper's code base): ``Embedding`` in
  fairseq/models/transformer/transformer_base.py:189-193 (``normal_(std=d**-0.5)``, padding row 0);
  ``MultiheadAttention.reset_parameters`` in fairseq/modules/multihead_attention.py:168-182 (q, k,
  v ``xavier_uniform_(gain=1/sqrt(2))``, out_proj ``xavier_uniform_`` and bias 0; the q, k, v biases
  keep ``nn.Linear``'s default); ``build_fc1`` / ``build_fc2`` in
  fairseq/modules/transformer_layer.py:344-348 (plain ``nn.Linear``: ``kaiming_uniform_(a=sqrt(5))``,
  i.e. ``U(±1/sqrt(fan_in))``, bias the same); LearnedPositionalEmbedding
  (fairseq/modules/positional_embedding.py:27) and an untied output
  (transformer_decoder.py:164, build_output_projection) ``normal_(std=d**-0.5)``.
- GPT-2: nanoGPT model.py:162-168 ``GPT._init_weights`` (``normal_(std=0.02)`` for Linear and
  Embedding, biases 0) and the ``c_proj.weight`` loop in ``GPT.__init__`` (:143-145,
  ``std=0.02/sqrt(2·n_layer)``); HF modeling_gpt2.py ``GPT2PreTrainedModel._init_weights`` does the
  same.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaformer.config import load_config
from megaformer.config.schema import ConfigError, ModelConfig, RunConfig, TrainConfig
from megaformer.model import (
    NormFormerBlock,
    NormFormerEmbedding,
    NormFormerLM,
    OutputProjection,
    param_groups,
)
from megaformer.model.normformer import deepnorm_beta
from megaformer.parallel.rng import DropoutRNG
from tests.tiny_model import TINY_MODEL

# The paper's 125M shape (configs/paper/125m-*.yaml), with a short context: the statistics and the
# loss at init do not depend on the table length.
SHAPE_125M = ModelConfig(
    vocab_size=50257,
    make_vocab_size_divisible_by=1280,
    hidden_size=768,
    num_layers=12,
    num_attention_heads=12,
    ffn_hidden_size=3072,
    seq_len=128,
)
PRE_LN = dict(post_attn_ln=False, head_scale=False, ffn_ln=False, resid_scale=False)
ALL_ON = dict(post_attn_ln=True, head_scale=True, ffn_ln=True, resid_scale=True)
LN_V = math.log(SHAPE_125M.vocab_size)  # 10.825


def _125m(init: str, **kw) -> ModelConfig:
    return dataclasses.replace(SHAPE_125M, init=init, scale_embedding=init != "gpt2", **kw)


# --- the analytic values of the reference initialisers ------------------------------------------------


def xavier_uniform_bound(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    """``torch.nn.init.xavier_uniform_``: ``U(±gain·sqrt(6 / (fan_in + fan_out)))``."""
    return gain * math.sqrt(6.0 / (fan_in + fan_out))


def linear_default_bound(fan_in: int) -> float:
    """``nn.Linear.reset_parameters``: weight ``kaiming_uniform_(a=sqrt(5))`` =
    ``U(±calculate_gain('leaky_relu', sqrt(5))·sqrt(3 / fan_in))`` = ``U(±1/sqrt(fan_in))``; bias
    ``U(±1/sqrt(fan_in))``."""
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    bound = gain * math.sqrt(3.0 / fan_in)
    assert bound == pytest.approx(1 / math.sqrt(fan_in), rel=1e-12)
    return bound


def assert_uniform(t: torch.Tensor, bound: float, name: str, rel: float = 0.02) -> None:
    """``t`` looks like ``U(±bound)``: std ``bound/sqrt(3)`` within ``rel``, every |w| <= bound and the
    largest within 1 % of it, mean about 0."""
    t = t.detach().double()
    assert t.std().item() == pytest.approx(bound / math.sqrt(3), rel=rel), name
    assert t.abs().max().item() <= bound * (1 + 1e-6), name
    assert t.abs().max().item() >= bound * 0.99, name
    assert abs(t.mean().item()) < 5 * bound / math.sqrt(3 * t.numel()), name


def assert_normal(t: torch.Tensor, std: float, name: str, rel: float = 0.02) -> None:
    t = t.detach().double()
    assert t.std().item() == pytest.approx(std, rel=rel), name
    assert abs(t.mean().item()) < 5 * std / math.sqrt(t.numel()), name
    # normal, not uniform: the tails pass sqrt(3)·std (a uniform of this std stops there)
    assert t.abs().max().item() > 3 * std, name


def _qkv_blocks(block: NormFormerBlock) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The fused weight's rows are [heads, 3, head_dim]: q, k, v as (d × d weight, d bias) each."""
    nh, hs, d = block.num_heads_per_partition, block.head_dim, block.config.hidden_size
    w = block.qkv.weight.detach().view(nh, 3, hs, d)
    b = block.qkv.bias.detach().view(nh, 3, hs)
    return {name: (w[:, i].reshape(nh * hs, d), b[:, i].reshape(-1)) for i, name in enumerate("qkv")}


# --- (a) per-tensor statistics at d 768 -----------------------------------------------------------


def test_fairseq_init_statistics_are_fairseq_s_initialisers():
    """One block (NormFormer, every switch on), the embedding with learned positions, an untied output
    projection, at the 125M shape: each tensor against fairseq's initialiser. Biases have d (768)
    or 4d values: their std is checked within 5 % (a 2 % check would be two standard errors), their
    bound exactly."""
    config = _125m("fairseq", **ALL_ON, position_embedding="learned", tie_embeddings=False)
    d, ffn = config.hidden_size, config.ffn_size
    block = NormFormerBlock(config, layer_index=3, seed=1)
    for name, (w, b) in _qkv_blocks(block).items():
        assert_uniform(w, xavier_uniform_bound(d, d, gain=1 / math.sqrt(2)), f"{name}_proj.weight")
        assert_uniform(b, linear_default_bound(d), f"{name}_proj.bias", rel=0.05)
    assert_uniform(block.out_proj.weight, xavier_uniform_bound(d, d), "out_proj.weight")
    assert torch.all(block.out_proj.bias == 0)
    assert_uniform(block.fc1.weight, linear_default_bound(d), "fc1.weight")
    assert_uniform(block.fc1.bias, linear_default_bound(d), "fc1.bias", rel=0.05)
    assert_uniform(block.fc2.weight, linear_default_bound(ffn), "fc2.weight")
    assert_uniform(block.fc2.bias, linear_default_bound(ffn), "fc2.bias", rel=0.05)
    _assert_normformer_parameters_at_their_init(block)

    embedding = NormFormerEmbedding(config, seed=1)
    table = embedding.token.weight.detach()
    assert_normal(table[: config.vocab_size], d**-0.5, "token")  # fairseq Embedding
    assert torch.all(table[config.vocab_size :] == 0)  # vocabulary padding (fairseq: its pad row)
    assert_normal(embedding.position, d**-0.5, "position")  # LearnedPositionalEmbedding
    assert embedding.scale == math.sqrt(d)
    output = OutputProjection(config, seed=1).proj.weight.detach()
    assert_normal(output[: config.vocab_size], d**-0.5, "output")  # build_output_projection


def test_gpt2_init_statistics_are_nanogpt_s():
    config = _125m("gpt2", **ALL_ON, position_embedding="learned", tie_embeddings=False)
    n = config.num_layers
    block = NormFormerBlock(config, layer_index=3, seed=1)
    for name, (w, b) in _qkv_blocks(block).items():
        assert_normal(w, 0.02, f"{name}_proj.weight")
        assert torch.all(b == 0)
    assert_normal(block.out_proj.weight, 0.02 / math.sqrt(2 * n), "out_proj.weight (c_proj)")
    assert_normal(block.fc1.weight, 0.02, "fc1.weight (c_fc)")
    assert_normal(block.fc2.weight, 0.02 / math.sqrt(2 * n), "fc2.weight (c_proj)")
    for lin in (block.out_proj, block.fc1, block.fc2):
        assert torch.all(lin.bias == 0)
    _assert_normformer_parameters_at_their_init(block)
    embedding = NormFormerEmbedding(config, seed=1)
    assert_normal(embedding.token.weight[: config.vocab_size], 0.02, "wte")
    assert_normal(embedding.position, 0.02, "wpe")
    assert embedding.scale == 1.0
    assert_normal(OutputProjection(config, seed=1).proj.weight[: config.vocab_size], 0.02, "lm_head")


def _assert_normformer_parameters_at_their_init(block: NormFormerBlock) -> None:
    """HeadScale γ = 1, ResScale λ = 1, every LayerNorm γ = 1, β = 0, under every init."""
    assert torch.all(block.head_scale == 1) and torch.all(block.resid_scale == 1)
    for ln in (block.ln1, block.ln2, block.post_attn_ln, block.ffn_ln):
        assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)


def test_deepnorm_scales_the_chosen_init_of_w_v_w_o_w1_w2_by_beta():
    """fairseq + deepnorm: W_V, W_O, W1, W2 (and the V, W1, W2 biases) are fairseq's inits times
    β = (8N)^(-1/4), as torchscale divides them by (8N)^(1/4); W_Q, W_K keep theirs."""
    config = _125m("fairseq", **PRE_LN, norm_scheme="deepnorm")
    d, ffn, beta = config.hidden_size, config.ffn_size, deepnorm_beta(config.num_layers)
    block = NormFormerBlock(config, layer_index=0, seed=2)
    qkv = _qkv_blocks(block)
    for name in "qk":
        assert_uniform(qkv[name][0], xavier_uniform_bound(d, d, 1 / math.sqrt(2)), name)
        assert_uniform(qkv[name][1], linear_default_bound(d), name, rel=0.05)
    assert_uniform(qkv["v"][0], beta * xavier_uniform_bound(d, d, 1 / math.sqrt(2)), "v")
    assert_uniform(qkv["v"][1], beta * linear_default_bound(d), "v bias", rel=0.05)
    assert_uniform(block.out_proj.weight, beta * xavier_uniform_bound(d, d), "out_proj")
    assert_uniform(block.fc1.weight, beta * linear_default_bound(d), "fc1")
    assert_uniform(block.fc2.weight, beta * linear_default_bound(ffn), "fc2")
    assert_uniform(block.fc2.bias, beta * linear_default_bound(ffn), "fc2 bias", rel=0.05)
    # gpt2 / legacy + deepnorm: beta times N(0, init_std) (unchanged by model.init)
    legacy = NormFormerBlock(dataclasses.replace(config, init="legacy"), layer_index=0, seed=2)
    gpt2 = NormFormerBlock(
        dataclasses.replace(config, init="gpt2", scale_embedding=False), layer_index=0, seed=2
    )
    for a, b in zip(legacy.state_dict().values(), gpt2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert_normal(legacy.fc2.weight, beta * 0.02, "legacy fc2")


def test_legacy_is_unchanged_and_gpt2_blocks_are_legacy_s():
    """``legacy`` draws what the project drew before ``model.init`` (N(0, init_std), bitwise the same
    generator calls); ``gpt2``'s blocks are the same tensors (GPT-2's matrices), only the token
    embedding differs (0.02, no sqrt(d))."""
    from megaformer.parallel.utils import derive_seed, normal_full

    config = dataclasses.replace(TINY_MODEL, num_layers=3)
    model = NormFormerLM(config, seed=7)
    seed_of = lambda name: derive_seed(7, f"layers.1.{name}")  # noqa: E731
    std, n = config.init_std, config.num_layers
    blk = model.blocks[1]
    assert torch.equal(blk.qkv.weight, normal_full((3 * 32, 32), std, seed_of("attention.qkv")))
    assert torch.equal(
        blk.out_proj.weight, normal_full((32, 32), std / math.sqrt(2 * n), seed_of("attention.out_proj"))
    )
    assert torch.equal(blk.fc1.weight, normal_full((128, 32), std, seed_of("ffn.fc1")))
    gpt2 = NormFormerLM(dataclasses.replace(config, init="gpt2", scale_embedding=False), seed=7)
    for (name, a), b in zip(model.named_parameters(), gpt2.parameters(), strict=True):
        assert torch.equal(a, b) == ("token" not in name), name
    assert gpt2.embedding.token.weight[: config.vocab_size].std().item() == pytest.approx(0.02, rel=0.1)


def test_a_block_built_alone_equals_the_block_inside_the_model_under_every_init():
    """Pipeline stages build blocks one by one: the uniform inits are drawn from the same seed names."""
    for init in ("gpt2", "fairseq"):
        config = dataclasses.replace(TINY_MODEL, init=init, scale_embedding=init == "fairseq")
        model = NormFormerLM(config, seed=7)
        alone = NormFormerBlock(config, layer_index=1, seed=7)
        for (name, a), b in zip(model.blocks[1].state_dict().items(), alone.state_dict().values()):
            assert torch.equal(a, b), (init, name)
        assert not torch.equal(model.blocks[0].fc2.weight, model.blocks[1].fc2.weight)
        if init == "fairseq":  # drawn biases, from per-layer seed names too
            assert not torch.equal(model.blocks[0].fc2.bias, model.blocks[1].fc2.bias)


# --- (b) the loss at init at the 125M shape --------------------------------------------------------


def _batch(vocab: int, b: int = 2, t: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


class _FairseqReferenceLayer(nn.Module):
    """A re-implementation (NOT fairseq's code) of fairseq's TransformerDecoderLayerBase with
    ``decoder_normalize_before`` (Pre-LN, no NormFormer operations): its modules, initialised with
    the torch initialisers fairseq calls, and its forward (causal self-attention, GELU FFN)."""

    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        for proj in (self.k_proj, self.v_proj, self.q_proj):  # MultiheadAttention.reset_parameters
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)  # build_fc1 / build_fc2: defaults

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d]
        b, t, d = x.shape
        h = self.self_attn_layer_norm(x)
        q, k, v = (
            p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out_proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def _fairseq_reference_loss(config: ModelConfig, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """The loss at init of a re-implementation of fairseq's transformer_lm (Pre-LN, tied, sinusoidal,
    scaled embedding, final LayerNorm), seeded from the default generator (left as it was). fairseq's
    sinusoidal table (SinusoidalPositionalEmbedding.get_embedding) starts at position padding_idx + 1
    = 2; GPT-2's vocabulary has no padding row, so the token table has none (one zero row of 50K
    changes nothing at init)."""
    d, v = config.hidden_size, config.vocab_size
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(12345)
        embed = nn.Embedding(v, d)
        nn.init.normal_(embed.weight, mean=0, std=d**-0.5)  # transformer_base.Embedding
        layers = [
            _FairseqReferenceLayer(d, config.num_attention_heads, config.ffn_size)
            for _ in range(config.num_layers)
        ]
        final = nn.LayerNorm(d)
        half = d // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        pos = torch.arange(2, 2 + tokens.shape[1], dtype=torch.float).unsqueeze(1) * freqs.unsqueeze(0)
        x = math.sqrt(d) * embed(tokens) + torch.cat([pos.sin(), pos.cos()], dim=1)
        for layer in layers:
            x = layer(x)
        logits = F.linear(final(x), embed.weight)
        return float(F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1)))


def _loss_at_init(config: ModelConfig, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    model = NormFormerLM(config, seed=1).eval()
    with torch.no_grad():
        return float(model(tokens, labels))


@pytest.mark.parametrize("init", ["gpt2", "fairseq", "legacy"])
def test_loss_at_init_at_the_125m_shape(init):
    """Pre-LN, sinusoidal positions, tied embeddings (the paper recipes' baseline), d 768, 12 layers,
    random tokens (2 × 128). Measured on this CPU (seed 1): legacy 23.04 (26.88 with learned
    positions), gpt2 10.91, fairseq 13.44, the fairseq re-implementation 13.42 (ln V = 10.82;
    nanoGPT logs ~10.9-11.0 at step 1).

    - gpt2: within 1 nat of ln V: small weights, tied small embedding, so near-uniform logits.
    - fairseq: within 1 nat of the re-implementation of fairseq's init and forward above (not
      fairseq's code). Its unit-scale embedding keeps part of the input token's own direction in
      the final state, so it sits above ln V; fairseq's own code gave 13.8 at d 768 with 2 layers.
    - legacy: ~23 nats. The finding behind model.init: fairseq's unit-scale embedding (times sqrt(d))
      with GPT-2's 0.02-scale sublayers leaves the residual stream almost only the input token's
      embedding, and the tied output predicts the input token with a logit of order sqrt(d).
    """
    tokens, labels = _batch(SHAPE_125M.vocab_size)
    loss = _loss_at_init(_125m(init, **PRE_LN), tokens, labels)
    if init == "gpt2":
        assert abs(loss - LN_V) < 1.0, loss
    elif init == "fairseq":
        reference = _fairseq_reference_loss(_125m("fairseq", **PRE_LN), tokens, labels)
        assert abs(loss - reference) < 1.0, (loss, reference)
        assert loss < LN_V + 4, loss
    else:
        assert 21.5 < loss < 24.5, loss


# --- config rules ----------------------------------------------------------------------------------


def test_config_refuses_gpt2_with_a_scaled_embedding_and_unknown_values():
    with pytest.raises(ConfigError, match="scale_embedding=false"):
        load_config(None, ["model.init=gpt2"])
    assert load_config(None, ["model.init=gpt2", "model.scale_embedding=false"]).model.init == "gpt2"
    with pytest.raises(ConfigError, match=r"model\.init='xavier'"):
        load_config(None, ["model.init=xavier"])
    with pytest.raises(ConfigError, match="weight_decay_params"):
        load_config(None, ["train.weight_decay_params=norms"])
    with pytest.raises(ConfigError, match="embedding_dropout"):
        load_config(None, ["model.embedding_dropout=1.0"])
    with pytest.raises(ConfigError, match="scale_embedding=false"):  # a bypassed loader
        NormFormerLM(dataclasses.replace(TINY_MODEL, init="gpt2"))


# --- (c) weight-decay groups -----------------------------------------------------------------------


def test_weight_decay_params_all_decays_every_parameter_and_matrices_only_the_matrices():
    from megaformer.training.builders import build_optimizer

    model = NormFormerLM(dataclasses.replace(TINY_MODEL, **ALL_ON, position_embedding="learned"))
    params = list(model.parameters())
    (group,) = param_groups(model, 0.1, "all")
    assert group["weight_decay"] == 0.1 and [id(p) for p in group["params"]] == [id(p) for p in params]
    decay, no_decay = param_groups(model, 0.1, "matrices")
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in params if p.ndim == 1}
    assert param_groups(model, 0.1) == [decay, no_decay]  # the default
    with pytest.raises(ValueError, match="weight_decay_params"):
        param_groups(model, 0.1, "norms")
    for which, groups in (("all", 1), ("matrices", 2)):
        cfg = RunConfig(train=TrainConfig(weight_decay_params=which, weight_decay=0.1))
        optimizer, _ = build_optimizer(model, cfg, start_step=0)
        assert len(optimizer.param_groups) == groups
        assert sum(len(g["params"]) for g in optimizer.param_groups if g["weight_decay"] == 0.1) == (
            len(params) if which == "all" else len(decay["params"])
        )


# --- (d) embedding dropout -------------------------------------------------------------------------


def test_embedding_dropout_is_on_in_training_off_in_eval_and_reproducible():
    config = dataclasses.replace(TINY_MODEL, embedding_dropout=0.5)
    tokens, _ = _batch(config.vocab_size, t=16)
    plain = NormFormerLM(dataclasses.replace(config, embedding_dropout=0.0), seed=3)
    clean = plain.embedding(tokens)
    model = NormFormerLM(config, seed=3, dropout_rng=DropoutRNG(5))
    before = torch.get_rng_state()
    dropped = model.embedding(tokens)  # train mode (the default)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    kept = dropped != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])  # inverted dropout: kept / (1 - p)
    again = NormFormerLM(config, seed=3, dropout_rng=DropoutRNG(5)).embedding(tokens)
    assert torch.equal(again, dropped)  # the masks come from the seed's 'replicated' stream
    assert not torch.equal(model.embedding(tokens), dropped)  # and advance
    model.eval()
    assert torch.equal(model.embedding(tokens), clean)


def test_embedding_dropout_zero_draws_nothing():
    """0 (the default) keeps every other dropout mask, hence earlier runs, bitwise: no fork, no draw."""
    config = dataclasses.replace(TINY_MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels = _batch(config.vocab_size, t=16)
    rng = DropoutRNG(5)
    model = NormFormerLM(config, seed=3, dropout_rng=rng)
    start = rng.state_dict()
    model.embedding(tokens)
    assert all(torch.equal(a, b) for a, b in zip(start.values(), rng.state_dict().values()))
    with_key = NormFormerLM(
        dataclasses.replace(config, embedding_dropout=0.0), seed=3, dropout_rng=DropoutRNG(5)
    )
    without = NormFormerLM(config, seed=3, dropout_rng=DropoutRNG(5))
    assert torch.equal(with_key(tokens, labels), without(tokens, labels))


def test_paper_recipes_use_fairseq_s_setup():
    cfg = load_config("configs/paper/125m-normformer.yaml")
    assert (cfg.model.init, cfg.model.embedding_dropout, cfg.train.weight_decay_params) == (
        "fairseq",
        0.1,
        "all",
    )
