"""model.objective=mlm: bidirectional attention, RoBERTa's LM head, the masked-positions loss, the config
rules and the causal-only tools' refusal; the causal LM (model.objective=clm, the default) unchanged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megaformer.config.load import check_model_config, check_parallel, require_causal_lm
from megaformer.config.schema import OBJECTIVES, ConfigError, ModelConfig, ParallelConfig, RunConfig
from megaformer.data.loader import collate_for, collate_samples
from megaformer.data.mlm import (
    BOS_ID,
    IGNORE_INDEX,
    MLM_VOCAB_SIZE,
    collate_mlm,
    mask_block,
    max_masked_positions,
)
from megaformer.model import MaskedLMHead, MaskedLMLoss, NormFormerLM, masked_lm_logits, vocab_param_names
from megaformer.model.normformer import LMLoss
from megaformer.training.flops import model_flops_per_token
from tests.tiny_model import TINY_MODEL

# The tiny model as a masked LM: the vocabulary must hold <mask>/<s>/<pad> (50265 rows).
TINY_MLM = dataclasses.replace(
    TINY_MODEL, objective="mlm", vocab_size=MLM_VOCAB_SIZE, position_embedding="learned"
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(config: ModelConfig, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50257, (2, config.seq_len), generator=_gen(seed))


def _masked_labels(tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, positions] = tokens[:, positions]
    return labels


def test_objectives_are_clm_and_mlm_with_clm_the_default():
    assert OBJECTIVES == ("clm", "mlm")
    assert ModelConfig().objective == "clm"


@pytest.mark.parametrize("objective, sees_later_tokens", [("clm", False), ("mlm", True)])
def test_position_0_depends_on_a_later_token_only_under_mlm(objective, sees_later_tokens):
    config = TINY_MLM if objective == "mlm" else TINY_MODEL
    model = NormFormerLM(config, seed=1).eval()
    tokens = torch.randint(0, 97, (2, config.seq_len), generator=_gen(2))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    v = config.vocab_size
    differs = not torch.allclose(a[:, 0, :v], b[:, 0, :v], rtol=0, atol=0)
    assert differs == sees_later_tokens
    # Under both, the changed position itself sees the change.
    assert not torch.equal(a[:, 9, :v], b[:, 9, :v])


def test_block_is_bidirectional_only_under_mlm():
    model = NormFormerLM(TINY_MLM, seed=1)
    assert all(not block.is_causal for block in model.blocks)
    assert all(block.is_causal for block in NormFormerLM(TINY_MODEL, seed=1).blocks)


def test_lm_head_shapes_tying_and_formula():
    model = NormFormerLM(TINY_MLM, seed=4)
    emb = model.embedding
    head = emb.lm_head
    assert isinstance(head, MaskedLMHead)
    d, v_pad = TINY_MLM.hidden_size, TINY_MLM.padded_vocab_size(1)
    assert head.dense.weight.shape == (d, d) and head.dense.bias.shape == (d,)
    assert head.layer_norm.weight.shape == (d,)
    assert head.bias.shape == (v_pad,) and torch.all(head.bias == 0)
    # Not a separate decoder: the only vocabulary-sized matrix is the token embedding.
    names = dict(model.named_parameters())
    assert [n for n, p in names.items() if p.ndim == 2 and p.shape[0] == v_pad] == [
        "tied_modules.embed.token.weight"
    ]
    assert model.output is None
    with torch.no_grad():
        head.bias.copy_(torch.randn(v_pad, generator=_gen(5)))
    h = torch.randn(2, 5, d, generator=_gen(6))
    expected = (
        F.layer_norm(F.gelu(h @ head.dense.weight.T + head.dense.bias), (d,), head.layer_norm.weight,
                     head.layer_norm.bias, TINY_MLM.layernorm_eps)
        @ emb.token.weight.T
        + head.bias
    )  # fmt: skip
    torch.testing.assert_close(masked_lm_logits(emb, h), expected, rtol=1e-5, atol=1e-5)
    # Tied: the decoder's gradient lands in the token embedding.
    masked_lm_logits(emb, h).sum().backward()
    assert emb.token.weight.grad is not None and emb.token.weight.grad.abs().sum() > 0


def test_lm_head_parameters_are_named_tagged_and_vocab_padded():
    model = NormFormerLM(TINY_MLM, seed=4)
    p = dict(model.named_parameters())
    for name in ("dense.weight", "dense.bias", "layer_norm.weight", "layer_norm.bias", "bias"):
        assert f"tied_modules.embed.lm_head.{name}" in p
    assert p["tied_modules.embed.lm_head.bias"].tensor_model_parallel
    assert p["tied_modules.embed.lm_head.bias"].partition_dim == 0
    assert not p["tied_modules.embed.lm_head.dense.weight"].tensor_model_parallel
    assert "tied_modules.embed.lm_head.bias" in vocab_param_names(TINY_MLM)
    assert "tied_modules.embed.lm_head.bias" not in vocab_param_names(TINY_MODEL)


def test_loss_is_the_mean_cross_entropy_of_the_masked_positions_only():
    model = NormFormerLM(TINY_MLM, seed=7)
    assert isinstance(model.loss_fn, MaskedLMLoss)
    tokens = _tokens(TINY_MLM, 8)
    labels = _masked_labels(tokens, [1, 4, 11])
    loss = model(tokens, labels)
    v = TINY_MLM.vocab_size
    logits = model(tokens)[..., :v]
    expected = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_unmasked_positions_do_not_enter_the_loss():
    loss_fn = MaskedLMLoss(TINY_MLM, None)
    v_pad = TINY_MLM.padded_vocab_size(1)
    logits = torch.randn(2, 6, v_pad, generator=_gen(9))
    labels = torch.full((2, 6), IGNORE_INDEX)
    labels[0, 2], labels[1, 5] = 17, 50258
    base = loss_fn(logits.clone(), labels)
    # Other logits at unmasked positions: the same loss, and they get no gradient.
    other = logits.clone()
    other[0, 0] += 100.0
    other[1, 3] = torch.randn(v_pad, generator=_gen(10))
    assert torch.equal(loss_fn(other.clone(), labels), base)
    x = logits.clone().requires_grad_(True)
    loss_fn(x.clone(), labels).backward()
    chosen = labels != IGNORE_INDEX
    assert torch.all(x.grad[~chosen] == 0) and torch.all(x.grad[chosen].abs().sum(-1) > 0)
    # A masked position's label does change it.
    labels[0, 2] = 18
    assert not torch.equal(loss_fn(logits.clone(), labels), base)


def test_a_micro_batch_without_masked_positions_has_loss_zero_and_zero_gradients():
    model = NormFormerLM(TINY_MLM, seed=7)
    tokens = _tokens(TINY_MLM, 3)
    loss = model(tokens, torch.full_like(tokens, IGNORE_INDEX))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.parameters())


def test_causal_lm_loss_and_plan_unchanged():
    model = NormFormerLM(TINY_MODEL, seed=7)
    assert type(model.loss_fn) is LMLoss
    assert model.embedding.lm_head is None
    assert "lm_head" not in "".join(n for n, _ in model.named_parameters())


def test_config_rules_for_mlm():
    check_model_config(TINY_MLM)
    with pytest.raises(ConfigError, match=r"model.objective='xlm'.*'clm' or 'mlm'"):
        check_model_config(dataclasses.replace(TINY_MODEL, objective="xlm"))
    with pytest.raises(ConfigError, match=r"model.vocab_size=97 .*set model.vocab_size=50265"):
        check_model_config(dataclasses.replace(TINY_MLM, vocab_size=97))
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=false .*model.objective='mlm'"):
        check_model_config(dataclasses.replace(TINY_MLM, tie_embeddings=False))
    check_parallel(RunConfig(model=TINY_MLM, parallel=ParallelConfig(pp_size=2)))  # pipelines train it
    check_parallel(RunConfig(model=TINY_MLM, parallel=ParallelConfig(tp_size=2)))


def test_causal_only_tools_refuse_a_masked_lm_checkpoint():
    require_causal_lm(TINY_MODEL, "ckpt", "generation")
    with pytest.raises(ConfigError, match=r"ckpt: the checkpoint's model.objective='mlm'.*generation needs"):
        require_causal_lm(TINY_MLM, "ckpt", "generation")


def test_loader_collate_follows_the_objective():
    assert collate_for("clm") is collate_samples and collate_for("mlm") is collate_mlm
    with pytest.raises(ValueError, match="objective"):
        collate_for("xlm")
    rows = [(np.arange(4), np.array([IGNORE_INDEX, 1, IGNORE_INDEX, 3]))] * 2
    x, y = collate_for("mlm")(rows)
    assert x.shape == y.shape == (2, 4) and y[0, 1] == 1


def test_mlm_is_bidirectional_under_selective_recompute_with_attention_dropout():
    from megaformer.model import set_selective_recompute

    config = dataclasses.replace(TINY_MLM, attention_dropout=0.1)
    tokens = _tokens(config, 11)
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 50257
    outs = []
    for x in (tokens, changed):
        model = NormFormerLM(config, seed=12).train()  # same seed: the same weights and dropout masks
        set_selective_recompute(model)
        logits = model(x)
        logits[:, 0].sum().backward()
        outs.append(logits[:, 0, : config.vocab_size].detach())
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.slow  # compiles a block with inductor (tens of seconds on 2 cores)
@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_mlm_blocks_equal_the_eager_model(recompute):
    """The compiled-block path (train.compile) keeps attention bidirectional: losses and gradients of
    compiled blocks (with attention dropout, optionally selective recomputation) are the eager
    model's within fp32 rounding, and the dropout generators end in the same states."""
    from megaformer.model import compile_blocks
    from megaformer.parallel.rng import DropoutRNG

    config = dataclasses.replace(TINY_MLM, hidden_dropout=0.1, attention_dropout=0.1)
    tokens = _tokens(config, 21)
    labels = _masked_labels(tokens, [0, 3, 7, 12])

    def run(compiled: bool):
        rng = DropoutRNG(5)
        model = NormFormerLM(config, seed=3, dropout_rng=rng).train()
        for block in model.blocks:
            block.recompute_core_attention = recompute
        if compiled:
            assert compile_blocks(model, log=pytest.fail) == config.num_layers
        loss = model(tokens, labels)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()], rng.state_dict()

    eager, eager_states = run(False)
    got, got_states = run(True)
    for region in eager_states:
        assert torch.equal(got_states[region], eager_states[region])
    for a, b in zip(got, eager, strict=True):
        scale = float(b.abs().max().clamp_min(1e-30))
        assert float((a - b).abs().max()) <= 1e-5 * scale


def test_the_masked_lm_sample_index_is_built_for_seq_len_minus_1():
    from megaformer.training.data_checks import index_seq_len

    assert index_seq_len(RunConfig(model=TINY_MODEL)) == TINY_MODEL.seq_len
    assert index_seq_len(RunConfig(model=TINY_MLM)) == TINY_MLM.seq_len - 1


@pytest.mark.parametrize("config", [TINY_MLM, TINY_MODEL], ids=["mlm", "clm"])
def test_padded_keys_give_each_row_its_own_hidden_states(config):
    """padded_keys: a right-padded batch's real positions equal each row run alone (bidirectional
    and causal), and the mask is off again afterwards."""
    from megaformer.model.normformer import padded_keys

    model = NormFormerLM(config, seed=2).eval()
    rows = [_tokens(config, 9)[0, :9] % config.vocab_size, _tokens(config, 5)[0, :5] % config.vocab_size]
    batch = torch.zeros(2, 9, dtype=torch.long)
    keep = torch.zeros(2, 9, dtype=torch.bool)
    for i, r in enumerate(rows):
        batch[i, : len(r)], keep[i, : len(r)] = r, True

    def hidden(tokens):
        x = model.embedding(tokens)
        for block in model.blocks:
            x = block(x)
        return x

    with torch.no_grad():
        with padded_keys(model.blocks, keep):
            padded = hidden(batch)
        alone = [hidden(r[None])[0] for r in rows]
        unmasked = hidden(batch)
    for i, r in enumerate(rows):
        torch.testing.assert_close(padded[i, : len(r)], alone[i], atol=1e-5, rtol=1e-5)
    assert all(b.key_padding_mask is None for b in model.blocks)
    if config.objective == "mlm":  # bidirectional: without the mask row 1 sees its padding
        assert not torch.allclose(unmasked[1, 0], alone[1][0], atol=1e-4)
    with pytest.raises(ValueError, match="keep must be bool"), padded_keys(model.blocks, keep.long()):
        pass


def _mask_block_labels(config: ModelConfig, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) ``[rows, seq_len]`` drawn by the data's own rule (mask_block)."""
    tokens = np.random.default_rng(seed).integers(0, 50257, (rows, config.seq_len))
    tokens[:, 0] = BOS_ID
    pairs = [mask_block(t, seed=seed, epoch=0, index=i) for i, t in enumerate(tokens)]
    return tuple(torch.from_numpy(np.stack(x)) for x in zip(*pairs, strict=True))


def test_max_masked_positions_bounds_mask_block_tightly():
    # The head's fixed K per row is never exceeded by the data's rule, and it is reached (tight).
    for t in (16, 64, 128):
        k = max_masked_positions(t)
        assert k == min(t, int(0.15 * t) + 1)
        counts = [
            int((mask_block(np.full(t, 7), seed=3, epoch=0, index=i)[1] != IGNORE_INDEX).sum())
            for i in range(400)
        ]
        assert max(counts) == k, (t, k, max(counts))
    assert max_masked_positions(2) == 1 and max_masked_positions(1, 0.99) == 1
    with pytest.raises(ValueError, match="block_len=0"):
        max_masked_positions(0)


def test_masked_head_positions_give_the_same_loss_gradients_and_logits():
    # model.mlm_head_positions masked (fairseq's masked_tokens) against all (the default): the same
    # parameters, the same loss and gradients up to rounding, the same logits without labels.
    masked_cfg = dataclasses.replace(TINY_MLM, mlm_head_positions="masked")
    check_model_config(masked_cfg)
    every, masked = NormFormerLM(TINY_MLM, seed=11), NormFormerLM(masked_cfg, seed=11)
    tokens, labels = _mask_block_labels(TINY_MLM, 3, seed=12)
    with torch.no_grad():  # a non-zero vocabulary bias, set alike, so its gradient is checked too
        for m in (every, masked):
            m.embedding.lm_head.bias.copy_(torch.randn(m.embedding.lm_head.bias.shape, generator=_gen(13)))
    with torch.no_grad():
        assert torch.equal(every(tokens), masked(tokens))
    loss_all, loss_masked = every(tokens, labels), masked(tokens, labels)
    torch.testing.assert_close(loss_masked, loss_all, rtol=1e-6, atol=0)
    loss_all.backward()
    loss_masked.backward()
    for (name, p), q in zip(every.named_parameters(), masked.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        scale = float(p.grad.abs().max().clamp_min(1e-30))
        assert float((p.grad - q.grad).abs().max()) <= 1e-5 * scale, name


def test_masked_head_positions_refuse_labels_beyond_the_fixed_count():
    model = NormFormerLM(dataclasses.replace(TINY_MLM, mlm_head_positions="masked"), seed=1)
    tokens = _tokens(TINY_MLM, 2)
    k = max_masked_positions(TINY_MLM.seq_len)
    model(tokens, _masked_labels(tokens, list(range(k))))  # at the bound: fine
    with pytest.raises(ValueError, match=rf"{k + 1} masked positions, more than the {k}.*'all'"):
        model(tokens, _masked_labels(tokens, list(range(k + 1))))


def test_mlm_head_positions_config_rules_and_flops():
    with pytest.raises(ConfigError, match=r"model.mlm_head_positions='some': use 'all' or 'masked'"):
        check_model_config(dataclasses.replace(TINY_MLM, mlm_head_positions="some"))
    with pytest.raises(ConfigError, match=r"mlm_head_positions='masked' with model.objective='clm'"):
        check_model_config(dataclasses.replace(TINY_MODEL, mlm_head_positions="masked"))
    # The decoder's FLOPs are counted at the positions decoded: K / T of them under masked.
    d, v, t = TINY_MLM.hidden_size, TINY_MLM.padded_vocab_size(1), TINY_MLM.seq_len
    masked_cfg = dataclasses.replace(TINY_MLM, mlm_head_positions="masked")
    saved = model_flops_per_token(TINY_MLM) - model_flops_per_token(masked_cfg)
    assert saved == pytest.approx(3 * 2 * d * v * (1 - max_masked_positions(t) / t), rel=1e-12)
