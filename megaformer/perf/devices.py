"""The devices of the performance model: their rates (:class:`DeviceSpec`), the fits to the H200
measurements (:data:`H200_FIT`), the GPUs of the recipes (:data:`DEVICE_SPECS`) and this CPU's
measured rates (:func:`cpu_device`). The formulas that use them are :mod:`megaformer.perf.steptime`'s
(its docstring gives every rate's source)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from megaformer.training.flops import PEAK_TFLOPS

CPU_DEVICE_JSON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "bench",
    "results",
    "cpu_device.json",
)


@dataclass(frozen=True)
class DeviceSpec:
    """One device for the step-time model (bandwidths in GB/s per device, one direction).

    ``peak_tflops`` is the datasheet dense fp16/bf16 peak that MFU is measured against (a CPU: its
    measured fp32 matmul peak); ``matmul_fraction`` what large GEMMs achieve of it,
    ``attention_fraction`` what the causal fused attention kernel achieves (FLOPs it does / peak),
    ``hbm_fraction`` what a streaming copy achieves of the HBM bandwidth. ``exp_per_s`` and
    ``gelu_per_s``: elements per second of ``exp`` and GeLU where they are compute-bound (a CPU:
    measured; a GPU's special-function units keep them memory-bound: infinite). ``adamw_per_s``:
    parameters per second of the optimizer step where it is compute-bound (the CPU's per-tensor
    AdamW, measured). ``thin_gemm``: (smallest GEMM dimension, fraction of the large-GEMM rate)
    points measured on the CPU; a GEMM whose smallest dimension is below the largest point runs at
    the fraction interpolated in log(dimension) (none for GPUs: the roofline only).
    ``layernorm_per_s`` (input elements per second of a LayerNorm forward + backward),
    ``loss_per_s`` (logits per second of the softmax cross-entropy forward + backward) and
    ``adamw_small_per_s`` (the optimizer step's parameters per second on tensors below
    ``adamw_large_elems`` elements, ``adamw_per_s`` being the rate above): where these are
    compute-bound (a CPU, measured by ``bench/cpu_device.py``); infinite for GPUs (memory-bound).
    """

    name: str
    peak_tflops: float
    matmul_fraction: float
    attention_fraction: float
    hbm_gbs: float
    hbm_fraction: float
    nvlink_gbs: float
    nvlink_latency_us: float
    internode_gbs: float
    internode_latency_us: float
    cpu: bool = False
    exp_per_s: float = math.inf
    gelu_per_s: float = math.inf
    adamw_per_s: float = math.inf
    thin_gemm: tuple[tuple[int, float], ...] = ()
    layernorm_per_s: float = math.inf
    loss_per_s: float = math.inf
    adamw_small_per_s: float = math.inf
    adamw_large_elems: float = math.inf
    attention_fwd_fraction: float = math.nan
    attention_bwd_fraction: float = math.nan
    attention_dropout_fwd_fraction: float = math.nan
    attention_dropout_bwd_fraction: float = math.nan
    fused_fraction: float = math.nan
    fused_norm_fraction: float = math.nan
    copy_fraction: float = math.nan
    host_step_s: float = 0.0
    host_per_tensor_s: float = 0.0

    @property
    def matmul_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.matmul_fraction

    @property
    def memory_bytes_per_s(self) -> float:
        return self.hbm_gbs * 1e9 * self.hbm_fraction

    def attention_flops_per_s(self, *, backward: bool, dropout: bool) -> float:
        """FLOP/s (causal FLOPs halved) of the fused attention kernel in one direction, with or
        without dropout inside the kernel: ``peak × attention_[dropout_]{fwd,bwd}_fraction``, or
        ``peak × attention_fraction`` where those are not set (NaN: the CPU, the formula)."""
        name = f"attention_{'dropout_' if dropout else ''}{'bwd' if backward else 'fwd'}_fraction"
        fraction = getattr(self, name)
        return self.peak_tflops * 1e12 * (self.attention_fraction if math.isnan(fraction) else fraction)

    def bytes_per_s(self, kind: str) -> float:
        """HBM bytes per second of a class of memory-bound kernel: ``stream`` (vectorised
        elementwise kernels: ATen's contiguous copies, ``add_``, dropout, fused AdamW;
        ``hbm_fraction``), ``fused`` (inductor's generated pointwise / column-reduction kernels and
        the fused loss; ``fused_fraction``), ``fused_norm`` (inductor's kernels that compute a
        LayerNorm; ``fused_norm_fraction``), ``copy`` (ATen's non-vectorised elementwise kernel:
        strided and dtype-converting copies; ``copy_fraction``), each a fraction of ``hbm_gbs``;
        an unset (NaN) fraction falls back to ``hbm_fraction``.

        Raises:
            ValueError: an unknown ``kind``.
        """
        fractions = {
            "stream": self.hbm_fraction,
            "fused": self.fused_fraction,
            "fused_norm": self.fused_norm_fraction,
            "copy": self.copy_fraction,
        }
        if kind not in fractions:
            raise ValueError(f"kind={kind!r}: use one of {', '.join(fractions)}")
        fraction = fractions[kind]
        return self.hbm_gbs * 1e9 * (self.hbm_fraction if math.isnan(fraction) else fraction)


H200_FIT = {
    "matmul_fraction": 0.760,
    "hbm_fraction": 0.762,
    "attention_fwd_fraction": 0.372,
    "attention_bwd_fraction": 0.251,
    "attention_dropout_fwd_fraction": 0.152,
    "attention_dropout_bwd_fraction": 0.186,
    "fused_fraction": 0.669,
    "fused_norm_fraction": 0.246,
    "copy_fraction": 0.276,
    "host_step_s": 0.0112,
    "host_per_tensor_s": 4.37e-05,
}
"""The step-time model's GPU constants fitted once to the committed H200 profiles and measurements
(``bench/steptime_h200.py``, which derives each from ``bench/results/gpu/2026-11-26-h200*/``, writes
``bench/results/gpu/steptime_h200_fit.json`` and checks these values against it; a test repeats that
check). Fractions of the datasheet peak (989 TFLOP/s, 4,800 GB/s):

- ``matmul_fraction``: the profiles' GEMM device time (``aten::mm`` + ``aten::addmm``) against the
  model's GEMM FLOPs (125M Pre-LN / NormFormer, 1.3B NormFormer).
- ``attention_*``: the fused attention kernels' causal FLOPs over their device time, forward and
  backward: with dropout, cuDNN's dropout kernels in the 125M and 1.3B profiles (192 forwards per
  96 micro-batch blocks: the compiled operator's rerun, counted by the model); without, the 355M
  recipe's (no dropout) cuDNN kernels in the first loan's profile.
- ``hbm_fraction`` (``stream``): DeepSpeed's per-parameter fp32 ``add_`` and the fused AdamW in the
  1.3B profile, bytes over time.
- ``copy_fraction``: ATen's non-vectorised ``elementwise_kernel`` (the attention operator's four
  ``.contiguous()`` copies per block and micro-batch) and ``unrolled_elementwise_kernel`` (the BF16
  optimizer's bf16 -> fp32 gradient copies), bytes over time.
- ``fused_fraction``, ``fused_norm_fraction``: least squares over the three profiles of the device
  time not in the kernels above (the Triton kernels of the compiled blocks, the fused loss) against
  the model's bytes of the fused regions without / with a LayerNorm and of the loss.
- ``host_step_s``, ``host_per_tensor_s``: the measured step less the profile's device time (the GPU
  idle while the host works: kernel launches and DeepSpeed's per-parameter Python at the step
  boundary), least squares against the parameter tensors of the model.

Held out of every fit: the step times of the 355M rows, 1.3B Pre-LN, the two eager 125M rows and the
two 125M rows without attention dropout (only the three profiled rows' step times enter, through the
host term)."""

# The H200's kernel-class constants, carried to the other GPUs where they are fractions of HBM or a
# host property (an assumption: not measured there); the attention dropout kernels as the same
# fraction of each GPU's own no-dropout kernels as on the H200.
_MEMORY_FIT = {
    k: H200_FIT[k] for k in ("hbm_fraction", "fused_fraction", "fused_norm_fraction", "copy_fraction")
}
_HOST_FIT = {k: H200_FIT[k] for k in ("host_step_s", "host_per_tensor_s")}
_DROPOUT_FWD = H200_FIT["attention_dropout_fwd_fraction"] / H200_FIT["attention_fwd_fraction"]
_DROPOUT_BWD = H200_FIT["attention_dropout_bwd_fraction"] / H200_FIT["attention_bwd_fraction"]


def _gpu(
    name: str, peak: float, matmul: float, attention: tuple[float, float], hbm_gbs: float, links: tuple
) -> DeviceSpec:
    """A GPU's :class:`DeviceSpec`: ``attention`` = (forward, backward) no-dropout fractions."""
    fwd, bwd = attention
    return DeviceSpec(
        name,
        peak,
        matmul,
        (fwd + 2 * bwd) / 3,
        hbm_gbs,
        _MEMORY_FIT["hbm_fraction"],
        *links,
        attention_fwd_fraction=fwd,
        attention_bwd_fraction=bwd,
        attention_dropout_fwd_fraction=fwd * _DROPOUT_FWD,
        attention_dropout_bwd_fraction=bwd * _DROPOUT_BWD,
        **{k: v for k, v in _MEMORY_FIT.items() if k != "hbm_fraction"},
        **_HOST_FIT,
    )


_H200_ATTENTION = (H200_FIT["attention_fwd_fraction"], H200_FIT["attention_bwd_fraction"])
DEVICE_SPECS = {
    "v100-32gb": _gpu(
        "V100-SXM2-32GB fp16", PEAK_TFLOPS["V100"], 0.80, (0.30, 0.30), 900, (130, 5, 6.25, 10)
    ),
    "a100-40gb": _gpu("A100-SXM4-40GB bf16", PEAK_TFLOPS["A100"], 0.80, (0.50, 0.50), 1555, (230, 5, 25, 8)),
    "a100-80gb": _gpu("A100-SXM4-80GB bf16", PEAK_TFLOPS["A100"], 0.80, (0.50, 0.50), 2039, (230, 5, 25, 8)),
    "h100-80gb": _gpu(
        "H100-SXM5-80GB bf16",
        PEAK_TFLOPS["H100"],
        H200_FIT["matmul_fraction"],
        _H200_ATTENTION,
        3350,
        (360, 4, 50, 8),
    ),
    "h200-141gb": _gpu(
        "H200-SXM-141GB bf16",
        PEAK_TFLOPS["H200"],
        H200_FIT["matmul_fraction"],
        _H200_ATTENTION,
        4800,
        (360, 4, 50, 8),
    ),
}
"""The GPUs, with their sources:

- peaks: :data:`megaformer.training.flops.PEAK_TFLOPS` (dense fp16/bf16 tensor-core TFLOP/s, NVIDIA
  datasheets: V100 SXM2 125, A100 SXM4 312, H100 / H200 SXM 989).
- HBM GB/s: datasheets (V100 SXM2 900, A100 40GB 1,555, A100 80GB 2,039, H100 SXM5 3,350, H200
  4,800); the fraction each kind of kernel achieves (streaming 76 %, inductor's fused kernels 67 %,
  those with a LayerNorm 25 %, ATen's strided / converting copies 28 %) measured on the H200
  (:data:`H200_FIT`) and assumed on the others (the 85 % streaming rate assumed before 2026-11-28 came
  from STREAM-like copies on A100 / H100 reaching 85–93 %).
- matmul_fraction: H200 76 %, measured (:data:`H200_FIT`); H100 SXM the same (the same GH100 die and
  700 W limit; assumption: ~70 % was assumed before, ≈ 700 of 989 TFLOP/s as cuBLAS benchmarks
  report); large bf16 / fp16 cuBLAS GEMMs reach ~80 % of peak on V100 and A100 (NVIDIA's "Matrix
  Multiplication Background" guide, deep-learning performance docs; Megatron-LM's 52 % end-to-end MFU
  on A100, Narayanan et al. 2021 Table 1, needs GEMMs well above that; assumption).
- attention (causal, head dim 64–128, FLOPs actually done / peak, forward / backward): H200 and H100
  (the same die) cuDNN's kernels measured on the H200, 37.2 % / 25.1 % without dropout, 15.2 % /
  18.6 % with it (:data:`H200_FIT`); A100 FlashAttention-2 ≈ 150–190 of 312 TFLOP/s (Dao 2023, Fig.
  4–5): 0.5 both ways; V100 has no flash kernel, SDPA's memory-efficient kernel (xFormers, cutlass)
  ≈ 35–40 of 125: 0.30 (assumption); with dropout, A100 and V100 at the H200's ratio of dropout to
  no-dropout rates (41 % / 74 %; an assumption: their kernels are not cuDNN's). ``attention_fraction``
  (used where the per-direction ones are not set) is their FLOP-weighted mean.
- host_step_s, host_per_tensor_s: the H200 machine's (:data:`H200_FIT`), the same on every GPU
  (a host property; assumption).
- nvlink_gbs: NCCL all-reduce bus bandwidth within a node, per GPU (nccl-tests on DGX-1 V100
  ≈ 130 of NVLink2's 150 GB/s per direction; DGX A100 ≈ 230 of NVLink3's 300; DGX H100 ≈ 360 of
  NVLink4's 450, without NVLS), latency per ring step a few µs (assumption).
- internode_gbs: one NIC per GPU: V100 DGX-1 4 × 100 Gb/s EDR per 8 GPUs = 6.25 GB/s per GPU; A100
  DGX 8 × 200 Gb/s HDR = 25 GB/s; H100 / H200 DGX 8 × 400 Gb/s NDR = 50 GB/s (datasheets of the
  DGX systems); latency per hop 8–10 µs with NCCL's overhead (assumption).
"""


def cpu_device(threads: int = 2, processes: int = 1, path: str = CPU_DEVICE_JSON) -> DeviceSpec:
    """This machine's CPU from ``bench/cpu_device.py``'s JSON: each of ``processes`` processes runs
    ``threads`` threads; matmul and attention rates are those measured at ``threads`` threads, the
    memory bandwidth the one measured at ``threads × processes`` threads shared by the processes.
    Communication between processes (gloo over loopback TCP / shared memory): 2 GB/s, 50 µs per
    message (assumption, not measured).

    Where the JSON has them (``bench/cpu_device.py`` since 2026-11-25, issue 19; measured on this
    2-core AMD EPYC VM, torch 2.13 CPU, at the 125M block's shapes): GEMMs run at the block's
    linear layers' forward + backward rate (``block_gemm_gflops``: ``matmul_fraction`` = it / the
    peak: 0.96 at 2 threads, 0.99 at 1; the square-GEMM peak stays what MFU is measured against); GeLU at
    3 evaluations per ``gelu_fwd_bwd_gelems`` element (forward ≈ 1, backward ≈ 2, as the module
    docstring counts); LayerNorms at ``layernorm_gelems``; the loss at ``cross_entropy_glogits``;
    AdamW at ``adamw_block_gparams`` on tensors under 8 Mi elements (32 MiB of fp32, glibc malloc's
    largest mmap threshold, ``DEFAULT_MMAP_THRESHOLD_MAX`` in malloc/malloc.c: larger temporaries
    are fresh pages, zero-filled on first touch) and ``adamw_gparams`` (16 Mi elements) above."""
    with open(path) as f:
        data = json.load(f)["threads"]
    own = data[str(threads)]
    total = data.get(str(threads * processes), own)
    peak = own["peak_matmul_gflops"] / 1e3
    gelu_per_s = 3 * own["gelu_fwd_bwd_gelems"] if "gelu_fwd_bwd_gelems" in own else own["gelu_gelems"]
    return DeviceSpec(
        name=f"CPU ({threads} thread(s) × {processes} process(es), measured)",
        peak_tflops=peak,
        matmul_fraction=min(1.0, own.get("block_gemm_gflops", math.inf) / own["peak_matmul_gflops"]),
        attention_fraction=0.5 * own["attention_gflops"] / own["peak_matmul_gflops"],
        hbm_gbs=total["copy_gbs"] / processes,
        hbm_fraction=1.0,
        nvlink_gbs=2.0,
        nvlink_latency_us=50.0,
        internode_gbs=2.0,
        internode_latency_us=50.0,
        cpu=True,
        exp_per_s=own["exp_gelems"] * 1e9,
        gelu_per_s=gelu_per_s * 1e9,
        adamw_per_s=own.get("adamw_gparams", math.inf) * 1e9,
        thin_gemm=tuple(sorted((int(k), min(1.0, v)) for k, v in own.get("thin_gemm_fraction", {}).items())),
        layernorm_per_s=own.get("layernorm_gelems", math.inf) * 1e9,
        loss_per_s=own.get("cross_entropy_glogits", math.inf) * 1e9,
        adamw_small_per_s=own.get("adamw_block_gparams", math.inf) * 1e9,
        adamw_large_elems=8 * 2**20 if "adamw_block_gparams" in own else math.inf,
    )


# --- collectives -----------------------------------------------------------------------------------
