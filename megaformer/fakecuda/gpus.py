"""The GPUs a fake-CUDA run can stand in for (no torch import: the dry run's argument parser uses it)."""

from __future__ import annotations

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
