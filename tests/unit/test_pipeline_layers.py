"""The layer list of the pipeline computes exactly NormFormerLM (same seed, tied and untied)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM
from megaformer.parallel.rng import DropoutRNG
from megaformer.pipeline import LMLoss, SequentialLM, checkpointed, layer_specs, vocab_param_names

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


def test_tied_specs_share_one_embedding_and_names_follow_the_pipeline_module():
    model = SequentialLM(layer_specs(TINY, seed=1), LMLoss(TINY, None))
    assert len(model.tied_modules) == 1
    # embedding (tied) + 3 blocks + final norm; the tied output reuses the embedding's weight
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"tied_modules", "1", "2", "3", "4"}
    assert vocab_param_names(TINY) == ("tied_modules.embed.token.weight",)
    untied = dataclasses.replace(TINY, tie_embeddings=False)
    model = SequentialLM(layer_specs(untied, seed=1), LMLoss(untied, None))
    assert set(vocab_param_names(untied)) <= {n for n, _ in model.named_parameters()}


def test_activation_checkpointing_gives_the_same_loss_and_gradients_with_dropout():
    """Recomputed blocks replay the DropoutRNG states, so the masks (and gradients) are the same."""
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    results = []
    for ac in (False, True):
        rng = DropoutRNG(5)
        model = SequentialLM(
            layer_specs(config, seed=3, dropout_rng=rng),
            LMLoss(config, None),
            checkpoint_fn=checkpointed(rng) if ac else None,
        )
        loss = model(tokens, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
