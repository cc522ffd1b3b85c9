"""Process-group start-up and clean exit for DeepSpeed on nccl (GPU) or gloo (CPU)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def pick_backend(requested: str) -> str:
    """'nccl' when CUDA is available, else 'gloo' (for ``parallel.backend='auto'``)."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str) -> tuple[int, int, int]:
    """Start the default process group through DeepSpeed; return (rank, world_size, local_rank).

    The launcher (``deepspeed`` or ``torchrun``) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT. A plain ``python`` start without them runs as a single process.
    """
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend == "gloo":
        # DeepSpeed JIT-compiles its shared-memory CPU collective (~30 s) at init even though gloo
        # does the work; marking it incompatible skips the build (FACTS-DEEPSPEED-CPU.md).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def finish(exit_code: int = 0) -> None:
    """Leave cleanly: barrier, destroy the group, then ``os._exit``.

    Exiting with a live gloo group aborts a fraction of runs with 'terminate called without an
    active exception' (FACTS-DEEPSPEED-CPU.md); this sequence gave no failure in 52 runs.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        if exit_code == 0:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(exit_code)
