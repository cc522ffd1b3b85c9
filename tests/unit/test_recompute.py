"""train.recompute: selective recomputation of the attention core gives the losses and gradients of
no recomputation (dropout masks replayed), stores no [B, heads, T, T] tensor, and the config key
is validated (train.activation_checkpointing=true still means full)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megaformer.config import ConfigError, load_config
from megaformer.model import NormFormerLM, set_selective_recompute
from megaformer.parallel.rng import DropoutRNG
from tests.tiny_model import TINY_MODEL

torch.set_num_threads(1)

# the recomputation must replay the dropout masks
CONFIG = dataclasses.replace(TINY_MODEL, hidden_dropout=0.1, attention_dropout=0.2)


def _step(selective: bool) -> tuple[list[float], list[torch.Tensor], int]:
    model = NormFormerLM(CONFIG, seed=3, dropout_rng=DropoutRNG(5)).train()
    assert set_selective_recompute(model, selective) == CONFIG.num_layers
    g = torch.Generator().manual_seed(0)
    losses, biggest = [], 0
    for _ in range(2):  # two micro-batches: the dropout streams advance between them
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
        labels = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, out=saved: out.append(t.shape) or t, lambda t: t
        ):
            loss = model(tokens, labels)
        biggest = max(biggest, sum(1 for s in saved if len(s) == 4 and s[-2:] == (16, 16)))
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, [p.grad.clone() for p in model.parameters()], biggest


def test_selective_recompute_equals_no_recompute_and_stores_no_attention_matrix():
    losses_none, grads_none, tt_none = _step(False)
    losses_sel, grads_sel, tt_sel = _step(True)
    assert losses_sel == losses_none
    for a, b in zip(grads_sel, grads_none):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert tt_none > 0 and tt_sel == 0  # the [B, nh, T, T] probabilities / mask are not kept


def test_recompute_key_is_validated_and_activation_checkpointing_means_full():
    base = "configs/normformer-quickstart.yaml"
    assert load_config(base).train.recompute_mode == "none"
    assert load_config(base, ["train.recompute=selective"]).train.recompute_mode == "selective"
    assert load_config(base, ["train.activation_checkpointing=true"]).train.recompute_mode == "full"
    with pytest.raises(ConfigError, match="none, selective"):
        load_config(base, ["train.recompute=some"])
    with pytest.raises(ConfigError, match="activation_checkpointing=false"):
        load_config(base, ["train.activation_checkpointing=true", "train.recompute=selective"])
