"""The masked LM (model.objective=mlm) at TP = 2 equals TP = 1: logits, the masked-positions loss and
every gathered gradient (RoBERTa's LM head: replicated dense + LayerNorm, vocabulary-parallel bias),
with and without sequence parallelism, in spawned gloo processes on CPU; and TP = 2 decoding the
masked positions only (model.mlm_head_positions masked) equals TP = 1 decoding all of them."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaformer.data.mlm import IGNORE_INDEX, MLM_VOCAB_SIZE
from megaformer.model import NormFormerLM
from tests.distributed.conftest import free_port
from tests.distributed.test_tp_layers import _full_grad, _gather, _gen, _rank_slice, _rel
from tests.tiny_model import TINY_MODEL

TINY_MLM = dataclasses.replace(
    TINY_MODEL, objective="mlm", vocab_size=MLM_VOCAB_SIZE, position_embedding="learned"
)


def _check(group, sequence_parallel: bool, head_positions: str = "all") -> None:
    tokens = torch.randint(0, 50257, (2, 16), generator=_gen(13))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    if head_positions == "all":
        chosen = torch.rand(tokens.shape, generator=_gen(14)) < 0.3
    else:  # the head decodes max_masked_positions(16) = 3 per row: the data's rule never gives more
        chosen = torch.zeros(tokens.shape, dtype=torch.bool)
        chosen[0, [2, 9, 15]] = chosen[1, [0, 7]] = True
    labels[chosen] = torch.randint(0, 50260, tokens.shape, generator=_gen(15))[chosen]
    # The sharded model decodes where head_positions says; the reference always everywhere.
    sharded_cfg = dataclasses.replace(TINY_MLM, mlm_head_positions=head_positions)
    sharded = NormFormerLM(sharded_cfg, tp_group=group, seed=3, sequence_parallel=sequence_parallel)
    plain = NormFormerLM(TINY_MLM, seed=3)
    with torch.no_grad():  # random gains / biases (the head's vocabulary bias included), set alike
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
            if q.ndim == 1:
                full = 1 + 0.5 * torch.randn(q.shape, generator=_gen(len(name)))
                q.copy_(full)
                p.copy_(_rank_slice(full, 0, group) if p.tensor_model_parallel else full[: p.shape[0]])
    v = TINY_MLM.vocab_size
    logits = _gather(sharded(tokens), -1, group)
    assert float((logits[..., :v] - plain(tokens)[..., :v]).abs().max().detach()) <= 1e-5
    loss_tp, loss_1 = sharded(tokens, labels), plain(tokens, labels)
    assert abs(float(loss_tp) - float(loss_1)) <= 1e-6 * abs(float(loss_1)), (loss_tp, loss_1)
    loss_tp.backward()
    loss_1.backward()
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
        g = _full_grad(p, group)
        rows = min(g.shape[0], q.grad.shape[0])  # vocabulary padding differs with the TP degree
        assert _rel(g[:rows], q.grad[:rows]) <= 1e-5, (sequence_parallel, name, _rel(g[:rows], q.grad[:rows]))


def _worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world_size)))
    _check(group, sequence_parallel=False)
    _check(group, sequence_parallel=True)
    _check(group, sequence_parallel=False, head_positions="masked")
    _check(group, sequence_parallel=True, head_positions="masked")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks (8 s on 2 cores): outside `check.sh --fast`
def test_tp2_masked_lm_equals_its_unsharded_version():
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
