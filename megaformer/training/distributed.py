"""Backend choice and clean exit of the process group (start-up is DeepSpeed's: see
:func:`megaformer.training.ds_adapter.init_distributed`)."""

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


def finish(exit_code: int = 0) -> None:
    """Leave: flush, then ``os._exit(exit_code)``; with every rank done (0, or 75: stopped early at
    the same step on every rank) after a barrier and ``destroy_process_group``.

    Exiting with a live gloo group through Python's normal exit aborts a fraction of runs with
    'terminate called without an active exception' (FACTS-DEEPSPEED-CPU.md: the static destructors
    of its threads); barrier, destroy, ``os._exit`` gave no failure in 52 runs. On an error the
    other ranks are not at a barrier, and destroying the groups while a peer is failing too can
    raise (this rank then exits 1 with a C++ trace instead of its own code) or wait in the gloo
    shutdown for that peer: ``os._exit`` alone runs no destructor, and closing this process's
    sockets fails every peer's next collective (gloo: "Connection closed by peer"); under a
    launcher, it ends the others too.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_code in (0, 75) and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(exit_code)
