"""The GPUs a fake-CUDA run can stand in for (no torch import: the dry run's argument parser uses it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuModel:
    """What ``torch.cuda`` reports for the fake device: a name, compute capability and memory."""

    name: str
    capability: tuple[int, int]
    memory_bytes: int


GPUS: dict[str, GpuModel] = {
    "v100-32gb": GpuModel("Tesla V100-SXM2-32GB", (7, 0), 32 * 1024**3),
    "a100-40gb": GpuModel("NVIDIA A100-SXM4-40GB", (8, 0), 40 * 1024**3),
    "a100-80gb": GpuModel("NVIDIA A100-SXM4-80GB", (8, 0), 80 * 1024**3),
    "h100-80gb": GpuModel("NVIDIA H100 80GB HBM3", (9, 0), 80 * 1024**3),
    "h200-141gb": GpuModel("NVIDIA H200", (9, 0), 141 * 1024**3),
}

GPU_ALIASES = {
    "v100": "v100-32gb",
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
}
"""The obvious short names a user types (``--gpu h100``) for the devices of :data:`GPUS`."""


def gpu_name(value: str) -> str:
    """``--gpu`` of ``dryrun`` and ``plan``: a device of :data:`GPUS` or an alias (``h100``), any case.

    Raises:
        argparse.ArgumentTypeError: an unknown device, listing the known ones and the aliases.
    """
    key = GPU_ALIASES.get(value.lower(), value.lower())
    if key not in GPUS:
        raise argparse.ArgumentTypeError(
            f"unknown GPU {value!r}; use one of {', '.join(GPUS)} (or {', '.join(GPU_ALIASES)})"
        )
    return key
