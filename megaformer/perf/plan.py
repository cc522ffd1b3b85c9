"""The memory model: will this config fit these devices, how fast at a stated MFU, how many device-hours.

The command is ``python -m megaformer.tools.plan CONFIG [section.key=value ...] --gpu a100-80gb
--nodes N --gpus-per-node G [--mfu 0.4] [--predict]`` (:mod:`megaformer.tools.plan`); it prints, per
pipeline stage (every TP and data-parallel rank of a stage holds the same), the bytes of parameters,
gradients and optimizer state (by ZeRO stage and precision), activations (by recompute choice,
micro-batch, seq_len, TP, sequence parallelism and pipeline depth), logits and buffers, against the
device's memory; the model FLOPs per step (:mod:`megaformer.training.flops`), the step time at a
stated MFU and the device-hours of the run; whether the config fits V100-32GB, A100-40GB and
A100-80GB; and, where it does not fit, a layout that does. ``--predict`` adds the step-time model's
prediction (:mod:`megaformer.perf.steptime`: compute, memory-bound, attention, TP, PP and DP terms,
tokens/s per device, MFU, device-hours) instead of a stated MFU. ``--gpu cpu`` predicts the peak
resident memory of each CPU process instead (fp32 arithmetic, the CPU attention kernels, the
process's own footprint).

What is counted, per rank (``Ψ`` = this rank's parameters: its TP shard of its stage's layers):

- model states (DeepSpeed 0.19, as configured by :mod:`megaformer.training.deepspeed_config`):
  fp32: weights 4Ψ, gradients 4Ψ, Adam m and v 8Ψ, and under ZeRO ≥ 1 DeepSpeed's fp32 partition
  copy of the weights and of the gradients (4 + 4)Ψ/dp; bf16 without ZeRO or with ZeRO-1 (DeepSpeed
  0.19's ``BF16_Optimizer``, deepspeed/runtime/bf16_optimizer.py): bf16 weights 2Ψ
  (``bf16_groups_flat``), the parameters' bf16 gradients 2Ψ (kept for the whole step:
  ``clear_lp_grads`` zeroes them, it does not free them; not held with ``bf16.immediate_grad_update``,
  which the bf16 recipes' JSONs set: :func:`immediate_grad_update`), the fp32 gradient accumulation 4Ψ
  (``fp32_groups_gradients_flat``, full size), fp32 master + m + v 12Ψ/dp
  (``fp32_groups_flat_partition`` and Adam's state); bf16 ZeRO-2 (``DeepSpeedZeroOptimizer``,
  deepspeed/runtime/zero/stage_1_and_2.py): bf16 weights 2Ψ, the gradient-reduction buckets
  (``ipg_buckets``: ``reduce_bucket_size`` elements in bf16, two with ``overlap_comm``), the fp32
  gradient partition 4Ψ/dp (``single_partition_of_fp32_groups[i].grad``), fp32 master + m + v
  12Ψ/dp; on CPU also the unfused AdamW step's full-size temporary 4Ψ/dp and the ZeRO reduction
  bucket; fp16: fp16 weights and gradients 2Ψ + 2Ψ, fp32 master, m, v and gradient 16Ψ/dp
  (ZeRO-2: the fp16 gradients divided by dp, plus the buckets). ZeRO-2 divides the gradients, ZeRO-3
  everything by dp.
- activations kept for backward per block and micro-batch, summed from what each operation of
  :class:`~megaformer.model.NormFormerBlock` saves (``q`` bytes per element of the compute dtype,
  per token): replicated ``d`` each for LN1, LN2, POSTATTN_LN and ResScale's inputs (÷ tp under
  sequence parallelism), the inputs of qkv and fc1 ``d`` each (all-gathered under sequence
  parallelism, hence never divided), sharded ÷ tp: q, k, v ``3d``, the attention output ``d``,
  W_O's input ``d``, HeadScale's input ``d``, the activation's, FFN_LN's and W2's inputs ``f``
  each; dropout masks 1 byte × ``d`` per hidden dropout (÷ tp under sequence parallelism). At
  ``q = 2`` this is 36·d (Pre-LN) and 48·d (NormFormer) bytes per token, the coefficients
  ``tests/unit/test_recipes.py`` measures. The attention core keeps no ``T × T`` matrix with the
  fused kernels that GPUs run (flash / memory-efficient, any dtype); on CPU with attention dropout
  the math kernel keeps ``12 · heads/tp · T²`` bytes per sequence (scores, probabilities, mask;
  fp32; measured), and without dropout the CPU flash kernel keeps none.
  ``selective`` recompute keeps only q, k, v of the core (no output, no ``T × T``); ``full`` keeps
  each block's input (``q·d`` per token, ÷ tp when partitioned or sequence-parallel) plus one block's
  activations during its recomputation. A pipeline stage keeps ``min(pp − stage, micro-batches)``
  micro-batches in flight (DeepSpeed's 1F1B schedule), the last stage one.
- logits and loss (last stage): fp32 logits, reused as the softmax buffer, 4 bytes × V/tp per
  token, plus the fp32 gradient the backward writes into it; bf16 / fp16: the logits 2 bytes kept,
  a transient fp32 softmax 4 and the gradient 2.
- buffers: GPUs 2 GiB (CUDA context, NCCL, DeepSpeed's buckets of 2e8 elements), as the recipes'
  headers; CPU processes :data:`CPU_PROCESS_BASE_GIB` (torch, DeepSpeed and megaformer imported).

Not counted: allocator fragmentation (keep 20 % headroom, which :data:`HEADROOM` applies to the
verdict), the data loader's worker processes, temporaries of the backward beyond one block.

On CPU the prediction is of live memory. glibc's malloc keeps freed blocks of the backward's
transients in its arenas (its mmap threshold grows with every large free), so a process's peak
RSS exceeds its live peak: a 204M-parameter fp32 model (one process, seq 2048, no recompute) had
5.8 GiB resident after its second backward with 3.3 GiB live, and 3.4 GiB with
``MALLOC_MMAP_THRESHOLD_=65536`` (large tensors then come from mmap and return to the system on
free). Set it for CPU runs whose memory is tight (BENCHMARKS.md, 355M at tp 2 × pp 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from megaformer.config import ConfigError, load_config
from megaformer.config.schema import ModelConfig, RunConfig
from megaformer.training.deepspeed_config import read_engine_json
from megaformer.training.flops import (
    PEAK_TFLOPS,
    decoded_share,
    measure_cpu_peak_flops,
    model_flops_per_token,
)

GIB = 1024**3
HEADROOM = 0.8
"""A layout 'fits' when its predicted peak is at most this fraction of the device's memory."""
CPU_PROCESS_BASE_GIB = 0.3
"""Resident memory of a training process before the model (python, torch, DeepSpeed, megaformer
imported, gloo up): 0.25 GiB measured for the imports on the 2-core CI machine (2026-11-22)."""


@dataclass(frozen=True)
class Device:
    """One accelerator kind: memory in GiB, dense fp16/bf16 peak TFLOP/s, whether it has bf16."""

    name: str
    memory_gib: float
    peak_tflops: float
    bf16: bool = True
    cpu: bool = False


DEVICES = {
    "v100-32gb": Device("V100-SXM2-32GB", 32, PEAK_TFLOPS["V100"], bf16=False),
    "a100-40gb": Device("A100-SXM4-40GB", 40, PEAK_TFLOPS["A100"]),
    "a100-80gb": Device("A100-SXM4-80GB", 80, PEAK_TFLOPS["A100"]),
    "h100-80gb": Device("H100-SXM5-80GB", 80, PEAK_TFLOPS["H100"]),
    "h200-141gb": Device("H200-SXM-141GB", 141, PEAK_TFLOPS["H200"]),
}
"""Datasheet memory and dense fp16/bf16 peaks (the peaks of :mod:`megaformer.training.flops`)."""
RECIPE_DEVICES = ("v100-32gb", "a100-40gb", "a100-80gb")


def cpu_device(processes_per_node: int) -> Device:
    """This machine's RAM shared by ``processes_per_node`` processes; peak = a measured fp32 matmul rate."""
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return Device(
        "CPU", total_kib * 1024 / GIB / processes_per_node, measure_cpu_peak_flops() / 1e12, cpu=True
    )


# --- parameters ------------------------------------------------------------------------------------


def layer_param_counts(m: ModelConfig, tp: int) -> list[int]:
    """Parameters of each entry of the layer plan on ONE TP rank (what DeepSpeed's 'parameters'
    partitioning weighs): embedding, ``num_layers`` blocks, final norm, output (the tied embedding
    again, or the untied projection). Sharded tensors count ``1/tp``; replicated ones whole."""
    d, f, heads = m.hidden_size, m.ffn_size, m.num_attention_heads
    v = m.padded_vocab_size(tp)
    embed = v * d // tp + (m.seq_len * d if m.position_embedding == "learned" else 0)
    sharded = 3 * d * d + 3 * d + d * d + d * f + f + f * d  # qkv (+bias), W_O, fc1 (+bias), fc2
    head_scale_sharded = m.head_scale and m.head_scale_position == "before_out_proj"
    sharded += (heads if head_scale_sharded else 0) + (2 * f if m.ffn_ln else 0) + (6 * d if m.qkv_ln else 0)
    replicated = 2 * d + 2 * d + d + d  # LN1, LN2, W_O bias, fc2 bias
    replicated += (2 * d if m.post_attn_ln else 0) + (d if m.resid_scale else 0)
    replicated += heads if m.head_scale and not head_scale_sharded else 0  # γ after W_O (fairseq)
    block = sharded // tp + replicated
    final = 2 * d if m.norm_scheme == "pre_ln" else 0
    output = v * d // tp
    return [embed] + [block] * m.num_layers + [final, output]


def stage_bounds(counts: list[int], pp: int, method: str = "parameters") -> list[tuple[int, int]]:
    """``[start, end)`` of each pipeline stage's layers, as DeepSpeed's PipelineModule partitions."""
    if pp == 1:
        return [(0, len(counts))]
    from deepspeed.runtime import utils as ds_utils

    if method == "parameters":
        parts = ds_utils.partition_balanced(weights=counts, num_parts=pp)
    elif method == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(counts), num_parts=pp)
    else:  # type:NormFormerBlock: balance the blocks
        weights = [0] + [1] * (len(counts) - 3) + [0, 0]
        parts = ds_utils.partition_balanced(weights=weights, num_parts=pp)
    return [(parts[i], parts[i + 1]) for i in range(pp)]


def model_state_bytes(
    params: int, precision: str, zero: int, dp: int, cpu: bool = False, immediate_grad_update: bool = False
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on one rank holding ``params`` parameters (see
    the module docstring for DeepSpeed 0.19's buffers per precision and ZeRO stage; the reduction
    buckets are :func:`_ipg_bytes`, added by :func:`make_plan`). ``immediate_grad_update``: bf16
    with ZeRO ≤ 1 keeps no bf16 gradients (:func:`immediate_grad_update`)."""
    shard = dp if zero >= 1 else 1
    if precision == "fp32":
        weights, grads = 4.0 * params, 4.0 * params
        optim = 8.0 * params / shard + (8.0 * params / dp if zero >= 1 else 0.0)
        if cpu:  # the unfused AdamW step's full-size temporary (sqrt of v); CUDA's fused step has none
            optim += 4.0 * params / shard
    elif precision == "bf16" and zero <= 1:  # BF16_Optimizer: bf16 .grad 2Ψ + fp32 accumulation 4Ψ
        weights, grads, optim = 2.0 * params, 6.0 * params, 12.0 * params / shard
        if immediate_grad_update:  # each bf16 gradient is freed once added to the fp32 buffer
            grads = 4.0 * params
    elif precision == "bf16":  # ZeRO-2/3: the fp32 gradient partition, beside the buckets below
        weights, grads, optim = 2.0 * params, 4.0 * params, 12.0 * params / shard
    else:  # fp16
        weights, grads, optim = 2.0 * params, 2.0 * params, 16.0 * params / shard
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights, grads, optim


# --- activations -----------------------------------------------------------------------------------


def block_activation_bytes(cfg: RunConfig, device: Device, recompute: str | None = None) -> float:
    """Bytes one block keeps for backward per micro-batch on one rank (module docstring)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    recompute = recompute or t.recompute_mode
    tp, b, s, d, f = par.tp_size, t.micro_batch_size, m.seq_len, m.hidden_size, m.ffn_size
    sp = par.sequence_parallel and tp > 1
    q = 4 if (device.cpu or t.precision == "fp32") else 2
    tokens = b * s
    rep_div = tp if sp else 1
    if recompute == "full":
        partitioned = tp > 1  # block inputs partitioned across TP (or sequence-sliced)
        return tokens * q * d / (tp if partitioned else 1)
    replicated = d * (2 + int(m.post_attn_ln) + int(m.resid_scale))  # LN1, LN2, POSTATTN_LN, ResScale
    # HeadScale after W_O (fairseq) saves W_O's d-wide output, sequence-sliced like the residual.
    head_scale_after = m.head_scale and m.head_scale_position == "after_out_proj"
    replicated += d if head_scale_after else 0
    masks = 2 * d if m.hidden_dropout > 0 else 0  # bytes, 1 per element
    gathered = 2 * d  # inputs of qkv and fc1
    core_out = 0 if recompute == "selective" else d
    sharded = (
        3 * d + core_out + d + (d if m.head_scale and not head_scale_after else 0) + f * (2 + int(m.ffn_ln))
    )
    sharded += 3 * d if m.qkv_ln else 0  # the q/k/v LayerNorms' inputs
    per_token = q * (replicated / rep_div + gathered + sharded / tp) + masks / rep_div
    scores = 0.0
    if device.cpu and m.attention_dropout > 0 and recompute != "selective":
        scores = 12.0 * b * (m.num_attention_heads // tp) * s * s  # math kernel: fp32 [B, h, T, T] × 3
    return tokens * per_token + scores


def logits_bytes(cfg: RunConfig, device: Device) -> float:
    """Peak bytes of the output logits, softmax and their gradient on the last stage, at the
    decoded positions (all, or the masked LM's masked ones:
    :func:`~megaformer.training.flops.decoded_share`)."""
    m, t = cfg.model, cfg.train
    per_token = m.padded_vocab_size(cfg.parallel.tp_size) / cfg.parallel.tp_size
    # fp32: the logits buffer (reused in place as softmax and gradient) plus a padding-masked copy
    # or the backward's temporaries; bf16 / fp16: logits 2 + transient fp32 softmax 4 + gradient 2.
    return t.micro_batch_size * m.seq_len * decoded_share(m) * per_token * 8.0


# --- the plan --------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    """Predicted bytes on one rank of one pipeline stage."""

    stage: int
    layers: tuple[int, int]
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.buffers


@dataclass
class Plan:
    """The planner's answer for one config on one cluster."""

    cfg: RunConfig
    device: Device
    world: int
    dp: int
    gas: int
    stages: list[StagePlan]
    flops_per_step: float
    mfu: float

    @property
    def peak(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak <= HEADROOM * self.device.memory_gib * GIB

    @property
    def step_time_s(self) -> float:
        """Model FLOPs per step over the cluster's peak × MFU (recomputation is part of the MFU)."""
        return self.flops_per_step / (self.world * self.device.peak_tflops * 1e12 * self.mfu)

    @property
    def device_hours(self) -> float:
        return self.cfg.train.steps * self.step_time_s * self.world / 3600


def make_plan(cfg: RunConfig, device: Device, world: int, mfu: float = 0.4) -> Plan:
    """Predict memory per stage, FLOPs and time of ``cfg`` on ``world`` devices of kind ``device``.

    Raises:
        ConfigError: ``world`` not a multiple of tp × pp, or a batch that does not split over dp.
    """
    m, par, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = par.tp_size, par.pp_size
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not a multiple of tp_size × pp_size = {tp * pp}")
    dp = world // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} does not split into micro-batches of "
            f"{t.micro_batch_size} over dp={dp}; change the micro-batch or the world size"
        )
    gas = t.global_batch_size // (t.micro_batch_size * dp)
    counts = layer_param_counts(m, tp)
    if pp == 1 and m.tie_embeddings:
        counts[-1] = 0  # one module: the tied output projection is the embedding itself
    block_bytes = block_activation_bytes(cfg, device)
    one_block = block_activation_bytes(cfg, device, recompute="none")
    stages = []
    for stage, (lo, hi) in enumerate(stage_bounds(counts, pp, par.partition_method)):
        params = sum(counts[lo:hi])
        precision = t.precision if not device.cpu else "fp32"
        buckets = 0.0 if device.cpu else _ipg_bytes(cfg, params)
        weights, grads, optim = model_state_bytes(
            params, precision, t.zero_stage, dp, device.cpu, immediate_grad_update(cfg)
        )
        grads += buckets
        blocks = sum(1 for i in range(lo, hi) if 1 <= i <= m.num_layers)
        in_flight = min(pp - stage, gas)
        acts = in_flight * blocks * block_bytes
        acts += one_block  # the backward's working set: one block (recomputed, under full recompute)
        acts += in_flight * t.micro_batch_size * m.seq_len * m.hidden_size * 4  # embedding / stage I/O
        logits = logits_bytes(cfg, device) if hi == len(counts) else 0.0
        buffers = CPU_PROCESS_BASE_GIB * GIB + _bucket_bytes(cfg) if device.cpu else 2.0 * GIB
        stages.append(StagePlan(stage, (lo, hi), params, weights, grads, optim, acts, logits, buffers))
    flops = model_flops_per_token(m, m.padded_vocab_size(tp)) * t.global_batch_size * m.seq_len
    return Plan(cfg, device, world, dp, gas, stages, flops, mfu)


def engine_json(cfg: RunConfig) -> dict:
    """``train.deepspeed_config`` read and checked once by
    :func:`megaformer.training.deepspeed_config.read_engine_json` ({} without one).

    Raises:
        ConfigError: unreadable JSON or a key the YAML owns (named)."""
    return read_engine_json(cfg.train.deepspeed_config) if cfg.train.deepspeed_config else {}


def immediate_grad_update(cfg: RunConfig) -> bool:
    """Whether ``train.deepspeed_config`` sets ``bf16.immediate_grad_update`` for a bf16 run.

    With it, DeepSpeed 0.19's ``BF16_Optimizer`` (bf16 with ZeRO ≤ 1 and fp32 gradient
    accumulation) adds each parameter's bf16 gradient into its fp32 accumulation buffer from a
    post-accumulate-grad hook as soon as backward produces it, and drops the bf16 gradient
    (``accumulate_hp_grads_and_remove_lp``, deepspeed/runtime/bf16_optimizer.py): the 2Ψ bytes of
    bf16 ``.grad`` are no longer held (one parameter's at a time, transiently), and the separate
    accumulation pass after each micro-batch's backward (``update_hp_grads``) becomes a no-op. The
    arithmetic is the same (fp32 += bf16 gradient per micro-batch; shown bitwise equal on CPU by
    ``tests/distributed/test_bf16_optimizers.py``)."""
    if cfg.train.precision != "bf16":
        return False
    return bool(engine_json(cfg).get("bf16", {}).get("immediate_grad_update", False))


def _bucket_bytes(cfg: RunConfig) -> float:
    """DeepSpeed's ZeRO gradient-reduction bucket (fp32 on CPU): ``reduce_bucket_size`` elements
    from ``train.deepspeed_config`` (DeepSpeed's default 5e8 without one); 0 without ZeRO."""
    if cfg.train.zero_stage == 0:
        return 0.0
    return 4.0 * engine_json(cfg).get("zero_optimization", {}).get("reduce_bucket_size", 5e8)


def _ipg_bytes(cfg: RunConfig, params: int = 0) -> float:
    """DeepSpeed 0.19's ZeRO-2/3 gradient-reduction buckets on a GPU (``ipg_buckets`` in
    stage_1_and_2.py): ``reduce_bucket_size`` elements in the training precision, two of them
    with ``overlap_comm`` (double buffering; DeepSpeed's default for ZeRO-2 is off, the shipped
    JSONs turn it on). ZeRO-1 under the pipeline engine allocates one (``reduce_gradients(
    pipeline_parallel=True)``, "with PP we must create ipg buffer"); plain ZeRO-1 and no ZeRO none.
    bf16 under the pipeline engine is DeepSpeed's BF16 optimizer, whose data-parallel all-reduce
    (``DeepSpeedEngine.allreduce_bucket``, engine.py) flattens up to 5e8 of the stage's ``params``
    gradients into a bf16 buffer and an fp32 copy for the reduction (6 bytes each) at the step."""
    stage, pipelined = cfg.train.zero_stage, cfg.parallel.pp_size > 1
    if pipelined and cfg.train.precision == "bf16" and stage <= 1:
        return min(float(params), 5e8) * 6.0
    if stage == 0 or (stage == 1 and not pipelined):
        return 0.0
    zero = engine_json(cfg).get("zero_optimization", {})
    size = float(zero.get("reduce_bucket_size", 5e8))
    per = 4.0 if cfg.train.precision == "fp32" else 2.0
    if stage == 1:
        return size * per if zero.get("contiguous_gradients", True) else 0.0
    return size * per * (2 if zero.get("overlap_comm", False) else 1)


def with_train(cfg: RunConfig, **train) -> RunConfig:
    """``cfg`` with ``train`` keys replaced (``tp_size``, ``pp_size``, ``sequence_parallel`` go to
    ``parallel``): a layout or precision to try."""
    par = {k: train.pop(k) for k in ("tp_size", "pp_size", "sequence_parallel") if k in train}
    return replace(cfg, train=replace(cfg.train, **train), parallel=replace(cfg.parallel, **par))


def suggest_layout(cfg: RunConfig, device: Device, world: int, gpus_per_node: int) -> Plan | None:
    """The fitting layout with the fewest model-parallel ranks, then the least recomputation, then
    ``cfg``'s own ZeRO stage (a recipe's choice, e.g. ZeRO-2 for its overlapped reduction, is kept
    where it fits), then the lower stage, then the largest micro-batch: tp ∈ {1, 2, 4, 8} within a
    node (heads and FFN divisible), pp dividing the layers, ZeRO 1 (2 without a pipeline), recompute
    none / selective / full. None if nothing fits."""
    m, t = cfg.model, cfg.train
    precision = t.precision if device.bf16 or t.precision != "bf16" else "fp16"
    options = []
    for tp in (1, 2, 4, 8):
        if tp > gpus_per_node or m.num_attention_heads % tp or world % tp:
            continue
        for pp in (1, 2, 4, 8):
            if m.num_layers % pp or world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for zero in (1, 2) if pp == 1 else (1,):
                for rank, recompute in enumerate(("none", "selective", "full")):
                    for micro in (16, 8, 4, 2, 1):
                        if t.global_batch_size % (micro * dp):
                            continue
                        trial = with_train(
                            cfg,
                            tp_size=tp,
                            pp_size=pp,
                            sequence_parallel=tp > 1,
                            zero_stage=zero,
                            recompute=recompute,
                            activation_checkpointing=False,
                            micro_batch_size=micro,
                            precision=precision,
                        )
                        plan = make_plan(trial, device, world)
                        if plan.fits:
                            options.append(((tp * pp, rank, zero != t.zero_stage, zero, -micro), plan))
                            break
    return min(options, key=lambda o: o[0])[1] if options else None


HEADER_LAYOUTS = {"v100-32gb": "V100 overrides", "a100-40gb": "A100 40GB"}
"""The header lines of a recipe (``configs/paper/*.yaml``) that name its layout for another device:
``# V100 overrides: k=v ...`` and ``# A100 40GB: add k=v ... (planner: ...)``."""


def header_layout(path: str, device_key: str) -> list[str] | None:
    """The overrides a recipe's header names for ``device_key`` (:data:`HEADER_LAYOUTS`), or None
    (no such line; not a recipe file)."""
    label = HEADER_LAYOUTS.get(device_key)
    if label is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            head, _, rest = line[1:].strip().partition(":")
            if head.strip() == label:
                words = rest.split("(")[0].split()
                return [w for w in words if "=" in w and "." in w.split("=")[0]] or None
    return None


def recipe_layout(
    path: str, overrides: list[str], device_key: str, world: int, gpus_per_node: int
) -> tuple[str, Plan | None, Plan | None]:
    """What to run ``path`` (with ``overrides``) on ``world`` devices ``device_key`` where its own
    layout does not fit: ``(how, header plan, planner's plan)``. The recipe header's layout for that
    device (:func:`header_layout`) is preferred where it fits (``how`` = ``header``); else the
    planner's search (:func:`suggest_layout`; ``how`` = ``planner``, or ``none`` if nothing fits).
    Both plans are returned, so the caller can say where they differ."""
    dev = DEVICES[device_key]
    cfg = load_config(path, overrides)
    base = cfg if dev.bf16 or cfg.train.precision != "bf16" else with_train(cfg, precision="fp16")
    found = suggest_layout(base, dev, world, gpus_per_node)
    extra = header_layout(path, device_key)
    header = None
    if extra:
        try:
            trial = load_config(path, list(overrides) + extra)
            header = make_plan(trial, dev, world)
        except ConfigError:
            header = None
    if header is not None and header.fits:
        return "header", header, found
    return ("planner" if found else "none"), header, found


def _gib(x: float) -> str:
    return f"{x / GIB:7.2f}"


def describe(plan: Plan, assumed_mfu: bool = True) -> str:
    """The plan as the table the command prints; ``assumed_mfu``: with the step time and
    device-hours at the plan's stated MFU (``plan --predict`` prints the step-time model's instead)."""
    cfg, t, par = plan.cfg, plan.cfg.train, plan.cfg.parallel
    lines = [
        f"{plan.device.name}: {plan.device.memory_gib:.0f} GiB per "
        f"{'process' if plan.device.cpu else 'device'}, world {plan.world} = tp {par.tp_size} × pp "
        f"{par.pp_size} × dp {plan.dp}; {t.precision if not plan.device.cpu else 'fp32'}, ZeRO "
        f"{t.zero_stage}, recompute {t.recompute_mode}, sequence parallel "
        f"{par.sequence_parallel and par.tp_size > 1}, micro-batch {t.micro_batch_size} × {plan.gas} "
        f"accumulation steps, seq_len {cfg.model.seq_len}",
        "stage  layers    params(M)  weights    grads    optim  activ.   logits  buffers    TOTAL GiB",
    ]
    for s in plan.stages:
        lines.append(
            f"{s.stage:5d}  [{s.layers[0]:3d},{s.layers[1]:3d})  {s.params / 1e6:9.1f}"
            + "".join(_gib(v) + "  " for v in (s.weights, s.grads, s.optimizer, s.activations, s.logits))
            + _gib(s.buffers)
            + "  "
            + _gib(s.total)
        )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"peak {plan.peak / GIB:.2f} GiB of {plan.device.memory_gib:.0f}: {verdict} "
        f"(limit {HEADROOM:.0%} of the memory for fragmentation)"
    )
    if not assumed_mfu:
        lines.append(f"model FLOPs per step {plan.flops_per_step:.3e}")
        return "\n".join(lines)
    lines.append(
        f"model FLOPs per step {plan.flops_per_step:.3e}; at an assumed MFU of {plan.mfu:.0%} of "
        f"{plan.device.peak_tflops:.4g} TFLOP/s per device: step {plan.step_time_s:.2f} s, "
        f"{t.steps:,} steps = {plan.device_hours:,.4g} device-hours "
        f"({plan.device_hours / plan.world:,.1f} h wall; --predict for the step-time model's figure)"
    )
    return "\n".join(lines)


def layout_overrides(plan: Plan) -> str:
    """The overrides that select ``plan``'s layout, for the launcher's command line."""
    p, t = plan.cfg.parallel, plan.cfg.train
    return (
        f"parallel.tp_size={p.tp_size} parallel.pp_size={p.pp_size} "
        f"parallel.sequence_parallel={str(p.sequence_parallel).lower()} train.zero_stage={t.zero_stage} "
        f"train.precision={t.precision} train.micro_batch_size={t.micro_batch_size} "
        f"train.recompute={t.recompute_mode} (peak {plan.peak / GIB:.1f} GiB)"
    )


__all__ = [
    "DEVICES",
    "Device",
    "Plan",
    "StagePlan",
    "block_activation_bytes",
    "engine_json",
    "immediate_grad_update",
    "layer_param_counts",
    "make_plan",
    "model_state_bytes",
    "suggest_layout",
]
