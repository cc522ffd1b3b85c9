"""Step-time model: predicted step time, tokens/s per device, MFU and device-hours of a recipe.

``python -m megaformer.tools.plan CONFIG [overrides] --gpu h100 --nodes N --gpus-per-node G --predict``
prints it. The model adds up, for the busiest pipeline stage of one rank, the time of each kind of
work of a training step, from the model's shapes (:class:`~megaformer.config.schema.ModelConfig`), the
layout (tp, pp, dp, ZeRO, precision, recompute, micro-batches) and a :class:`DeviceSpec`:

``compute``
    every GEMM of the block (qkv, W_O, fc1, fc2) and the output projection, forward + 2 backward
    GEMMs of the same FLOPs, each at ``max(2·M·K·N / R, q·(MK + KN + MN) / BW)`` (a roofline with
    ``R`` = peak × :attr:`DeviceSpec.matmul_fraction`, ``BW`` = HBM × :attr:`DeviceSpec.hbm_fraction`;
    on a CPU ``R`` also × the measured skinny-GEMM fraction, :func:`thin_fraction`).
    Under ``full`` recompute the blocks' forward GEMMs run twice (Korthikanti et al. 2022,
    arXiv:2205.05198, Sec. 5: full recompute adds one forward, ≈ 33 % of the step's FLOPs).
``attention``
    the attention core, the model's count ``3 · 4·b·s²·d / tp`` per block (QKᵀ and PV, as
    :mod:`megaformer.training.flops` counts it, the causal mask not halved) run by a causal fused
    kernel that skips the masked half: ``0.5 · flops / (peak × fraction)``
    (FlashAttention-2, Dao 2023, arXiv:2307.08691, Sec. 4.1 counts causal FLOPs halved the same way),
    the forward (a third of the FLOPs) and the backward each at its own fraction, with or without
    dropout in the kernel (:meth:`DeviceSpec.attention_flops_per_s`; on the H200, cuDNN's kernels:
    :data:`~.devices.H200_FIT`). Selective recompute adds one attention forward. The CPU with
    attention dropout runs the math kernel: the full FLOPs at the matmul rate plus ~80 bytes per
    ``T × T`` element (fp32 scores, softmax, mask and their gradients).
``memory``
    memory-bound operations at HBM speed (on a GPU each kind of kernel at its measured fraction of
    HBM, :meth:`DeviceSpec.bytes_per_s`: inductor's fused kernels with and without a LayerNorm,
    ATen's strided / dtype-converting copies, streaming kernels; :data:`~.devices.H200_FIT`): per token and
    block, the elements read + written in the forward by LN1, LN2 (2d each), two residual adds
    (3d each), two hidden dropouts (2d + a 1-byte mask), GeLU on the fc1 output (2f), the head
    reshapes of q, k, v and the attention output (8d),
    and NormFormer's post-attention LN (2d), HeadScale (2d), FFN LN (2f), ResScale (2d), qkv_ln (6d); the
    backward of an elementwise op reads its saved input and the output gradient and writes the input
    gradient: 2× the forward's traffic, so 3× in all (4× under full recompute). The d-wide operations run
    on every TP rank unless sequence parallelism splits them (Korthikanti et al. 2022, Sec. 4.2.2). The
    loss on a GPU (:func:`loss_bytes_per_logit`): compiled (``train.compile``, the fused cross-entropy)
    two reads of the logits in forward, one read and one write in backward, in their own dtype; eager,
    every pass of :func:`megaformer.parallel.vocab_parallel_cross_entropy` over its fp32 copy (72 bytes
    per logit from bf16 logits: on an H200 the 125M loss took 0.22 s of a 0.97 s Pre-LN step,
    bench/results/gpu/2026-11-26-h200). On a CPU ``exp`` and GeLU are compute-bound: the loss costs at
    least 2 ``exp`` per logit (softmax forward, again in backward) and GeLU 3 evaluations per element
    (forward; backward ≈ 2), at the measured element rates; where ``bench/cpu_device.py`` measured them at
    the 125M shapes, the loss at its forward + backward rate per logit, GeLU at its forward + backward
    rate and each LayerNorm (LN1, LN2, post-attention LN over d, FFN LN over f, qkv_ln over 3d) at its
    forward + backward rate per element (a recompute's forward ≈ 1/3 more), each in place of its memory
    traffic where slower.
``optimizer``
    DeepSpeed 0.19's buffers as :mod:`megaformer.perf.plan` describes them, at memory speed:
    AdamW reads gradient, weight, m, v and writes weight, m, v in fp32, 28 bytes per parameter of
    this rank's partition (Ψ/dp under ZeRO ≥ 1); the copy to 16-bit weights 6 Ψ/dp; the BF16
    optimizer's fp32 gradient accumulation 18 Ψ per micro-batch, parameter by parameter as
    ``hp_grad.add_(lp_grad.to(float32))`` does it (deepspeed/runtime/bf16_optimizer.py): a converting
    copy (read bf16 2, write fp32 4) at ATen's copy rate and an add (read 4 + 4, write 4);
    autograd's accumulation into ``.grad`` 3·q Ψ per micro-batch after the first; zeroing the
    gradients (q + 4) Ψ (4 Ψ with ``bf16.immediate_grad_update``, which frees the bf16
    gradients). On a CPU the AdamW step runs at its measured parameter rate where that is slower
    than its 28 bytes per parameter: one rate for tensors of 8 Mi elements or more, another for
    smaller ones (:func:`cpu_device`).
``tp_comm``
    Megatron's tensor parallelism: 2 all-reduces of ``b·s·d·q`` bytes per block in the forward and 2
    in the backward (Narayanan et al. 2021, arXiv:2104.04473, Sec. 3.3; Shoeybi et al. 2019 Fig. 4),
    2 more under full recompute; sequence parallelism replaces each by an all-gather + reduce-scatter
    of the same bytes (Korthikanti et al. 2022, Sec. 4.2.2); the vocabulary-parallel embedding and
    output layer 1 each; NormFormer's FFN LayerNorm under TP all-reduces its statistics (2 fp32 per
    token) in forward and backward. Not overlapped (megaformer issues them synchronously).
``pp_bubble``, ``pp_p2p``
    1F1B: ``(p − 1)`` micro-batch times of idle per step, i.e. a bubble fraction ``(p − 1)/m`` of the
    ideal time (Narayanan et al. 2021, Sec. 2.2.1, eq. (1)); each micro-batch sends its activations
    forward and receives their gradient, ``b·s·d·q`` bytes each way, blocking in DeepSpeed's
    pipeline engine. DeepSpeed's topology puts the pipeline axis outermost, so stages are on other
    nodes once the world exceeds one node.
``dp_comm``
    data parallelism with ZeRO (DeepSpeed 0.19), the gradients in ``communication_data_type`` (by
    default the training dtype: bf16 / fp16, also for fp32-accumulated gradients): bf16 with ZeRO ≤ 1
    (the BF16 optimizer) all-reduces the accumulated gradients after the last backward, not
    overlapped, then all-gathers the updated bf16 weights; fp16 / fp32 ZeRO-1 all-reduces them at
    the accumulation boundary (whole buckets, each rank keeping its partition), overlapped with the
    last micro-batch's backward when ``overlap_comm`` is on, then all-gathers the weights; ZeRO-2
    all-reduces every micro-batch's gradients the same way, overlapped with its backward when
    ``overlap_comm`` is on (what the fake-CUDA dry runs record). Ring collectives (NCCL's ring
    algorithm, whose bus bandwidth is defined so, nccl-tests doc/PERFORMANCE.md): all-reduce moves
    ``2(n−1)/n · B`` bytes per rank, reduce-scatter and all-gather ``(n−1)/n · B``, plus ``2(n−1)``
    (``n − 1``) latencies per bucket; bandwidth: NVLink within a node, the node's network per GPU
    across nodes. What overlap leaves exposed is ``max(0, communication − backward time)``.

Step time = ``m · t_micro + pp_bubble + pp_p2p + dp_comm (exposed) + optimizer + host``; tokens/s per
device = ``global batch · s / step / world``; MFU = model FLOPs per token
(:func:`megaformer.training.flops.model_flops_per_token`, no recompute counted) × tokens per step
/ (world × datasheet peak × step), the definition of :class:`megaformer.training.flops.ComputeMeter`;
device-hours = ``train.steps × step × world / 3600``.

``host``
    the time the GPU waits for the host per step, ``host_step_s + host_per_tensor_s × tensors``
    (the parameter tensors of the rank, :func:`param_tensors`: DeepSpeed's per-parameter loops at
    the step boundary; kernel launches): the measured H200 steps less their profiles' device time,
    1.8–2.9 % of those steps (:data:`~.devices.H200_FIT`); 0 on the CPU (its measured rates include it).

Not modelled: kernel launch / Python dispatch overhead on the CPU (a few percent on the CPU
quickstart), the data loader, evaluation and checkpoint time, NCCL's tree algorithm (lower
latency at many nodes), network contention between data- and tensor-parallel groups, clock
throttling.

The terms above are the formula (:func:`formula_block_costs`). On a GPU, where the fake-CUDA shim builds,
a block's GEMMs, attention kernel, memory-bound bytes and TP collectives are instead counted from
the block's fake-CUDA trace (:mod:`megaformer.perf.optrace`), and for compiled blocks (the
default on CUDA) the memory-bound bytes are the trace's estimate of inductor's fused kernels
(:func:`block_costs`; ``plan --counts formula`` gives the formula's prediction).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from megaformer.config.schema import RunConfig
from megaformer.perf import optrace
from megaformer.perf.costs import (
    bubble_fraction,
    collective_time,
    formula_block_costs,
    gemm_seconds,
    link,
    ring_allreduce_bytes,
    ring_gather_bytes,
    thin_fraction,
)
from megaformer.perf.devices import DEVICE_SPECS, DeviceSpec, cpu_device
from megaformer.perf.plan import DEVICES, Device, engine_json, immediate_grad_update, make_plan
from megaformer.training.flops import decoded_share, model_flops_per_token


@dataclass
class StepTime:
    """Predicted seconds per optimizer step, by term (``dp_comm`` exposed after overlap)."""

    compute: float
    memory: float
    attention: float
    tp_comm: float
    pp_bubble: float
    pp_p2p: float
    dp_comm: float
    optimizer: float
    dp_comm_total: float
    micro_batch: float
    micro_batches: int
    world: int
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float
    steps: int
    counted: str = "formula (eager kernels)"
    host: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.host
            + self.compute
            + self.memory
            + self.attention
            + self.tp_comm
            + self.pp_bubble
            + self.pp_p2p
            + self.dp_comm
            + self.optimizer
        )

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.total / self.world

    @property
    def mfu(self) -> float:
        return self.flops_per_step / (self.world * self.peak_flops * self.total)

    @property
    def device_hours(self) -> float:
        return self.steps * self.total * self.world / 3600.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            step_s=self.total,
            tokens_per_s_per_device=self.tokens_per_s_per_device,
            mfu=self.mfu,
            device_hours=self.device_hours,
        )
        return out


def _communication_bytes(cfg: RunConfig, q: int) -> float:
    """Bytes per element of the data-parallel gradient reduction: DeepSpeed 0.19 casts the gradients
    (also the BF16 optimizer's fp32 accumulation and ZeRO's fp32 ``grad_accum``) to
    ``communication_data_type`` for the collective, by default the training dtype
    (``DeepSpeedEngine.communication_data_type``: fp16, bf16, else fp32; ``allreduce_bucket``,
    ``gradient_reduction_w_predivide``)."""
    name = str(engine_json(cfg).get("communication_data_type") or "").lower()
    sizes = {"fp32": 4.0, "float32": 4.0, "fp16": 2.0, "float16": 2.0, "bf16": 2.0, "bfloat16": 2.0}
    return sizes.get(name, float(q))


def _zero_config(cfg: RunConfig) -> dict:
    return engine_json(cfg).get("zero_optimization", {})


COUNTS = ("auto", "trace", "formula")
"""How :func:`predict` counts a block's operations: ``auto`` (a GPU: from the fake-CUDA trace where
the shim builds, else by formula; a CPU: by formula), ``trace`` (a GPU: the trace, or an error),
``formula`` (:func:`formula_block_costs`)."""


def block_costs(
    cfg: RunConfig, dev: DeviceSpec, q: int, gpus_per_node: int, counts: str = "auto"
) -> tuple[tuple[float, ...], str]:
    """One block, one micro-batch, one rank: ``(GEMM s, attention s, memory-bound s, TP s, b·s·d·q
    bytes)`` and how they were counted (for the printout).

    On a GPU the operations are those of the block's fake-CUDA trace
    (:func:`megaformer.perf.optrace.block_costs`: every GEMM with its shape, the attention
    kernel, every memory-bound kernel's bytes, every collective), and where the blocks run compiled
    (``train.compile`` on, the default on CUDA, not under ZeRO-3:
    :func:`megaformer.perf.optrace.compiles`) their memory-bound traffic is the trace's fusion
    estimate (:func:`megaformer.perf.optrace.fuse`: what inductor's fused kernels read and
    write), with the attention operator's forward rerun in backward. On a CPU, with
    ``counts='formula'``, or where the fake-CUDA shim cannot be built (no C++ compiler), the
    formula (:func:`formula_block_costs`; eager kernels).

    Raises:
        ValueError: ``counts`` not one of :data:`COUNTS`.
        megaformer.perf.fakecuda.build.ShimUnavailableError: ``counts='trace'`` and no shim here.
    """
    if counts not in COUNTS:
        raise ValueError(f"counts={counts!r}: use one of {', '.join(COUNTS)}")
    if not dev.cpu and counts != "formula" and (counts == "trace" or optrace.available()):
        compiled = optrace.compiles(cfg)
        costs = optrace.block_costs(cfg, dev, q, gpus_per_node, compiled=compiled)
        how = "compiled block, fusion estimate" if compiled else "eager block"
        return costs, f"fake-CUDA trace ({how})"
    return formula_block_costs(cfg, dev, q, gpus_per_node), "formula (eager kernels)"


def loss_bytes_per_logit(cfg: RunConfig, q: int) -> float:
    """HBM bytes the loss reads and writes per logit on a GPU, forward + backward, in ``q``-byte
    logits (:func:`megaformer.parallel.vocab_parallel_cross_entropy`).

    Fused (where the blocks are compiled, :func:`megaformer.perf.optrace.compiles`, or under
    ZeRO-3 with ``train.compile`` on): the max (read), the sum of exponentials with the target
    (read), the gradient (read, write): ``4q``. Eager, 16-bit logits: forward max (2), fp32 copy
    (2 + 4), shift (8), exp (8), sum (4); backward copy (6), shift (8), exp (8), divide (8), scale
    (8), cast back (4 + 2): 72. Eager fp32 logits, in place: max, shift, exp, sum, divide (36),
    scale (8): 44.
    """
    setting = cfg.train.compile
    if setting if isinstance(setting, bool) else True:  # 'auto': on for CUDA
        return 4.0 * q
    return 72.0 if q == 2 else 44.0


def _busiest_stage(
    cfg: RunConfig, dev: DeviceSpec, plan: Any, q: int, gpus_per_node: int, block: tuple[float, ...]
) -> tuple[float, float, float, float, float, int, float]:
    """(micro-batch time, GEMMs, attention, memory-bound, TP communication, parameters) of the
    pipeline stage whose micro-batch takes longest, and the activation bytes ``b·s·d``, from one
    block's costs ``block`` (:func:`block_costs`)."""
    m, tp = cfg.model, cfg.parallel.tp_size
    n = cfg.train.micro_batch_size * m.seq_len
    n_decoded = n * decoded_share(m)
    d, v = m.hidden_size, m.padded_vocab_size(tp)
    block_compute, block_attention, block_memory, block_tp, act = block
    tp_bw, tp_lat = link(dev, tp, gpus_per_node)
    best = None
    for stage in plan.stages:
        lo, hi = stage.layers
        blocks = sum(1 for i in range(lo, hi) if 1 <= i <= m.num_layers)
        first, last = lo == 0, hi == m.num_layers + 3
        compute, attention = blocks * block_compute, blocks * block_attention
        memory, tpc = blocks * block_memory, blocks * block_tp
        if first:
            memory += n * q * 4 * d * 3 / dev.memory_bytes_per_s  # lookup, scale, dropout, gradient
            tpc += collective_time("allreduce", act, tp, tp_bw, tp_lat)
        if last:
            # the decoder and its loss, at the decoded positions (the masked ones only, if so set)
            compute += 3 * gemm_seconds(dev, n_decoded, d, v / tp, q)
            if dev.cpu:
                # the loss's measured rate (else softmax's exp in forward and again in backward), or
                # 16 bytes per logit
                loss = (
                    n_decoded * v / tp / dev.loss_per_s
                    if math.isfinite(dev.loss_per_s)
                    else 2.0 * n_decoded * v / tp / dev.exp_per_s
                )
                memory += max(n_decoded * 16.0 * v / tp / dev.memory_bytes_per_s, loss)
            else:  # fused (inductor's kernels) or eager (ATen's), both at the fused class's rate
                memory += n_decoded * loss_bytes_per_logit(cfg, q) * v / tp / dev.bytes_per_s("fused")
            tpc += collective_time("allreduce", act, tp, tp_bw, tp_lat)
        params = stage.params
        if first and last and m.tie_embeddings:  # the tied output layer is the embedding's tensor
            params -= v * d // tp
        row = (compute + attention + memory + tpc, compute, attention, memory, tpc, params)
        best = row if best is None or row[0] > best[0] else best
    return (*best, act)


def _cpu_adamw(cfg: RunConfig, dev: DeviceSpec, part: float) -> DeviceSpec:
    """``dev`` with ``adamw_per_s`` the rate of this rank's optimizer step over its tensors: those of
    ``adamw_large_elems`` elements or more at ``adamw_per_s``, the rest at ``adamw_small_per_s``
    (a CPU; unchanged where the latter is not measured). The large tensors: under ZeRO ≥ 1 the
    flat fp32 partition (DeepSpeed keeps one per parameter group), else the word embedding (and an
    untied output layer)."""
    if not math.isfinite(dev.adamw_small_per_s) or part <= 0:
        return dev
    m, tp = cfg.model, cfg.parallel.tp_size
    if cfg.train.zero_stage >= 1:
        large = part if part >= dev.adamw_large_elems else 0.0
    else:
        emb = m.padded_vocab_size(tp) * m.hidden_size / tp
        large = min(part, emb * (1 if m.tie_embeddings else 2)) if emb >= dev.adamw_large_elems else 0.0
    seconds = large / dev.adamw_per_s + (part - large) / dev.adamw_small_per_s
    return replace(dev, adamw_per_s=part / seconds)


def _optimizer_time(
    dev: DeviceSpec,
    params: float,
    part: float,
    gas: int,
    q: int,
    bf16_low_zero: bool,
    immediate: bool = False,
) -> float:
    """The optimizer step and gradient accumulation (memory-bound), seconds (module docstring).
    ``immediate``: the BF16 optimizer's ``immediate_grad_update`` (the same 10Ψ accumulation per
    micro-batch, inside backward; no bf16 gradients left to zero)."""
    # The BF16 optimizer adds each bf16 gradient into its fp32 one parameter by parameter,
    # ``hp_grad.add_(lp.grad.to(float32))`` (deepspeed/runtime/bf16_optimizer.py, _update_hp_grad):
    # a dtype-converting copy (read 2, write 4: ATen's non-vectorised kernel on a GPU) and the add
    # (read 4 + 4, write 4), 18 bytes per parameter per micro-batch.
    convert = gas * 6.0 * params if bf16_low_zero else 0.0
    accum = gas * 12.0 * params if bf16_low_zero else (gas - 1) * 3.0 * q * params
    zeroing = (4.0 if (bf16_low_zero and immediate) else q + 4.0) * params
    opt_bytes = accum + 28.0 * part + (6.0 * part if q == 2 else 0.0) + zeroing
    return (
        opt_bytes / dev.memory_bytes_per_s
        + convert / dev.bytes_per_s("copy")
        + max(0.0, part / dev.adamw_per_s - 28.0 * part / dev.memory_bytes_per_s)
    )


def _dp_comm(
    cfg: RunConfig,
    dev: DeviceSpec,
    params: float,
    plan: Any,
    q: int,
    t_mb: float,
    world: int,
    gpus_per_node: int,
) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel gradient communication of one step, as
    DeepSpeed 0.19 runs it for the precision and ZeRO stage (module docstring). ZeRO-1 and ZeRO-2
    reduce with all-reduces of whole buckets, each rank keeping its partition
    (``DeepSpeedZeroOptimizer.average_tensor`` with ``use_multi_rank_bucket_allreduce``, the default),
    not reduce-scatters: the fake-CUDA dry runs record ``allreduce_`` of the whole gradient per
    reduction (``bench/results/dryrun/*.txt``, "collectives")."""
    dp, gas = plan.dp, plan.gas
    precision, zero = ("fp32" if dev.cpu else cfg.train.precision), cfg.train.zero_stage
    zcfg = _zero_config(cfg)
    bucket = float(zcfg.get("reduce_bucket_size", 5e8)) * 4
    overlap = bool(zcfg.get("overlap_comm", False))
    dp_bw, dp_lat = link(dev, world, gpus_per_node)
    backward_mb = t_mb * 2 / 3
    if dp <= 1:
        return 0.0, 0.0
    comm = _communication_bytes(cfg, q)
    if precision == "bf16" and zero <= 1:
        total = collective_time("allreduce", comm * params, dp, dp_bw, dp_lat, bucket)
        total += collective_time("gather", 2.0 * params, dp, dp_bw, dp_lat, bucket) if zero == 1 else 0.0
        return total, total
    gather = collective_time("gather", q * params, dp, dp_bw, dp_lat, bucket)
    if zero >= 2:
        per_mb = collective_time("allreduce", comm * params, dp, dp_bw, dp_lat, bucket)
        exposed = gas * (max(0.0, per_mb - backward_mb) if overlap else per_mb) + gather
        return gas * per_mb + gather, exposed
    if zero == 1:
        reduce = collective_time("allreduce", comm * params, dp, dp_bw, dp_lat, bucket)
    else:
        reduce, gather = collective_time("allreduce", q * params, dp, dp_bw, dp_lat, bucket), 0.0
    return reduce + gather, (max(0.0, reduce - backward_mb) if overlap else reduce) + gather


@functools.lru_cache(maxsize=64)
def _tensors_per_layer(model: Any) -> tuple[int, int]:
    """(parameter tensors of one block, of the embedding + final norm + untied output) of ``model``
    (a :class:`~megaformer.config.schema.ModelConfig`), counted on a tiny model with the same
    switches: a 1-layer and a 2-layer :class:`~megaformer.model.NormFormerLM`."""
    import torch

    # lazy: the model, built only for this count (tiny models; the rest of the step-time model needs none)
    from megaformer.model.lm import NormFormerLM

    tiny = replace(
        model,
        hidden_size=8 * model.num_attention_heads,
        ffn_hidden_size=16,
        seq_len=8,
    )
    with torch.device("meta"):
        counts = [sum(1 for _ in NormFormerLM(replace(tiny, num_layers=n)).parameters()) for n in (1, 2)]
    return counts[1] - counts[0], 2 * counts[0] - counts[1]


def param_tensors(cfg: RunConfig) -> int:
    """Parameter tensors on one rank of the busiest pipeline stage (its share of the blocks,
    rounded up, plus the embedding, final norm and output layer): the loops of DeepSpeed's optimizer
    and gradient accumulation go parameter by parameter (:func:`predict`'s host term)."""
    m = cfg.model
    per_block, rest = _tensors_per_layer(m)
    return per_block * math.ceil(m.num_layers / cfg.parallel.pp_size) + rest


def predict(
    cfg: RunConfig, dev: DeviceSpec, world: int, gpus_per_node: int = 8, counts: str = "auto"
) -> StepTime:
    """Predict one optimizer step of ``cfg`` on ``world`` devices ``dev`` (module docstring); a
    block's operations counted as ``counts`` says (:func:`block_costs`).

    Raises:
        ConfigError: as :func:`megaformer.perf.plan.make_plan` (layout or batch does not divide).
        ValueError, ShimUnavailableError: as :func:`block_costs`.
    """
    m, par, t = cfg.model, cfg.parallel, cfg.train
    mem_device = Device("cpu", 1e9, dev.peak_tflops, cpu=True) if dev.cpu else DEVICES["a100-80gb"]
    plan = make_plan(cfg, mem_device, world)
    dp, gas = plan.dp, plan.gas
    precision = "fp32" if dev.cpu else t.precision
    q = 4 if precision == "fp32" else 2
    block, counted = block_costs(cfg, dev, q, gpus_per_node, counts)
    t_mb, compute, attention, memory, tpc, params, act = _busiest_stage(
        cfg, dev, plan, q, gpus_per_node, block
    )

    # Pipeline: the 1F1B bubble and the blocking p2p of each micro-batch.
    bubble = (par.pp_size - 1) * t_mb
    p2p = 0.0
    if par.pp_size > 1:
        bw, lat = link(dev, world, gpus_per_node)
        p2p = gas * 2 * (act / bw + lat)

    part = params / dp if t.zero_stage >= 1 else params
    dev = _cpu_adamw(cfg, dev, part)
    bf16_low_zero = precision == "bf16" and t.zero_stage <= 1
    optimizer = _optimizer_time(dev, params, part, gas, q, bf16_low_zero, immediate_grad_update(cfg))
    dp_total, dp_exposed = _dp_comm(cfg, dev, params, plan, q, t_mb, world, gpus_per_node)

    host = dev.host_step_s + dev.host_per_tensor_s * param_tensors(cfg)

    tokens = t.global_batch_size * m.seq_len
    flops = model_flops_per_token(m, m.padded_vocab_size(par.tp_size)) * tokens
    return StepTime(
        host=host,
        compute=gas * compute,
        memory=gas * memory,
        attention=gas * attention,
        tp_comm=gas * tpc,
        pp_bubble=bubble,
        pp_p2p=p2p,
        dp_comm=dp_exposed,
        optimizer=optimizer,
        dp_comm_total=dp_total,
        micro_batch=t_mb,
        micro_batches=gas,
        world=world,
        tokens_per_step=tokens,
        flops_per_step=flops,
        peak_flops=dev.peak_tflops * 1e12,
        steps=t.steps,
        counted=counted,
    )


def describe(st: StepTime, dev: DeviceSpec) -> str:
    """The prediction as the lines ``plan --predict`` prints."""
    total = st.total
    rows = [
        ("compute (GEMMs)", st.compute),
        ("memory-bound ops", st.memory),
        ("attention kernel", st.attention),
        ("TP communication", st.tp_comm),
        ("PP bubble", st.pp_bubble),
        ("PP p2p", st.pp_p2p),
        (f"DP communication (exposed; {st.dp_comm_total:.3g} s before overlap)", st.dp_comm),
        ("optimizer + grad accumulation", st.optimizer),
        ("host (GPU idle: launches, DeepSpeed's per-parameter steps)", st.host),
    ]
    lines = [
        f"predicted step on {dev.name} ({st.micro_batches} micro-batches of {st.micro_batch:.4g} s; "
        f"block operations counted from the {st.counted}):"
    ]
    lines += [f"  {name:62s} {sec:10.4g} s  {sec / total:6.1%}" for name, sec in rows]
    lines.append(f"  {'step':62s} {total:10.4g} s")
    lines.append(
        f"predicted: tokens/s per device {st.tokens_per_s_per_device:,.1f}; MFU {st.mfu:.1%} of "
        f"{st.peak_flops / 1e12:.4g} TFLOP/s; {st.steps:,} steps = {st.device_hours:,.5g} device-hours "
        f"({st.device_hours / st.world:,.4g} h wall)"
    )
    if not dev.cpu:
        lines.append(
            "(a prediction: the model's GPU constants are fitted to one H200's profiles, its error on "
            "that H200's measured steps in BENCHMARKS.md; other GPUs take them as assumptions)"
        )
    return "\n".join(lines)


__all__ = [
    "COUNTS",
    "DEVICE_SPECS",
    "DeviceSpec",
    "StepTime",
    "block_costs",
    "bubble_fraction",
    "collective_time",
    "cpu_device",
    "describe",
    "predict",
    "ring_allreduce_bytes",
    "ring_gather_bytes",
    "thin_fraction",
]
