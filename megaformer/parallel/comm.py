"""Which device a process group's collectives take, and small collectives placed on it.

NCCL takes CUDA tensors only (a CPU tensor fails with ``No backend type associated with device type
cpu``); gloo, which the CPU tests run on, takes CPU tensors (and CUDA ones). Code that builds a
tensor only to communicate it (a counter, a flag, a norm) must therefore build it on the group's
communication device, not on the default device: :func:`comm_device` says which that is.
``tests/distributed/test_comm_device.py`` runs the communicating code paths with the default device
set to ``meta``, so a tensor built without an explicit device reaches gloo as a meta tensor and is
refused, as NCCL would refuse a CPU one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device of the tensors ``group``'s backend communicates: the current CUDA device under
    NCCL, the CPU otherwise (gloo, or no process group at all)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_ints(values: list[int], group: ProcessGroup | None = None) -> list[int]:
    """Sum a few integers over ``group`` (one int64 tensor on the communication device).

    A host round trip by design: for start-up and checkpoint bookkeeping, not the step.
    """
    t = torch.tensor(values, dtype=torch.int64, device=comm_device(group))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return [int(v) for v in t.tolist()]


def all_reduce_max(values: list[float], group: ProcessGroup | None = None) -> list[float]:
    """The element-wise maximum of a few floats over ``group`` (one fp64 tensor on the
    communication device; a host round trip, for decisions every rank must share)."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def broadcast_int(value: int, src: int = 0, group: ProcessGroup | None = None) -> int:
    """Rank ``src``'s ``value`` on every rank of ``group`` (an int64 tensor on the communication
    device), so that all ranks act on one decision whatever each computed."""
    t = torch.tensor([value], dtype=torch.int64, device=comm_device(group))
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(t, src=src, group=group)
    return int(t.item())


def mean_over_group(value: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    """The mean of a 0-dim tensor over the ``size`` ranks of ``group``, without a host sync.

    Reduced and returned in fp64 on the group's communication device (a loss averaged over many
    micro-batches keeps its digits).
    """
    if size == 1:
        return value.detach().double()
    out = value.detach().double().to(comm_device(group)).clone()
    dist.all_reduce(out, group=group)
    return out / size
