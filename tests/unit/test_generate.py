"""Sampling from the model: padding never sampled, temperature 0 is greedy, top-k, seeds, EOD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM
from megaformer.tools.generate import generate, next_token_probs

# 300 real tokens padded to 384 embedding rows.
CONFIG = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_attention_heads=2, seq_len=16)


@pytest.fixture
def model():
    m = NormFormerLM(CONFIG, seed=3).eval()
    emb = m.embedding.token.weight  # tied: the output projection reads these rows too
    assert emb.shape[0] == CONFIG.padded_vocab_size() == 384
    with torch.no_grad():
        # Padding rows made to dominate every logit: unmasked, they would take nearly all the mass.
        emb[CONFIG.vocab_size :] = 50 * emb[: 384 - CONFIG.vocab_size].sign()
    return m


def test_padding_gets_no_mass_and_rows_sum_to_one(model):
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 20))  # longer than seq_len: the tail is read
    hidden = []
    model.final_norm.register_forward_hook(lambda mod, inp, out: hidden.append(out))
    with torch.no_grad():
        logits = model(tokens[:, -CONFIG.seq_len :])[:, -1, :]
    raw = F.linear(hidden[0][:, -1, :], model.embedding.token.weight)  # before the model's mask
    assert raw.argmax(-1).min() >= CONFIG.vocab_size  # the padding would win without the mask
    assert torch.all(logits[:, CONFIG.vocab_size :] == float("-inf"))  # the model's contract
    torch.testing.assert_close(logits[:, : CONFIG.vocab_size], raw[:, : CONFIG.vocab_size])
    for temperature, top_k in ((1.0, 0), (0.7, 40), (0.0, 0)):
        probs = next_token_probs(model, CONFIG, tokens, temperature, top_k)
        assert probs.shape == (3, 384)
        assert torch.all(probs[:, CONFIG.vocab_size :] == 0)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    greedy = next_token_probs(model, CONFIG, tokens, 0.0, 0)
    assert torch.equal(greedy.argmax(-1), raw[:, : CONFIG.vocab_size].argmax(-1))
    top5 = next_token_probs(model, CONFIG, tokens, 1.0, 5)
    assert torch.all((top5 > 0).sum(-1) == 5)


def test_generate_is_seeded_stops_at_eod_and_checks_its_input(model):
    a = generate(model, CONFIG, [1, 2, 3], max_new_tokens=12, temperature=1.0, top_k=0, num_samples=2, seed=5)
    b = generate(model, CONFIG, [1, 2, 3], max_new_tokens=12, temperature=1.0, top_k=0, num_samples=2, seed=5)
    c = generate(model, CONFIG, [1, 2, 3], max_new_tokens=12, temperature=1.0, top_k=0, num_samples=2, seed=6)
    assert a == b and a != c
    assert all(len(row) == 12 and max(row) < CONFIG.vocab_size for row in a)
    eod = a[0][4]  # pretend the 5th sampled token is the EOD: that sample ends there
    cut = generate(
        model, CONFIG, [1, 2, 3], max_new_tokens=12, temperature=1.0, top_k=0, num_samples=2, seed=5, eod=eod
    )
    assert cut[0] == a[0][: a[0].index(eod) + 1]
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, CONFIG, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, CONFIG, [1], max_new_tokens=3, temperature=-1.0)
