"""The layer list of the pipeline computes exactly NormFormerLM (same seed, tied and untied)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM
from megaformer.pipeline import LMLoss, SequentialLM, layer_specs

TINY = ModelConfig(vocab_size=97, make_vocab_size_divisible_by=16, hidden_size=32, num_layers=3,
                   num_attention_heads=4, seq_len=16, resid_scale=True)  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_sequential_layer_list_equals_normformer_lm(tied):
    config = dataclasses.replace(TINY, tie_embeddings=tied)
    reference = NormFormerLM(config, seed=11)
    model = SequentialLM(layer_specs(config, seed=11), LMLoss(config, None))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    loss, ref = model(tokens, labels), reference(tokens, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    grads = sorted(p.grad.norm().item() for p in model.parameters())
    ref_grads = sorted(p.grad.norm().item() for p in reference.parameters())
    assert grads == pytest.approx(ref_grads, rel=1e-5, abs=1e-8)


def test_tied_specs_share_one_embedding():
    model = SequentialLM(layer_specs(TINY, seed=1), LMLoss(TINY, None))
    assert len(model.tied) == 1
    # embedding + 3 blocks + final norm run; the tied output reuses the embedding's weight
    assert len(model.layers) == TINY.num_layers + 1
