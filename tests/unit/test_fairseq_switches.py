"""The fairseq-parity switches of the model: ``model.head_scale_position`` and ``model.position_offset``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaformer.config.load import check_model_config
from megaformer.config.schema import HEAD_SCALE_POSITIONS, ConfigError, ModelConfig
from megaformer.model import NormFormerLM
from megaformer.model.normformer import NormFormerBlock, NormFormerEmbedding, sinusoidal_positions
from megaformer.perf.plan import layer_param_counts
from megaformer.training.diagnostics import sharded_scales

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, num_layers=2, num_attention_heads=4, seq_len=16, resid_scale=True
)
FAIRSEQ = dataclasses.replace(CFG, head_scale_position="after_out_proj", position_offset=2, init="fairseq")


def test_defaults_are_the_papers_and_unchanged():
    assert ModelConfig().head_scale_position == "before_out_proj" == HEAD_SCALE_POSITIONS[0]
    assert ModelConfig().position_offset == 0
    # The default model's parameters and logits do not depend on the new keys' existence: the same
    # seed gives the same model as one built with the defaults spelled out.
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    a = NormFormerLM(CFG, seed=3).eval()
    b = NormFormerLM(
        dataclasses.replace(CFG, head_scale_position="before_out_proj", position_offset=0), seed=3
    ).eval()
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))
    emb = NormFormerEmbedding(CFG)
    assert torch.equal(emb.position, sinusoidal_positions(CFG.seq_len, CFG.hidden_size))


def test_head_scale_after_out_proj_scales_out_projs_output_in_head_chunks():
    """fairseq's c_attn: W_O's output, bias included, viewed as [heads, head_dim], chunk i times γ_i;
    checked against the same block without HeadScale (same seeds, so the same weights) times γ."""
    block = NormFormerBlock(FAIRSEQ, layer_index=0, seed=5).eval()
    plain = NormFormerBlock(dataclasses.replace(FAIRSEQ, head_scale=False), layer_index=0, seed=5).eval()
    assert block.head_scale.shape == (4,) and not getattr(block.head_scale, "tensor_model_parallel", False)
    gamma = torch.tensor([0.5, 1.7, -0.3, 2.0])
    with torch.no_grad():
        block.head_scale.copy_(gamma)
        plain.out_proj.bias.normal_()  # a non-zero bias, which fairseq scales too
        block.out_proj.bias.copy_(plain.out_proj.bias)
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
        want = plain.attention(x) * gamma.repeat_interleave(8)  # channels [8i, 8i + 8) times γ_i
        assert torch.allclose(block.attention(x), want, atol=1e-6, rtol=0)
        # ... which is not the paper's placement (before W_O) with the same γ.
        paper = NormFormerBlock(dataclasses.replace(CFG, init="fairseq"), layer_index=0, seed=5).eval()
        paper.load_state_dict(block.state_dict())
        assert (paper.attention(x) - want).abs().max() > 1e-2


def test_position_offset_reads_the_sinusoid_from_row_offset():
    emb = NormFormerEmbedding(FAIRSEQ)
    table = sinusoidal_positions(FAIRSEQ.seq_len + 2, FAIRSEQ.hidden_size)
    assert emb.position.shape == (16, 32) and torch.equal(emb.position, table[2:])
    tokens = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = emb.token(tokens) * 32**0.5 + table[2:18]
        assert torch.equal(emb(tokens), want)


def test_replicated_head_scale_in_plan_and_diagnostics():
    assert sharded_scales(CFG) == ("ffn_ln", "head_scale")
    assert sharded_scales(FAIRSEQ) == ("ffn_ln",)
    # One rank's block: the paper's γ is split across TP ranks, fairseq's whole on each.
    before, after = layer_param_counts(CFG, 2)[1], layer_param_counts(FAIRSEQ, 2)[1]
    assert after - before == 4 - 4 // 2
    model = NormFormerLM(FAIRSEQ)
    assert sum(p.numel() for p in model.parameters()) == sum(layer_param_counts(FAIRSEQ, 1)[:-1])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"head_scale_position": "after"}, ["model.head_scale_position='after'", "'after_out_proj'"]),
        ({"position_offset": -1}, ["model.position_offset=-1", ">= 0"]),
        (
            {"position_offset": 2, "position_embedding": "learned"},
            ["model.position_offset=2", "position_embedding='learned'", "sinusoidal"],
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(change, words):
    with pytest.raises(ConfigError) as e:
        check_model_config(dataclasses.replace(CFG, **change))
    for w in words:
        assert w in str(e.value)
