"""One transformer block's operations counted from a fake-CUDA trace, for the step-time model.

:func:`trace_block` runs ONE :class:`~megaformer.model.NormFormerBlock` of a run config (its
normalisation scheme and switches, hidden / FFN sizes, heads, dropout, activation, objective) forward
and backward for one micro-batch (``b = train.micro_batch_size`` sequences of ``s = model.seq_len``
tokens) on fake CUDA (``../shared/docs/FACTS-FAKE-CUDA.md``), in the run's 16-bit precision (the
module cast as DeepSpeed's bf16 / fp16 engines cast it) or fp32, at the config's TP size on torch's
fake process group (rank 0 of ``tp``; sequence parallelism as configured), with the run's
recomputation: ``full`` through the trainer's own checkpoint function
(:func:`megaformer.pipeline.checkpointed` over DeepSpeed's ``checkpointing.checkpoint``, configured as
:func:`megaformer.training.builders.build_model` does), ``selective`` through the block's own
recomputed attention core. A :class:`~torch.utils._python_dispatch.TorchDispatchMode` records every
aten / c10d op with its input and output shapes and dtypes, and :func:`classify` sorts each into:

``gemm``
    ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` (what ``F.linear`` and its backward lower to on CUDA),
    as ``(M, K, N)`` with any batch folded into ``M``; FLOPs ``2·M·K·N``.
``attention``
    the fused SDPA kernels (flash / memory-efficient / cuDNN, forward and backward). FLOPs in the
    convention of :mod:`megaformer.perf.steptime` and :mod:`megaformer.training.flops`: a forward
    ``4·B·H·Sq·Sk·D`` (QKᵀ and PV, the causal mask not halved), a backward twice that (FlashAttention-2
    does 2.5× with its recomputed QKᵀ; the device's ``attention_fraction`` is calibrated on the 2×
    count, Dao 2023, arXiv:2307.08691, Sec. 4.1).
``collective``
    ``c10d`` / ``_c10d_functional`` all-reduce, all-gather, reduce-scatter, as ``(kind, bytes)`` with
    the bytes of the full buffer (the all-reduced tensor, the gathered output, the reduce-scattered
    input): the ``nbytes`` of :func:`megaformer.perf.steptime.collective_time`.
``view``
    no data moved: an op whose schema returns an alias of an input (``view``, ``t``, ``transpose``,
    ``expand``, ``as_strided``, ``detach``, ``alias``, ``slice``, ``unbind``, ...; ``alias_info`` of
    the returns), an op tagged ``inplace_view``, an op whose output shares an input's storage
    (``_unsafe_view`` of a contiguous tensor: no alias annotation), allocations (``empty*``), and
    ops without a tensor output (``prim.device``, ``sym_size``).
``memory``
    every other op on device tensors: the bytes of its distinct tensor inputs plus its outputs, each
    tensor's bytes counted over the elements it addresses (a broadcast / expanded input once); an op
    that only writes its ``self`` (``copy_``, ``fill_``, ``zero_``, random fills) does not read it.

The trace runs in its own process (the shim must be preloaded before torch:
:mod:`megaformer.perf.fakecuda.launch`), about 4–8 s with torch's import (DeepSpeed's too under full
recompute); traces are cached in-process per (block shape, layout, precision): :func:`trace_key`.

:func:`block_costs` turns a trace into the tuple :func:`megaformer.perf.costs.formula_block_costs`
returns, with that module's ``_gemm``, ``collective_time``, ``_link`` and the device's rates;
:func:`formula_counts` reads the formula's own counts (FLOPs, bytes) off ``formula_block_costs`` with unit
devices, for the comparison in ``bench/steptime_trace.py``.

The trace is of EAGER kernels; on a GPU megaformer compiles each block (``train.compile``,
:mod:`megaformer.model.compile`). :func:`fuse` estimates the compiled block's memory-bound traffic
from the trace (its rules and sources there: an estimate of inductor's fusion, an upper bound on
what fusion saves, not a trace of compiled kernels: inductor cannot generate Triton kernels on fake
CUDA), and ``block_costs(..., compiled=True)`` uses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from megaformer.config.schema import ModelConfig
from megaformer.perf.costs import (
    collective_time,
    formula_block_costs,
    gemm_seconds,
    link,
    ring_allreduce_bytes,
    ring_gather_bytes,
)
from megaformer.perf.devices import DeviceSpec
from megaformer.perf.fakecuda.build import ShimUnavailableError, build_shim
from megaformer.perf.fakecuda.launch import ROOT, fake_cuda_env

GEMM_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")
"""Name prefixes (``str(OpOverload)``) of the matmul ops ``F.linear`` / ``matmul`` lower to."""

ATTENTION_MARKS = ("scaled_dot_product_", "_flash_attention_", "_efficient_attention_")
"""Substrings of the fused attention kernels' op names (SDPA flash / efficient / cuDNN and their
inner ``_flash_attention_forward`` style ops); the composite ``scaled_dot_product_attention`` itself
never reaches the dispatch mode (it is decomposed into one of these)."""

WRITE_ONLY = ("copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_", "exponential_")
"""In-place ops (by overload packet name) that write ``self`` without reading it."""

ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_")
"""Ops that allocate without touching data (their schemas do not say so: listed by name)."""


@dataclass(frozen=True)
class TraceKey:
    """What a block trace depends on: the model config (as sorted ``(field, value)`` pairs), the
    micro-batch size, the TP size, effective sequence parallelism, the recompute mode, the dtype
    (``bf16`` / ``fp16`` / ``fp32``) and the fake GPU (``v100-32gb``: memory-efficient attention;
    others: flash for 16-bit dtypes)."""

    model: tuple[tuple[str, Any], ...]
    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    recompute: str
    dtype: str
    gpu: str

    def as_json(self) -> dict:
        return {**asdict(self), "model": dict(self.model)}

    @classmethod
    def from_json(cls, data: dict) -> TraceKey:
        return cls(**{**data, "model": tuple(sorted(data["model"].items()))})


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op: ``name`` (``aten.mm.default``), ``phase`` (``forward`` / ``backward``;
    ``recompute`` for a full recompute's rerun of the block), ``kind`` (module docstring), the
    ``(shape, dtype)`` of its tensor inputs and outputs, and what it counts for: ``nbytes``
    (``memory``: bytes read + written; ``collective``: the buffer's bytes), ``flops`` (``gemm``,
    ``attention``), ``mkn`` (``gemm``), ``detail`` (collective kind; ``causal`` for attention).

    ``reads`` / ``writes`` (ops other than ``view``): the tensors it reads and writes as
    ``(tensor id, storage offset, bytes)``: the id is the storage (views resolved to their base) at
    one version (an in-place write makes a new id), the bytes those the view addresses
    (:func:`_touched_bytes`). What :func:`fuse` follows through the block."""

    name: str
    phase: str
    kind: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    nbytes: int = 0
    flops: float = 0.0
    mkn: tuple[int, int, int] | None = None
    detail: str = ""
    reads: tuple[tuple[int, int, int], ...] = ()
    writes: tuple[tuple[int, int, int], ...] = ()


@dataclass
class BlockTrace:
    """One block, one micro-batch, one rank: the ops of forward + backward (+ recomputation) and
    their totals. FLOPs and bytes per micro-batch; ``act_bytes`` = ``b·s·d·q`` (the TP / p2p message
    of :func:`~megaformer.perf.costs.formula_block_costs`); ``seconds``: wall time of the traced run
    (not of the process)."""

    key: TraceKey
    ops: list[OpRecord] = field(default_factory=list)
    act_bytes: int = 0
    seconds: float = 0.0

    def of_kind(self, kind: str) -> list[OpRecord]:
        return [op for op in self.ops if op.kind == kind]

    @property
    def gemms(self) -> list[tuple[int, int, int]]:
        """``(M, K, N)`` of every GEMM, in trace order."""
        return [op.mkn for op in self.of_kind("gemm")]

    @property
    def gemm_flops(self) -> float:
        return sum(op.flops for op in self.of_kind("gemm"))

    @property
    def attention_flops(self) -> float:
        return sum(op.flops for op in self.of_kind("attention"))

    @property
    def attention_causal(self) -> bool:
        return all(op.detail == "causal" for op in self.of_kind("attention"))

    @property
    def memory_bytes(self) -> int:
        return sum(op.nbytes for op in self.of_kind("memory"))

    @property
    def collectives(self) -> list[tuple[str, int]]:
        """``(kind, bytes)``: kind ``allreduce`` / ``allgather`` / ``reduce_scatter`` / other."""
        return [(op.detail, op.nbytes) for op in self.of_kind("collective")]

    def tp_wire_bytes(self) -> float:
        """Bytes each rank sends in the ring algorithm for all the block's collectives:
        ``2(n−1)/n·B`` per all-reduce, ``(n−1)/n·B`` per all-gather / reduce-scatter, ``n = tp``."""
        n = self.key.tp
        return sum(
            ring_allreduce_bytes(b, n) if kind == "allreduce" else ring_gather_bytes(b, n)
            for kind, b in self.collectives
        )

    def to_json(self) -> dict:
        return {
            "key": self.key.as_json(),
            "ops": [asdict(op) for op in self.ops],
            "act_bytes": self.act_bytes,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: dict) -> BlockTrace:
        def tup(x: Any) -> Any:
            return tuple(tup(v) for v in x) if isinstance(x, list) else x

        ops = [OpRecord(**{k: tup(v) for k, v in op.items()}) for op in data["ops"]]
        return cls(TraceKey.from_json(data["key"]), ops, data["act_bytes"], data["seconds"])


# --- the key and the cache ---------------------------------------------------------------------------


def trace_dtype(cfg: Any, q: int | None = None) -> str:
    """The dtype a block of ``cfg`` runs in: ``fp32`` when ``q == 4`` (bytes per element) or the
    precision is fp32, else the config's ``bf16`` / ``fp16``."""
    precision = cfg.train.precision
    if q == 4 or precision == "fp32":
        return "fp32"
    return "fp16" if precision == "fp16" else "bf16"


def trace_key(cfg: Any, q: int | None = None, gpu: str = "h100-80gb") -> TraceKey:
    """The cache key of ``cfg``'s block trace (:class:`TraceKey`) at ``q`` bytes per element."""
    par = cfg.parallel
    model = tuple(sorted((f.name, getattr(cfg.model, f.name)) for f in fields(cfg.model)))
    return TraceKey(
        model=model,
        micro_batch_size=cfg.train.micro_batch_size,
        tp=par.tp_size,
        sequence_parallel=bool(par.sequence_parallel and par.tp_size > 1),
        recompute=cfg.train.recompute_mode,
        dtype=trace_dtype(cfg, q),
        gpu=gpu,
    )


def gpu_for(dev: Any) -> str:
    """The fake GPU whose attention kernel a :class:`~megaformer.perf.devices.DeviceSpec` runs:
    ``v100-32gb`` (memory-efficient kernel) for a V100, else ``h100-80gb`` (flash for 16-bit)."""
    return "v100-32gb" if "V100" in dev.name.upper() else "h100-80gb"


def available() -> bool:
    """Whether a trace can be taken here: the shim builds (a C++ compiler and torch's headers; cached
    after the first build, about 2 s). Where it cannot, use the formula
    (:func:`megaformer.perf.costs.formula_block_costs`)."""

    try:
        build_shim()
    except ShimUnavailableError:
        return False
    return True


def trace_block(cfg: Any, q: int | None = None, gpu: str = "h100-80gb") -> BlockTrace:
    """The trace of one block of ``cfg`` (module docstring), cached per :func:`trace_key`.

    Raises:
        megaformer.perf.fakecuda.build.ShimUnavailableError: no fake CUDA here (no compiler / headers).
        RuntimeError: the traced run failed (the child's error and output in the message).
    """
    return _trace_cached(trace_key(cfg, q, gpu))


def trace_blocks(cfgs: list[Any], q: int | None = None, gpu: str = "h100-80gb") -> list[BlockTrace]:
    """:func:`trace_block` of several configs, the uncached ones in one child process per TP size
    (a process holds one fake process group): a table's worth at one torch import each."""
    keys = [trace_key(c, q, gpu) for c in cfgs]
    missing = [k for k in dict.fromkeys(keys) if k not in _CACHE]
    for tp in sorted({k.tp for k in missing}):
        for key, trace in zip(group := [k for k in missing if k.tp == tp], _run_child(group)):
            _CACHE[key] = trace
    return [_trace_cached(k) for k in keys]


_CACHE: dict[TraceKey, BlockTrace] = {}


def _trace_cached(key: TraceKey) -> BlockTrace:
    if key not in _CACHE:
        _CACHE[key] = _run_child([key])[0]
    return _CACHE[key]


def _run_child(keys: list[TraceKey]) -> list[BlockTrace]:
    """Trace ``keys`` (one TP size) in a fake-CUDA child process (:func:`main`)."""

    with tempfile.TemporaryDirectory(prefix="megaformer-optrace-") as tmp:
        request, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "traces.json")
        with open(request, "w") as f:
            json.dump([k.as_json() for k in keys], f)
        cmd = [sys.executable, "-m", "megaformer.perf.optrace", request, out]
        proc = subprocess.run(cmd, env=fake_cuda_env(), capture_output=True, text=True, cwd=ROOT, timeout=900)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"block trace failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
            )
        with open(out) as f:
            return [BlockTrace.from_json(t) for t in json.load(f)]


# --- classification ----------------------------------------------------------------------------------


def _touched_bytes(t: Any) -> int:
    """Bytes of the elements ``t`` addresses: dimensions of stride 0 (broadcast, ``expand``) once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _shape(t: Any) -> tuple[tuple[int, ...], str]:
    return tuple(int(x) for x in t.shape), str(t.dtype).removeprefix("torch.")


def _named_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``{argument name: value}`` of a call, by the op's schema."""
    named = {a.name: v for a, v in zip(func._schema.arguments, args)}
    named.update(kwargs)
    return named


def _is_view(func: Any, ins: list, outs: list) -> bool:
    """No data moved: aliasing returns (schema), ``inplace_view`` tag, output sharing an input's
    storage, an allocation, or no tensor output."""
    import torch

    schema = func._schema
    mutable = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if torch.Tag.inplace_view in func.tags:
        return True
    if not outs:
        return not mutable
    if func.overloadpacket.__name__ in ALLOCATIONS:
        return True
    if not mutable and any(r.alias_info is not None for r in schema.returns):
        return True
    if mutable:
        return False
    storages = {_storage_id(t) for t in ins}
    return all(_storage_id(t) in storages for t in outs)


def _storage_id(t: Any) -> int:
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return id(t)


def _gemm_mkn(name: str, ins: list) -> tuple[int, int, int]:
    """``(M, K, N)`` of a matmul op from its two matrix operands (batch folded into ``M``)."""
    a, b = (ins[1], ins[2]) if name.startswith(("aten.addmm.", "aten.baddbmm.")) else (ins[0], ins[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    return int(batch * a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])


def _attention(func: Any, args: tuple, kwargs: dict) -> tuple[float, str]:
    """(FLOPs, ``causal`` / ``full``) of a fused attention op (module docstring's convention)."""
    named = _named_args(func, args, kwargs)
    q, k, v = named["query"], named["key"], named["value"]
    b, h, sq, d = q.shape
    fwd = 2.0 * b * h * sq * k.shape[-2] * (d + v.shape[-1])
    backward = "backward" in str(func)
    return fwd * (2 if backward else 1), "causal" if named.get("is_causal") else "full"


def _collective(name: str, ins: list, outs: list) -> tuple[str, int]:
    op = name.split(".")[1]
    if "reduce_scatter" in op:
        kind = "reduce_scatter"
    elif "allreduce" in op or "all_reduce" in op:
        kind = "allreduce"
    elif "allgather" in op or "all_gather" in op:
        kind = "allgather"
    else:
        kind = op
    return kind, max((_touched_bytes(t) for t in ins + outs), default=0)


def classify(func: Any, args: tuple, kwargs: dict, out: Any, phase: str) -> OpRecord | None:
    """The :class:`OpRecord` of one dispatched op (module docstring), or None for an op without
    device tensors (host generator states, ``prim.device``)."""
    import torch
    from torch.utils._pytree import tree_flatten

    name = str(func)
    ins = list({id(a): a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}.values())
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not any(t.device.type == "cuda" for t in ins + outs):
        return None
    ins = [t for t in ins if t.device.type == "cuda"]
    rec = dict(name=name, phase=phase, inputs=tuple(map(_shape, ins)), outputs=tuple(map(_shape, outs)))
    if name.startswith(("c10d.", "_c10d_functional.")):
        if "wait_tensor" in name:
            return OpRecord(kind="view", **rec)
        kind, nbytes = _collective(name, ins, outs)
        return OpRecord(kind="collective", nbytes=nbytes, detail=kind, **rec)
    if name.startswith(GEMM_OPS):
        m, k, n = _gemm_mkn(name, ins)
        return OpRecord(kind="gemm", flops=2.0 * m * k * n, mkn=(m, k, n), **rec)
    if any(mark in name for mark in ATTENTION_MARKS):
        flops, causal = _attention(func, args, kwargs)
        return OpRecord(kind="attention", flops=flops, detail=causal, **rec)
    if _is_view(func, ins, outs):
        return OpRecord(kind="view", **rec)
    if func.overloadpacket.__name__ in WRITE_ONLY and ins:
        ins = ins[1:] if ins[0] is args[0] else ins
    nbytes = sum(_touched_bytes(t) for t in ins) + sum(_touched_bytes(t) for t in outs)
    return OpRecord(kind="memory", nbytes=nbytes, **rec)


# --- the traced run (in the fake-CUDA child) -----------------------------------------------------------


def _recorder() -> Any:
    """The run's :class:`~megaformer.perf.fakecuda.runtime.Audit` (host reads answered, the small integer
    tensors DeepSpeed's partitioned checkpoints read back kept, NCCL's device rule) that also
    appends an :class:`OpRecord` per op to ``.ops`` in phase ``.phase``."""
    # lazy: only the trace's fake-CUDA child uses it; the planner's process loads no fake runtime
    from megaformer.perf.fakecuda.runtime import Audit

    class Recorder(Audit):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[OpRecord] = []
            self.phase = "forward"

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = super().__torch_dispatch__(func, types, args, kwargs)
            rec = classify(func, args, kwargs, out, self.phase)
            if rec is not None:
                if rec.kind != "view":
                    rec = replace(rec, **self.ids.access(func, args, kwargs, out))
                self.ops.append(rec)
            return out

    recorder = Recorder()
    recorder.ids = _TensorIds()
    return recorder


class _TensorIds:
    """Tensor identity through a trace: one id per (storage, version). A storage's id changes when
    an op writes it in place (schema ``alias_info.is_write``); a new output storage gets a new id.
    The storages are kept alive for the trace (fake tensors: no memory), so that no address is
    reused for another tensor."""

    def __init__(self) -> None:
        self.current: dict[int, int] = {}  # storage address -> id of its current version
        self.alive: list[Any] = []
        self.next_id = 0

    def _key(self, t: Any) -> int:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.current:
            self.alive.append(storage)
            self._bump(key)
        return key

    def _bump(self, key: int) -> int:
        self.next_id += 1
        self.current[key] = self.next_id
        return self.next_id

    def _entry(self, t: Any) -> tuple[int, int, int]:
        return self.current[self._key(t)], int(t.storage_offset()), _touched_bytes(t)

    def access(self, func: Any, args: tuple, kwargs: dict, out: Any) -> dict[str, tuple]:
        """``{"reads": ..., "writes": ...}`` of one op (:class:`OpRecord`), the written storages'
        versions advanced."""
        import torch
        from torch.utils._pytree import tree_flatten

        def cuda(x: Any) -> list:
            return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.device.type == "cuda"]

        named = _named_args(func, args, kwargs)
        written = [
            t
            for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write
            for t in cuda(named.get(a.name))
        ]
        skip = {id(written[0])} if written and func.overloadpacket.__name__ in WRITE_ONLY else set()
        reads = list(dict.fromkeys(self._entry(t) for t in cuda((args, kwargs)) if id(t) not in skip))
        bumped = set()
        for t in written:
            key = self._key(t)
            if key not in bumped:
                bumped.add(key)
                self._bump(key)
        writes = [self._entry(t) for t in written] + [self._entry(t) for t in cuda(out)]
        return {"reads": tuple(reads), "writes": tuple(dict.fromkeys(writes))}


def _model_config(key: TraceKey) -> Any:

    return ModelConfig(**dict(key.model))


def _build_block(key: TraceKey, tp_group: Any, mpu: Any) -> tuple[Any, Any]:
    """The block (on fake CUDA, cast to the key's dtype, training mode) and the function that runs
    it as the trainer does: ``run(x) -> y`` (checkpointed under full recompute)."""
    import torch

    # lazy: only the trace's fake-CUDA child builds the block; the planner's process builds no model
    from megaformer.model.normformer import NormFormerBlock
    from megaformer.parallel.rng import DropoutRNG

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[key.dtype]
    rank = 0
    rng = DropoutRNG(1234, tp_rank=rank, device="cuda")  # its states on the host, as on a GPU
    with torch.device("cuda"):
        block = NormFormerBlock(
            _model_config(key),
            1,
            tp_group,
            seed=1234,
            sequence_parallel=key.sequence_parallel,
            dropout_rng=rng,
        )
    block = block.to(dtype).train()
    if key.recompute == "selective":
        block.recompute_core_attention = True
    if key.recompute != "full":
        return block, block
    # lazy: only the trace's fake-CUDA child uses it; the planner's process loads no fake runtime
    from megaformer.pipeline import checkpointed, configure_recompute

    configure_recompute(mpu, partition_activations=tp_group is not None and not key.sequence_parallel)
    ckpt = checkpointed(rng)
    return block, lambda x: ckpt(block, x)


def _trace_one(key: TraceKey, tp_group: Any, mpu: Any) -> BlockTrace:
    """Forward + backward of one block for one micro-batch under the recorder (in the child)."""
    import torch

    m = _model_config(key)
    block, run = _build_block(key, tp_group, mpu)
    dtype = next(block.parameters()).dtype
    local_s = m.seq_len // key.tp if key.sequence_parallel else m.seq_len
    x = torch.empty(
        key.micro_batch_size, local_s, m.hidden_size, device="cuda", dtype=dtype, requires_grad=True
    )
    grad = torch.empty_like(x)
    recorder = _recorder()

    def enter(module: Any, args: Any) -> None:  # a full recompute's rerun is phase "recompute"
        if recorder.phase == "backward":
            recorder.phase = "recompute"

    def leave(module: Any, args: Any, output: Any) -> None:
        if recorder.phase == "recompute":
            recorder.phase = "backward"

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave)
    t0 = time.perf_counter()
    with recorder:
        y = run(x)
        recorder.phase = "backward"
        y.backward(grad)
    q = torch.empty((), dtype=dtype).element_size()
    act = key.micro_batch_size * m.seq_len * m.hidden_size * q
    return BlockTrace(key, recorder.ops, act, time.perf_counter() - t0)


def _process_group(tp: int, deepspeed_comm: bool) -> tuple[Any, Any]:
    """``(tp_group, mpu)`` of rank 0 of a ``tp``-rank job on the fake process group (made once per
    process; ``(None, None)`` at tp 1), and DeepSpeed's communication backend over it when
    ``deepspeed_comm`` (its activation checkpointing asks ``deepspeed.comm`` for the rank)."""
    import torch.distributed as dist

    # lazy: only the trace's fake-CUDA child uses it; the planner's process loads no fake runtime
    from megaformer.parallel.state import ParallelState
    from megaformer.perf.fakecuda.runtime import init_fake_process_group

    if (tp > 1 or deepspeed_comm) and not dist.is_initialized():
        init_fake_process_group(0, tp)
    if deepspeed_comm:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False, verbose=False)
    if tp == 1:
        return None, None
    if not hasattr(_process_group, "state"):
        _process_group.state = ParallelState.build(tp, 1, 1)
    state = _process_group.state
    return state.tp_group, state.mpu()


def _child(keys: list[TraceKey]) -> list[BlockTrace]:
    """Trace ``keys`` (all one TP size) in this fake-CUDA process."""
    # lazy: only the trace's fake-CUDA child uses it; the planner's process loads no fake runtime
    from megaformer.perf.fakecuda.runtime import GPUS, check_shim_loaded, fake_mode, install_cuda_stubs

    check_shim_loaded()
    install_cuda_stubs(GPUS[keys[0].gpu])
    traces = []
    for key in keys:
        if key.gpu != keys[0].gpu:
            install_cuda_stubs(GPUS[key.gpu])
        tp_group, mpu = _process_group(key.tp, key.recompute == "full")
        with fake_mode():
            traces.append(_trace_one(key, tp_group, mpu))
    return traces


def main(argv: list[str] | None = None) -> int:
    """``python -m megaformer.perf.optrace REQUEST.json OUT.json`` (shim preloaded): trace the
    :class:`TraceKey` s of the request (one TP size) and write the traces."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        keys = [TraceKey.from_json(k) for k in json.load(f)]
    traces = _child(keys)
    with open(argv[1], "w") as f:
        json.dump([t.to_json() for t in traces], f)
    sys.stdout.flush()
    os._exit(0)  # the fake process group and DeepSpeed's threads: no clean teardown to wait for


# --- the compiled block: inductor's fusion, estimated from the eager trace ----------------------------

CONCAT_OPS = ("aten.cat.", "aten.stack.")
"""Concatenations (``str(OpOverload)`` prefixes): a kernel of their own when their inputs are
realized buffers (:func:`_nodes`)."""

DROPOUT_KEEP_PASSES = 3
"""HBM passes over a ``q``-byte tensor of the mask kernel of
:func:`megaformer.parallel.rng_ops.dropout_keep` on CUDA (eager kernels inside an opaque operator):
``fill_(1)`` writes one, ``native_dropout`` reads it and writes its output (discarded), plus the
``bool`` mask (1 byte an element). The mask does not depend on the filled values (Philox draws per
element, ``fused_dropout_kernel_vec``), so the ``fill_`` is a pass that could go."""


@dataclass(frozen=True)
class Region:
    """One fused kernel of the estimate: ``phase``, the eager ops it fuses (names), the bytes it reads
    of tensors made outside it and the bytes it writes of tensors used outside it."""

    phase: str
    ops: tuple[str, ...]
    read_bytes: int
    write_bytes: int

    @property
    def nbytes(self) -> int:
        return self.read_bytes + self.write_bytes


@dataclass
class FusedBlock:
    """:func:`fuse` of a trace: the fused ``regions``; ``extern_bytes``, the HBM bytes of the eager
    kernels inside megaformer's opaque operators (dropout masks, attention's layout copies), which
    inductor does not fuse; ``extra_attention_flops``, the attention forward the compiled GPU
    attention dropout reruns in backward. Bytes and FLOPs per micro-batch, one block, one rank."""

    regions: list[Region]
    extern_bytes: int = 0
    extra_attention_flops: float = 0.0
    copy_bytes: int = 0
    """The part of ``extern_bytes`` that ATen's generic (non-vectorised) elementwise kernel moves:
    the attention operator's ``.contiguous()`` layout copies (the rest, the dropout masks, are
    vectorised kernels)."""

    @property
    def region_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def norm_region_bytes(self) -> int:
        """Bytes of the regions that compute a LayerNorm (its statistics or their gradient, a row
        reduction), the kernels the H200 profiles show run slowest (:func:`block_costs`)."""
        return sum(r.nbytes for r in self.regions if is_norm_region(r))

    @property
    def memory_bytes(self) -> int:
        """The compiled block's memory-bound bytes: the regions' plus the opaque operators'."""
        return self.region_bytes + self.extern_bytes

    def count(self, phase: str | None = None) -> int:
        """Fused kernels (regions), of one phase or all."""
        return sum(1 for r in self.regions if phase in (None, r.phase))


@dataclass
class _Node:
    phase: str
    name: str
    extern: bool
    reads: tuple[tuple[int, int, int], ...]
    writes: tuple[tuple[int, int, int], ...]
    alone: bool = False  # a kernel of its own (a concatenation of buffers: inductor's ConcatKernel)
    separate: bool = False  # a kernel of its own that does not end the open region (a column reduction)


def _column_reduction(op: OpRecord) -> bool:
    """A sum over the tokens (a bias or gain gradient): ``sum`` whose output has as many elements as
    its input's last dimension (features), fewer than its input."""
    if not op.name.startswith("aten.sum.") or not op.inputs or not op.outputs:
        return False
    (shape_in, _), (shape_out, _) = op.inputs[0], op.outputs[0]
    n_in, n_out = 1, 1
    for x in shape_in:
        n_in *= x
    for x in shape_out:
        n_out *= x
    return bool(shape_in) and n_out == shape_in[-1] < n_in


def _nodes(trace: BlockTrace, hidden_dropout_op: bool, columns_fuse: bool = True) -> tuple[list[_Node], int]:
    """The trace as the compiled graph's nodes (views dropped), and the bytes of the dropout mask
    kernels. A forward ``native_dropout`` becomes the mask operator (extern; it reads no tensor of
    the block) and the pointwise ``x * keep * scale`` (:meth:`megaformer.parallel.rng.DropoutRNG.dropout`
    under ``torch.compile``); its backward (``native_dropout_backward``) is pointwise already. A
    ``cat`` / ``stack`` of tensors that no memory-bound op made (extern kernels' outputs, graph
    inputs) is a kernel of its own: inductor's ``cat`` lowering (torch/_inductor/lowering.py) makes a
    pointwise concatenation, fusable, only of pointwise inputs; of realized buffers it makes a
    ``ConcatKernel`` that copies them into its output, which its consumer then reads."""
    nodes, mask_bytes = [], 0
    made_by_memory: set[int] = set()
    for op in trace.ops:
        if op.kind == "view":
            continue
        if hidden_dropout_op and op.name == "aten.native_dropout.default" and op.phase != "backward":
            (x, *_), (out, mask) = op.reads, op.writes
            mask_bytes += DROPOUT_KEEP_PASSES * x[2] + mask[2]
            nodes.append(_Node(op.phase, "megaformer.dropout_keep", True, (), (mask,)))
            nodes.append(_Node(op.phase, "mul (x * keep * scale)", False, (x, mask), (out,)))
            continue
        concat = op.name.startswith(CONCAT_OPS) and all(r[0] not in made_by_memory for r in op.reads)
        separate = not columns_fuse and _column_reduction(op)
        nodes.append(_Node(op.phase, op.name, op.kind != "memory", op.reads, op.writes, concat, separate))
        if op.kind == "memory":
            made_by_memory.update(w[0] for w in op.writes)
    return nodes, mask_bytes


def _groups(nodes: list[_Node]) -> list[list[int]]:
    """The memory-bound nodes (indices) grouped into fused kernels (:func:`fuse`'s rule). A node
    joins the open group; or, where it reads nothing of the open group and no memory-bound node
    reads its outputs (a sink: a bias- or gain-gradient sum), the latest closed group of its phase
    that made one of its inputs, if all its inputs existed before the extern op that closed that
    group (no cycle: e.g. the bias gradient of a GEMM's output gradient, after the GEMMs)."""
    fed = {tid for node in nodes if not node.extern for tid, _, _ in node.reads}
    groups: list[list[int]] = []
    closed_at: list[int] = []  # index of the node that closed each group (len(nodes): open)
    owner: dict[int, int] = {}  # tensor id -> group that wrote it
    made_at: dict[int, int] = {}  # tensor id -> node index that wrote it
    open_g = None
    for i, node in enumerate(nodes):
        if (
            open_g is not None
            and not node.separate
            and (
                node.phase != nodes[groups[open_g][0]].phase
                or node.alone
                or (node.extern and any(owner.get(tid) == open_g for tid, _, _ in node.reads))
            )
        ):
            closed_at[open_g], open_g = i, None
        if node.alone or node.separate:
            groups.append([i])
            closed_at.append(i + 1)
            owner.update((tid, len(groups) - 1) for tid, _, _ in node.writes)
        elif not node.extern:
            sources = {owner[t] for t, _, _ in node.reads if t in owner}
            sources = {g for g in sources if nodes[groups[g][0]].phase == node.phase}
            target = open_g
            if open_g not in sources and not any(tid in fed for tid, _, _ in node.writes):
                for g in sorted(sources - {open_g}, reverse=True):
                    if all(owner.get(t) == g or made_at.get(t, -1) < closed_at[g] for t, _, _ in node.reads):
                        target = g
                        break
            if target is None:
                groups.append([])
                closed_at.append(len(nodes))
                target = open_g = len(groups) - 1
            groups[target].append(i)
            owner.update((tid, target) for tid, _, _ in node.writes)
        made_at.update((tid, i) for tid, _, _ in node.writes)
    return [sorted(g) for g in groups]


def _regions(nodes: list[_Node], rematerialize: bool = True) -> list[Region]:
    """The fused kernels of :func:`_groups` and their bytes (:func:`fuse`'s traffic rule), with
    saved tensors recomputed in backward where that moves fewer bytes (:func:`_rematerialize`)."""
    readers: dict[int, set[int]] = {}
    for i, node in enumerate(nodes):
        for tid, _, _ in node.reads:
            readers.setdefault(tid, set()).add(i)
    groups = _groups(nodes)
    reads, writes = [], []
    for group in groups:
        inside = set(group)
        made = {tid for i in group for tid, _, _ in nodes[i].writes}
        reads.append({e for i in group for e in nodes[i].reads if e[0] not in made})
        writes.append(
            {
                e
                for i in group
                for e in nodes[i].writes
                if not readers.get(e[0]) or readers[e[0]] - inside  # used outside, or a graph output
            }
        )
    if rematerialize:
        _rematerialize(nodes, groups, readers, reads, writes)
    return [
        Region(nodes[g[0]].phase, tuple(nodes[i].name for i in g), sum(e[2] for e in r), sum(e[2] for e in w))
        for g, r, w in zip(groups, reads, writes)
    ]


def _rematerialize(nodes: list[_Node], groups: list, readers: dict, reads: list, writes: list) -> None:
    """Tensors recomputed where they are used rather than stored, where that moves fewer bytes:
    AOTAutograd's min-cut partitioner (torch/_functorch/partitioners.py,
    ``min_cut_rematerialization_partition``, inductor's default) saves for backward the tensors that
    are cheapest to keep and recomputes fusible (pointwise) ops in backward; within a graph, inductor
    inlines a pointwise node into each kernel that uses it (``Pointwise`` IR nodes are recomputed
    unless realized). Here: a tensor a region writes only for other regions' memory-bound ops (no
    extern op reads it) is recomputed in those regions from the region inputs it derives from
    (:func:`_leaves`: tensors in memory anyway, kept so), where reading those costs fewer bytes than
    writing it once and reading it in each. Updates the per-group sets of ``(tensor id, offset,
    bytes)`` ``reads`` / ``writes`` in place."""
    group_of = {i: g for g, group in enumerate(groups) for i in group}
    producer = {tid: i for i, node in enumerate(nodes) for tid, _, _ in node.writes}
    kept = {e[0] for w in writes for e in w}
    pinned: set[int] = set()  # leaves of a recomputation: stay written
    for g, group in enumerate(groups):
        for entry in sorted(writes[g]):
            users = readers.get(entry[0], set()) - set(group)
            if not users or entry[0] in pinned or any(nodes[u].extern for u in users):
                continue
            leaves = _leaves(nodes, entry, producer, group_of, g)
            if leaves is None or any(
                producer.get(e[0]) is not None and not nodes[producer[e[0]]].extern and e[0] not in kept
                for e in leaves
            ):
                continue
            targets = {group_of[u] for u in users}
            extra = sum(e[2] for h in targets for e in leaves - reads[h])
            if extra < entry[2] * (1 + len(targets)):
                writes[g].discard(entry)
                kept.discard(entry[0])
                pinned.update(e[0] for e in leaves)
                for h in targets:
                    reads[h] = {e for e in reads[h] if e[0] != entry[0]} | leaves


def _leaves(nodes: list[_Node], entry: tuple, producer: dict, group_of: dict, g: int) -> set | None:
    """The tensors made outside group ``g`` that ``entry`` (made in ``g``) is computed from, through
    the memory-bound ops of ``g``; None where a reduction's output is needed (LayerNorm statistics
    are saved by eager, not recomputed: the partitioner bans recomputing reductions) or a
    concatenation's (a ``ConcatKernel`` writes its output)."""
    out, todo, seen = set(), [entry[0]], set()
    while todo:
        tid = todo.pop()
        if tid in seen:
            continue
        seen.add(tid)
        node = nodes[producer[tid]]
        statistics = "layer_norm" in node.name and tid != node.writes[0][0]  # mean, rstd
        if node.alone or statistics or any(r in node.name for r in ("sum", "mean", "var")):
            return None
        for e in node.reads:
            if producer.get(e[0]) is not None and group_of.get(producer[e[0]]) == g:
                todo.append(e[0])
            else:
                out.add(e)
    return out


def reruns_attention(model: dict) -> bool:
    """Whether compiled GPU attention with dropout is the rerun operator
    (:func:`megaformer.parallel.rng_ops.attention_dropout`, ``model.attention_backend=sdpa``) rather
    than a fused kernel's own forward and backward
    (:func:`megaformer.parallel.rng_ops.fused_attention_dropout`, which adds nothing to the eager
    kernels: the same ATen forward and backward, the output in the kernel's layout)."""
    return model.get("attention_dropout", 0.0) > 0.0 and model.get("attention_backend", "auto") == "sdpa"


def _attention_dropout_terms(trace: BlockTrace) -> tuple[list[Region], int, float]:
    """What :func:`megaformer.parallel.rng_ops.attention_dropout` (compiled GPU attention with
    dropout under ``model.attention_backend=sdpa``) adds to the eager kernels: per forward run
    (forward, full recompute's rerun) the
    ``.contiguous()`` of its output (flash writes ``[B, T, nh, hs]`` and returns it transposed: one
    read + one write, an eager kernel in the operator) and, as the operator's fake output is
    contiguous ``[B, nh, T, hs]``, the graph's copy of ``y.transpose(1, 2).reshape(...)`` before
    W_O (a region of its own unless HeadScale's product before W_O makes that layout); per backward
    the ``.contiguous()`` of the three gradients, and the forward it reruns (unless the eager trace
    already reruns it: selective recompute). Returns (regions, extern bytes, extra FLOPs)."""
    m = dict(trace.key.model)
    regions, extern, flops = [], 0, 0.0
    scaled = m.get("head_scale") and m.get("head_scale_position", "before_out_proj") == "before_out_proj"
    attn = trace.of_kind("attention")
    rerun_in_backward = any(op.phase == "backward" and "backward" not in op.name for op in attn)
    for op in attn:
        if "backward" in op.name:
            extern += 2 * sum(w[2] for w in op.writes[:3])
            flops += 0.0 if rerun_in_backward else op.flops / 2
        elif op.phase != "backward":
            out = op.writes[0][2]
            extern += 2 * out
            if not scaled:
                regions.append(Region(op.phase, ("clone (attention output layout)",), out, out))
    return regions, extern, flops


def fuse(trace: BlockTrace, *, column_reductions_fuse: bool = True) -> FusedBlock:
    """An ESTIMATE of the memory-bound traffic of the block compiled by inductor (``train.compile``,
    :mod:`megaformer.model.compile`), from the eager fake-CUDA trace: not a trace of compiled kernels
    (inductor cannot generate Triton kernels on fake CUDA). Its rules lean to more fusion (an upper
    bound on what fusion saves, a lower bound on the bytes) except where noted; against inductor's
    C++ backend on the same block (``bench/steptime_trace.py``'s docstring) the forward kernels match
    in number and bytes and the backward's bytes lie between ``column_reductions_fuse`` True and
    False.

    Rules, and their sources:

    * **Regions** (torch/_inductor/scheduler.py: ``Scheduler.fuse_nodes`` fuses pointwise and
      reduction nodes; extern kernels, ``ExternKernel`` / ``FallbackKernel``, are never fused, and
      no fusion may create a cycle through one, ``will_fusion_create_cycle``): each phase
      (forward, backward, full recompute's rerun: separate graphs; regional compilation as
      torchtitan's ``apply_compile``) is cut into regions of memory-bound ops between extern ops:
      GEMMs, attention kernels, collectives, megaformer's opaque operators
      (:mod:`megaformer.parallel.rng_ops`). An extern op ends the open region only where it reads a
      tensor the region wrote (otherwise the region's nodes fuse around it: e.g. the dropout mask
      operator, which reads only the generator state); a sink (a gradient sum) after such an op may
      join the region that made its input (:func:`_groups`). A ``cat`` / ``stack`` of realized
      buffers is a kernel of its own (inductor's ``ConcatKernel``, torch/_inductor/lowering.py).
    * **Traffic**: a region reads the tensors made outside it (extern ops, earlier regions,
      parameters, the block input, saved activations) and writes the tensors used outside it (by an
      op of another region or an extern op, saved for backward, or read by none: the block output
      and the gradients); a tensor made and used inside one region costs nothing. Identity: the
      trace's tensor ids (storage and version; views resolved to their base), each view's bytes.
    * **Reductions fuse** with their pointwise neighbours (assumed): LayerNorm statistics and their
      backward, bias- and gain-gradient sums, as inductor's persistent reductions do when a row fits
      one kernel (``triton_heuristics.persistent_reduction``). Column reductions (gradients summed
      over tokens) are often separate kernels that re-read their input (inductor's C++ backend on
      this CPU: ``bench/steptime_trace.py``'s docstring); ``column_reductions_fuse=False`` makes each
      such ``sum`` a kernel of its own (the pessimistic end).
    * **Recomputation** (:func:`_rematerialize`): a tensor written only for other regions'
      memory-bound ops (saved for backward, or read after an all-reduce) is recomputed there from
      its inputs where that moves fewer bytes (AOTAutograd's min-cut partitioner; inductor's
      inlining of pointwise nodes); reductions' outputs are not recomputed.
    * **Layout copies**: a view that an extern kernel needs contiguous is copied in eager mode too
      (the trace's ``clone`` / ``copy_``), so it is in a region (its producer's, fused; a region of
      its own between two extern kernels). The compiled GPU attention dropout under
      ``model.attention_backend=sdpa`` adds its own copies and its rerun
      (:func:`_attention_dropout_terms`); a fused kernel's operator adds nothing.
    * **Dropout**: compiled, the hidden-dropout mask is the opaque ``megaformer::dropout_keep``
      (its own eager kernels: ``DROPOUT_KEEP_PASSES`` passes + the mask, ``extern_bytes``) and
      ``x * keep * scale`` is pointwise in the region.
    """
    m = dict(trace.key.model)
    nodes, extern = _nodes(trace, m.get("hidden_dropout", 0.0) > 0.0, column_reductions_fuse)
    regions = _regions(nodes)
    flops = 0.0
    if reruns_attention(m):
        more, attn_bytes, flops = _attention_dropout_terms(trace)
        regions, extern = regions + more, extern + attn_bytes
        return FusedBlock(regions, extern, flops, attn_bytes)
    return FusedBlock(regions, extern, flops)


def is_norm_region(region: Region) -> bool:
    """Whether a fused region computes a LayerNorm forward or backward (a row reduction over the
    features): inductor generates it as a reduction kernel (``triton_red_`` / ``triton_per_``
    with ``native_layer_norm`` in its name in the H200 profiles)."""
    return any("layer_norm" in op for op in region.ops)


# --- into the step-time model ------------------------------------------------------------------------


def compiles(cfg: Any) -> bool:
    """Whether ``cfg``'s blocks run compiled on a GPU (:func:`megaformer.training.builders` rule):
    ``train.compile`` on (``auto``: on for CUDA) and not under ZeRO-3 (its hooks break the graph)."""
    setting = cfg.train.compile
    return (setting if isinstance(setting, bool) else True) and cfg.train.zero_stage != 3


def block_costs(
    cfg: Any,
    dev: Any,
    q: int,
    gpus_per_node: int,
    *,
    compiled: bool = False,
    column_reductions_fuse: bool = True,
) -> tuple[float, float, float, float, float]:
    """:func:`megaformer.perf.costs.formula_block_costs` from the block's trace: ``(GEMM seconds,
    attention seconds, memory-bound seconds, TP communication seconds, b·s·d·q bytes)`` for one block,
    one micro-batch, one rank of ``cfg`` on ``dev``.

    Each traced GEMM at ``_gemm(dev, M, K, N, q)`` (its own shape, forward and backward alike); the
    attention kernels' FLOPs, halved where the kernel is causal (the formula halves always; the
    MLM's bidirectional attention does all of its FLOPs), forward and backward each at its own rate
    with or without attention dropout (:meth:`~megaformer.perf.devices.DeviceSpec.attention_flops_per_s`:
    on the H200 the dropout kernels run at 41 % / 74 % of the no-dropout ones); the eager memory
    ops' bytes at the rates of the compiled block's kernel classes (ATen's LayerNorm forward and
    backward kernels at ``fused_norm``, the other elementwise and reduction kernels at ``fused``:
    an assumption the eager H200 rows test, their step times being in no fit); each collective at
    ``collective_time`` over the TP group's link (``_link``).

    ``compiled`` (the block as ``train.compile`` runs it on a GPU, :func:`compiles`): the memory-bound
    bytes are :func:`fuse`'s estimate of inductor's fusion, each kind at its kernel class's rate
    (:meth:`~megaformer.perf.devices.DeviceSpec.bytes_per_s`): the regions that compute a
    LayerNorm (:func:`is_norm_region`) at ``fused_norm``, the other regions at ``fused``, the
    attention operator's layout copies at ``copy`` (ATen's non-vectorised kernel), the dropout
    masks at ``stream``; and the attention term adds the forward the compiled attention dropout
    reruns in backward under ``model.attention_backend=sdpa`` (:func:`reruns_attention`), at the
    forward rate (``column_reductions_fuse``: :func:`fuse`'s). A CPU
    device (``dev.cpu``) runs CPU kernels the fake-CUDA trace does not show (the math attention
    with dropout, ``bernoulli_`` dropout, compute-bound GeLU): the formula's ``formula_block_costs`` then,
    compiled or not.

    Raises:
        as :func:`trace_block`.
    """
    if dev.cpu:
        return formula_block_costs(cfg, dev, q, gpus_per_node)
    trace = trace_block(cfg, q, gpu_for(dev))
    compute = sum(gemm_seconds(dev, m, k, n, q) for m, k, n in trace.gemms)
    dropout = dict(trace.key.model).get("attention_dropout", 0.0) > 0.0
    fwd_flops = bwd_flops = 0.0  # causal halved
    for op in trace.of_kind("attention"):
        flops = (0.5 if op.detail == "causal" else 1.0) * op.flops
        if "backward" in op.name:
            bwd_flops += flops
        else:
            fwd_flops += flops
    if compiled:
        fused = fuse(trace, column_reductions_fuse=column_reductions_fuse)
        fwd_flops += (0.5 if trace.attention_causal else 1.0) * fused.extra_attention_flops
        pointwise = fused.region_bytes - fused.norm_region_bytes
        memory = (
            pointwise / dev.bytes_per_s("fused")
            + fused.norm_region_bytes / dev.bytes_per_s("fused_norm")
            + fused.copy_bytes / dev.bytes_per_s("copy")
            + (fused.extern_bytes - fused.copy_bytes) / dev.bytes_per_s("stream")
        )
    else:  # eager: ATen's LayerNorm kernels at the LayerNorm class's rate, the rest at the fused one
        norm = sum(op.nbytes for op in trace.of_kind("memory") if "layer_norm" in op.name)
        memory = norm / dev.bytes_per_s("fused_norm") + (trace.memory_bytes - norm) / dev.bytes_per_s("fused")
    attention = fwd_flops / dev.attention_flops_per_s(backward=False, dropout=dropout)
    attention += bwd_flops / dev.attention_flops_per_s(backward=True, dropout=dropout)
    tp = cfg.parallel.tp_size
    bw, lat = link(dev, tp, gpus_per_node)
    comm = sum(
        collective_time("allreduce" if kind == "allreduce" else "gather", nbytes, tp, bw, lat)
        for kind, nbytes in trace.collectives
    )
    return compute, attention, memory, comm, float(trace.act_bytes)


def formula_counts(cfg: Any, q: int) -> dict[str, float]:
    """The formula's own counts for one block, one micro-batch: ``gemm_flops``, ``attention_flops``
    (causal not halved), ``memory_bytes``, ``tp_wire_bytes`` (ring bytes per rank), read off
    :func:`~megaformer.perf.costs.formula_block_costs` with devices of unit rates (1 FLOP/s, 1 B/s,
    zero latency; the other rates infinite)."""
    big = 1e30
    flops_dev = DeviceSpec("unit FLOP/s", 1e-12, 1.0, 1.0, big, 1.0, 1e-9, 0.0, 1e-9, 0.0)
    bytes_dev = DeviceSpec("unit B/s", big, 1.0, 1.0, 1e-9, 1.0, big, 0.0, big, 0.0)
    compute, attention, _, tp_bytes, _ = formula_block_costs(cfg, flops_dev, q, gpus_per_node=8)
    memory = formula_block_costs(cfg, bytes_dev, q, gpus_per_node=8)[2]
    return {
        "gemm_flops": compute,
        "attention_flops": 2.0 * attention,  # the formula halves for the causal kernel
        "memory_bytes": memory,
        "tp_wire_bytes": tp_bytes,
    }


def trace_counts(trace: BlockTrace) -> dict[str, float]:
    """The trace's counterparts of :func:`formula_counts`, and the compiled block's estimate
    (:func:`fuse`): ``fused_memory_bytes`` (regions + opaque operators), ``fused_extern_bytes`` (the
    opaque operators' part), ``fused_kernels`` (regions), ``fused_extra_attention_flops``, and
    ``fused_memory_bytes_columns_apart`` (``column_reductions_fuse=False``)."""
    fused = fuse(trace)
    return {
        "gemm_flops": trace.gemm_flops,
        "attention_flops": trace.attention_flops,
        "memory_bytes": float(trace.memory_bytes),
        "tp_wire_bytes": trace.tp_wire_bytes(),
        "fused_memory_bytes": float(fused.memory_bytes),
        "fused_extern_bytes": float(fused.extern_bytes),
        "fused_kernels": float(fused.count()),
        "fused_extra_attention_flops": fused.extra_attention_flops,
        "fused_memory_bytes_columns_apart": float(fuse(trace, column_reductions_fuse=False).memory_bytes),
    }


def memory_by_op(trace: BlockTrace) -> dict[str, tuple[int, int]]:
    """``{phase/op name: (calls, bytes)}`` of the memory-bound ops, largest first."""
    out: dict[str, list[int]] = {}
    for op in trace.of_kind("memory"):
        rec = out.setdefault(f"{op.phase}/{op.name}", [0, 0])
        rec[0] += 1
        rec[1] += op.nbytes
    return {k: (c, b) for k, (c, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}


__all__ = [
    "BlockTrace",
    "FusedBlock",
    "OpRecord",
    "Region",
    "TraceKey",
    "available",
    "block_costs",
    "classify",
    "compiles",
    "formula_counts",
    "fuse",
    "memory_by_op",
    "trace_block",
    "trace_blocks",
    "trace_counts",
    "trace_key",
]

if __name__ == "__main__":
    main()
