"""The masked LM's step loss (megaformer/training/ds_adapter.py): the summed cross-entropy of every
masked token of the step over their count (fairseq's sample_size), with gradients to match, and the
same for validation; driven through the adapter with a stand-in for the DeepSpeed engine (backward
divides by the accumulation steps, as DeepSpeed's does)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megaformer.data.mlm import IGNORE_INDEX, MLM_VOCAB_SIZE
from megaformer.model import NormFormerLM
from megaformer.training.ds_adapter import Engine
from tests.tiny_model import TINY_MODEL

TINY_MLM = dataclasses.replace(
    TINY_MODEL, objective="mlm", vocab_size=MLM_VOCAB_SIZE, position_embedding="learned"
)


class _StandIn:
    """The calls the adapter makes at pp = 1, fp32, no ZeRO: DeepSpeed's backward scales by 1 / gas."""

    def __init__(self, module: torch.nn.Module, gas: int) -> None:
        self.module, self.gas, self.micro = module, gas, 0

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def fp16_enabled(self) -> bool:
        return False

    bfloat16_enabled = zero_optimization = fp16_enabled

    def __call__(self, tokens, labels):
        return self.module(tokens, labels)

    def backward(self, loss) -> None:
        (loss / self.gas).backward()
        self.micro += 1

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro % self.gas == 0

    def step(self) -> None:
        pass

    def get_global_grad_norm(self):
        return None

    def eval(self) -> None:
        self.module.eval()

    def train(self) -> None:
        self.module.train()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for positions in ([3], [0, 5, 9, 14], list(range(1, 16, 2))):  # 1, 4 and 8 masked per row
        tokens = torch.randint(0, 50257, (2, 16), generator=g)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:, positions] = tokens[:, positions]
        out.append((tokens, labels))
    return out


def _reference(model: NormFormerLM, batches) -> torch.Tensor:
    """Σ NLL of every masked token over their count, from full-vocabulary logits."""
    v = TINY_MLM.vocab_size
    nll = sum(
        F.cross_entropy(model(t)[..., :v].reshape(-1, v), y.reshape(-1), reduction="sum") for t, y in batches
    )
    return nll / sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)


def _adapter(model: NormFormerLM, gas: int) -> Engine:
    state = SimpleNamespace(tp_size=1, dp_group=None, dp_size=1, tp_group=None, split_tp_group=None)
    return Engine(_StandIn(model, gas), state, pipelined=False)


def test_the_step_loss_and_gradient_are_over_the_steps_masked_tokens():
    batches = _batches()
    model, ref = NormFormerLM(TINY_MLM, seed=2), NormFormerLM(TINY_MLM, seed=2)
    engine = _adapter(model, gas=len(batches))
    assert engine.masked_lm
    loss = engine.train_step(iter(batches))
    want = _reference(ref, batches)
    want.backward()
    torch.testing.assert_close(loss.float(), want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        # atol relative to the tensor's largest gradient: the two sum the micro-batches in another
        # order, and an element near zero differs by rounding by more than 1e-7 absolute at some
        # BLAS thread counts (2 threads: 2.out_proj.weight; worst tensor 3.6e-7 of its max).
        atol = 1e-6 * float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=atol, msg=name)
    # Not the mean of the micro-batches' means (their counts differ: 2, 8, 16).
    means = sum(float(model(t, y).detach()) for t, y in batches) / len(batches)
    assert abs(means - float(want.detach())) > 1e-4


def test_the_validation_loss_is_over_the_masked_tokens():
    batches = _batches()
    model = NormFormerLM(TINY_MLM, seed=2)
    loss = _adapter(model, gas=1).eval_loss(iter(batches), len(batches))
    with torch.no_grad():
        want = _reference(model.eval(), batches)
    torch.testing.assert_close(loss.float(), want, rtol=1e-5, atol=1e-6)


def test_the_causal_lm_step_is_not_the_masked_path():
    assert not _adapter(NormFormerLM(TINY_MODEL, seed=2), gas=1).masked_lm
