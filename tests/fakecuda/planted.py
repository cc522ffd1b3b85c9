"""Defects planted into a fake-CUDA run (imported by the session through ``setup_modules``), to
show the tier catches them: a CPU tensor handed to a collective and a ``.item()`` in the block's
forward. Never imported by a real run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaformer.model import NormFormerBlock

_forward = NormFormerBlock.forward


def forward_with_a_host_sync(self, x, *args, **kwargs):
    scale = x.abs().max().item()  # planted: a host sync inside forward
    del scale
    return _forward(self, x, *args, **kwargs)


NormFormerBlock.forward = forward_with_a_host_sync

_all_reduce = dist.all_reduce


def all_reduce_with_a_cpu_tensor(tensor, *args, **kwargs):
    flag = torch.zeros(1)  # planted: built without its device, as a CPU tensor
    _all_reduce(flag, *args, **kwargs)
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = all_reduce_with_a_cpu_tensor
