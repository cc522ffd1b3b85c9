"""Fake CUDA in a CPU-only process: ``torch.cuda`` stand-ins, the fake process group, and the audit
that checks what a GPU run would be refused or slowed by.

Import only in a process started by :mod:`megaformer.perf.fakecuda.launch` (the shim preloaded, before
torch). What is real and what is not (``../shared/docs/FACTS-FAKE-CUDA.md``):

* tensors on ``"cuda"`` are FakeTensors: shapes, dtypes, devices and storage sizes are real, values
  are not (a host read returns a placeholder, counted by :class:`Audit`);
* the process group is torch's ``"fake"`` backend: one process plays rank ``r`` of an ``N``-rank
  job; every collective returns at once, and :class:`Audit` sees each with its tensors;
* ``torch.cuda``'s Python functions that a CPU build lacks are replaced by stand-ins for one device
  (:func:`install_cuda_stubs`), with the capability and memory of the GPU named by ``--gpu``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from megaformer.perf.fakecuda.gpus import GPUS, GpuModel  # noqa: F401  (re-exported)

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class FakeCudaUnavailableError(RuntimeError):
    """The fake-CUDA shim is not loaded in this process (start it through ``launch``)."""


def check_shim_loaded() -> None:
    """Raise :class:`FakeCudaUnavailableError` unless the shim's CUDA hooks are registered."""
    try:
        with FakeTensorMode():
            x = torch.empty(2, device="cuda", requires_grad=True)
            (x * 2).sum().backward()
    except Exception as e:  # the CPU build's own error: no CUDA guard
        raise FakeCudaUnavailableError(
            f"fake CUDA is not available in this process ({type(e).__name__}: {e}); start it with "
            "megaformer.perf.fakecuda.launch (LD_PRELOAD of the shim before torch is imported)"
        ) from None


_HOST_BY_DESIGN = [0]


@contextlib.contextmanager
def host_by_design():
    """CPU tensors made in the block are what the real CUDA API makes on the host too (generator
    states): :class:`Audit` does not count them as CPU work inside the step."""
    _HOST_BY_DESIGN[0] += 1
    try:
        yield
    finally:
        _HOST_BY_DESIGN[0] -= 1


class _FakeStream:
    """A CUDA stream / event stand-in: every operation is a no-op (nothing runs asynchronously)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *args: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _FakePhilox:
    """The fake device's generator: a 16-byte Philox state (seed, offset), as CUDA's, behind
    ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and
    ``torch.cuda.default_generators[0]``."""

    def __init__(self) -> None:
        self.state = torch.zeros(16, dtype=torch.uint8)

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        # CUDA's generator state is a host tensor on a real GPU too (no device work): not counted.
        with host_by_design():
            return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        """Raises RuntimeError for anything but a 16-byte uint8 CPU tensor, as CUDA's generator does."""
        if state.dtype != torch.uint8 or state.numel() != 16 or state.device.type != "cpu":
            # CUDA's Philox generator takes exactly this; a CPU generator's 5,056-byte state is the
            # mistake this stand-in must not forgive.
            raise RuntimeError(
                f"torch.cuda.set_rng_state: expected a 16-byte uint8 CPU tensor (CUDA Philox state), "
                f"got {state.dtype} × {state.numel()} on {state.device}"
            )
        with host_by_design():
            self.state = state.clone()

    def manual_seed(self, seed: int) -> None:
        self.state = torch.tensor(list(int(seed).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)

    def generator(self) -> Any:
        """``torch.cuda.default_generators[0]``: the same state as the functions."""
        rng = self

        class FakeCudaGenerator:
            device = torch.device("cuda", 0)

            def get_state(self) -> torch.Tensor:
                return rng.get_rng_state()

            def set_state(self, state: torch.Tensor) -> None:
                rng.set_rng_state(state)

            def manual_seed(self, seed: int) -> FakeCudaGenerator:
                rng.manual_seed(seed)
                return self

            def initial_seed(self) -> int:
                return 0

            def seed(self) -> int:
                return 0

        return FakeCudaGenerator()


def _device_properties(gpu: GpuModel) -> Any:
    """``torch.cuda.get_device_properties``'s answer for ``gpu``."""
    fields = {
        "name": gpu.name,
        "major": gpu.capability[0],
        "minor": gpu.capability[1],
        "total_memory": gpu.memory_bytes,
        "multi_processor_count": 132,
    }
    return type("FakeDeviceProperties", (), fields)()


def _cuda_stub_table(gpu: GpuModel, rng: _FakePhilox) -> dict[str, Any]:
    """``torch.cuda``'s functions (by name) as one device described by ``gpu`` answers them."""
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": none,
        "init": none,
        "_lazy_init": none,
        "get_device_name": lambda device=None: gpu.name,
        "get_device_capability": lambda device=None: gpu.capability,
        "get_device_properties": lambda device=None: _device_properties(gpu),
        "is_bf16_supported": lambda *a, **k: gpu.capability >= (8, 0),
        "synchronize": none,
        "empty_cache": none,
        "ipc_collect": none,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "memory_cached": zero,
        "max_memory_cached": zero,
        "reset_peak_memory_stats": none,
        "reset_max_memory_allocated": none,
        "reset_max_memory_cached": none,
        "mem_get_info": lambda device=None: (gpu.memory_bytes, gpu.memory_bytes),
        "memory_stats": lambda device=None: {},
        "get_rng_state": rng.get_rng_state,
        "set_rng_state": rng.set_rng_state,
        "get_rng_state_all": lambda: [rng.get_rng_state()],
        "set_rng_state_all": lambda states: rng.set_rng_state(states[0]),
        "manual_seed": rng.manual_seed,
        "manual_seed_all": rng.manual_seed,
        "seed": none,
        "seed_all": none,
        "initial_seed": zero,
        "Stream": _FakeStream,
        "Event": _FakeStream,
        "current_stream": lambda *a, **k: _FakeStream(),
        "default_stream": lambda *a, **k: _FakeStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "device": lambda *a, **k: contextlib.nullcontext(),
        "nvtx": type("nvtx", (), {"range_push": none, "range_pop": none, "range": none})(),
    }


_STUBS_FOR: list[GpuModel] = []
"""The GPU model whose stand-ins this process has installed (at most one)."""


def install_cuda_stubs(gpu: GpuModel) -> None:
    """Give a CPU build of torch the ``torch.cuda`` functions DeepSpeed and megaformer call, for one
    device described by ``gpu``. Generator states are 16-byte Philox states (seed, offset), as
    CUDA's; memory counters report 0 (the audit measures the fake allocations instead).

    Installed once per process: a second call for the same GPU does nothing (a session forked from
    a warm server, :mod:`.server`, finds them installed); for another GPU it raises ``RuntimeError``
    (the stand-ins and the modules imported onto them would describe the first one).
    """
    import importlib

    if _STUBS_FOR:
        if _STUBS_FOR[0] == gpu:
            return
        raise RuntimeError(
            f"the CUDA stand-ins of this process describe {_STUBS_FOR[0].name}, not {gpu.name}: one GPU "
            "model per fake-CUDA process (start another through megaformer.perf.fakecuda.launch)"
        )
    _STUBS_FOR.append(gpu)

    cuda = torch.cuda
    rng = _FakePhilox()
    cuda.default_generators = (rng.generator(),)
    # torch's c10d logger asks the NCCL version on every call
    importlib.import_module("torch.cuda.nccl").version = lambda: (2, 21, 5)
    for name, fn in _cuda_stub_table(gpu, rng).items():
        # One function object per name: dynamo's trace rules key torch.cuda's functions by identity
        # and refuse one object under two names.
        setattr(cuda, name, _distinct(fn, name))
    torch.Tensor.record_stream = lambda self, stream: None
    # Pinned host memory needs a CUDA host allocator; the loader's pinning is a copy optimisation
    # that changes nothing a fake run can observe.
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.is_pinned = lambda self, *a, **k: False
    _allow_swapping_fake_parameters()
    _route_attention_to_fused_kernels(gpu)


ATTENTION_KERNELS: Counter = Counter()
"""Attention calls per fused kernel in this process (:func:`_route_attention_to_fused_kernels`)."""


def _route_attention_to_fused_kernels(gpu: GpuModel) -> None:
    """``F.scaled_dot_product_attention`` on fake CUDA runs the fused kernel a GPU would pick.

    A CPU build has no CUDA kernel to ask which one (``_fused_sdp_choice``), so SDPA would fall back
    to the math path, which keeps the ``[B, heads, T, T]`` scores, softmax and dropout mask for
    backward: several GiB per layer at seq_len 2048 that no GPU run holds. Here the choice follows
    torch's ``sdp_utils`` order for an unmasked (optionally causal) call: flash attention for
    fp16/bf16 on compute capability 8.0+ with head dim ≤ 256, else memory-efficient attention
    (V100, fp32). Both ops have meta kernels and autograd formulas, so memory and backward are the
    kernels' own: the output and the per-row log-sum-exp are kept, not the scores.
    """
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if query.device.type != "cuda" or attn_mask is not None or kwargs:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, **kwargs)
        half = query.dtype in (torch.float16, torch.bfloat16)
        if gpu.capability >= (8, 0) and half and query.shape[-1] <= 256:
            ATTENTION_KERNELS["flash"] += 1
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        ATTENTION_KERNELS["memory_efficient"] += 1
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, dropout_p, is_causal, scale=scale
        )[0]

    F.scaled_dot_product_attention = sdpa


def _distinct(fn: Any, name: str) -> Any:
    """A new object doing what ``fn`` does: a subclass for a class, a wrapper for a function."""
    if isinstance(fn, type):
        return type(name, (fn,), {})
    if not callable(fn):
        return fn

    def stub(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    stub.__name__ = stub.__qualname__ = name
    return stub


def _allow_swapping_fake_parameters() -> None:
    """``Module.to`` / ``.bfloat16()`` swap FakeTensor parameters with ``torch.utils.swap_tensors``
    (a real tensor's ``.data`` is reassigned instead), which refuses a tensor that has a weak
    reference. Two kinds hold one here: the fake mode's converter memo (a cache for converting real
    tensors, which a fake-CUDA run never converts back: emptied) and ``weakref.finalize`` callbacks
    (DeepSpeed's parameter-name map, ``deepspeed.utils.debug``: detached for the swap and attached
    again to the same Python object, which keeps its identity through the swap)."""
    original = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        finalizers = []
        for t in (t1, t2):
            if not (isinstance(t, FakeTensor) and weakref.getweakrefs(t)):
                continue
            converter = t.fake_mode.fake_tensor_converter
            converter.meta_converter.tensor_memo.clear()
            converter.tensor_memo.clear()
            for fin in [f for f, info in list(weakref.finalize._registry.items()) if info.weakref() is t]:
                detached = fin.detach()
                if detached is not None:
                    finalizers.append(detached)
        # The swap also exchanges the Python objects' __dict__; on a real device ``param.data = new``
        # keeps the parameter's attributes (megaformer's ``no_weight_decay``,
        # ``tensor_model_parallel``; DeepSpeed's ``ds_*``), so they go with it here too.
        for k, v in t1.__dict__.items():
            t2.__dict__.setdefault(k, v)
        try:
            original(t1, t2)
        finally:
            for obj, func, args, kwargs in finalizers:
                weakref.finalize(obj, func, *args, **kwargs)

    torch.utils.swap_tensors = swap_tensors


def init_fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as rank ``rank`` of ``world_size`` on torch's fake backend, with
    ``dist.get_backend`` reporting ``"nccl"`` (what the run would use on GPUs), so every
    ``backend == "nccl"`` branch of megaformer and DeepSpeed takes its GPU path."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    real_get_backend = dist.get_backend

    def get_backend(group: Any = None) -> str:
        backend = real_get_backend(group)
        return "nccl" if backend == "fake" else backend

    dist.get_backend = get_backend
    dist.distributed_c10d.get_backend = get_backend


# --------------------------------------------------------------------------------------------------
# The audit
# --------------------------------------------------------------------------------------------------

_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), float(), int(), bool(), .tolist()
}
_DYNAMIC_SHAPE = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
}
_FACTORIES_TO_IGNORE = {torch.ops.aten.lift_fresh.default, torch.ops.aten.detach.default}


def caller(skip_torch: bool = True) -> str:
    """``file:line (function)`` of the innermost frame outside torch and this module: who asked."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if path == here or (skip_torch and path.startswith(torch_dir)):
            continue
        if "/contextlib.py" in path:
            continue
        if "site-packages" + os.sep in path:
            shown = _site_relative(path)
        elif path.startswith(PROJECT_ROOT):
            shown = os.path.relpath(path, PROJECT_ROOT)
        else:
            shown = path
        return f"{shown}:{frame.lineno} ({frame.name})"
    return "<unknown>"


def _site_relative(path: str) -> str:
    marker = "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


@dataclass
class Finding:
    """One event of a kind the audit watches, with where it came from."""

    kind: str  # host_sync | h2d_copy | cpu_collective | cpu_tensor | dynamic_shape
    where: str
    phase: str
    op: str
    detail: str = ""
    step: int = 0


@dataclass
class CollectiveRecord:
    """Collectives seen in one step: ``(op, group) -> [calls, bytes]``."""

    counts: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))


class Audit(TorchDispatchMode):
    """Watches every op of a fake-CUDA run, on top of the FakeTensorMode:

    * **NCCL's device rule**: a ``c10d`` collective or p2p op whose tensors are not all on CUDA is
      refused, as NCCL would refuse it (raises ``RuntimeError`` naming the caller's file:line), and
      recorded as ``cpu_collective``;
    * **host syncs**: ``.item()`` / ``float()`` / ``bool()`` / ``.tolist()`` of a device tensor, a
      device-to-host copy, data-dependent shapes (``nonzero``): recorded with file:line and the phase
      (``forward`` / ``backward`` / ``optimizer`` / ``step`` / ``eval`` / ``data`` / ``other``); a
      host read returns 0 (False) so the run goes on along its normal path;
    * **CPU tensors made inside the step** (phases other than ``other``): recorded;
    * **collectives per step**: op, group (by name: tp, dp, pp, mp, world, or DeepSpeed's own) and
      bytes, for the step :attr:`step` counts;
    * **device memory**: every CUDA storage's bytes while it lives (weak references), the peak and
      what was alive at the peak (:meth:`peak_snapshot`).

    Args:
        group_names: ``{process-group object: name}`` for the groups the run built.
        strict_nccl: raise on a CPU tensor in a collective (True: what NCCL does).
    """

    def __init__(self, group_names: dict[Any, str] | None = None, strict_nccl: bool = True) -> None:
        super().__init__()
        self.group_names: dict[str, str] = {}
        self.rank_names: dict[tuple[int, ...], str] = {}
        for group, name in (group_names or {}).items():
            self.name_group(group, name)
        self.strict_nccl = strict_nccl
        self.phase = "other"
        self.step = 0
        self.findings: list[Finding] = []
        self.collectives: dict[int, CollectiveRecord] = defaultdict(CollectiveRecord)
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.live_phase: dict[int, str] = {}
        self.labels: dict[int, str] = {}
        self.live_where: dict[int, str] = {}  # storage id -> file:line that made it (large ones)
        self._peak_where: dict[int, str] = {}
        self._peak_sizes: dict[int, int] = {}
        self._peak_phases: dict[int, str] = {}
        self._peak_labels: dict[int, str] = {}
        self.storages: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_ids: set[int] = set()
        self.peak_step = 0
        self.peak_phase = ""
        self.op_counts: Counter = Counter()
        self.after_backward: list[int] = []
        self.values = SmallValues()
        _ACTIVE_VALUES[0] = self.values
        self.cpu_tensors: Counter = Counter()  # (phase, where) -> host tensors made (no device cost)

    # ---- naming groups -------------------------------------------------------------------------
    def name_group(self, group: Any, name: str) -> None:
        """Call collectives over ``group`` ``name`` in the report."""
        if group is None:
            return
        self.group_names.setdefault(_group_key(group), name)

    def name_ranks(self, ranks: list[int], name: str) -> None:
        """Call any group of exactly these ranks ``name`` (DeepSpeed's pipeline engine builds its
        own groups over the same rank lists as megaformer's)."""
        self.rank_names.setdefault(tuple(ranks), name)

    def _group_name(self, pg: Any) -> str:
        key = _group_key(pg)
        if key in self.group_names:
            return self.group_names[key]
        try:
            ranks = dist.get_process_group_ranks(_as_python_group(pg))
        except Exception:
            return str(key)
        if tuple(ranks) in self.rank_names:
            return self.rank_names[tuple(ranks)]
        return f"ranks{ranks[0]}..{ranks[-1]}({len(ranks)})" if len(ranks) > 4 else f"ranks{ranks}"

    # ---- phases ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def in_phase(self, name: str):
        """Mark the ops of the block as ``name`` (nested phases: the innermost wins)."""
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    # ---- the dispatch hook -----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        self.op_counts[self.phase] += 1
        if func in _HOST_READS:
            return self._host_read(func, args)
        if name.startswith("c10d.") or name.startswith("_c10d_functional."):
            self._collective(func, name, args, kwargs)
        elif func in _DYNAMIC_SHAPE:
            self.findings.append(self._finding("dynamic_shape", caller(), name))
        if func is torch.ops.aten._to_copy.default or func is torch.ops.aten.copy_.default:
            self._check_copy(func, args, kwargs)
        out = func(*args, **kwargs)
        self._track(out, name)
        if name.startswith("c10d."):
            self.values.after_p2p(name, args)
        else:
            self.values.propagate(func, args, kwargs, out)
        return out

    def _host_read(self, func: Any, args: Any) -> Any:
        t = args[0]
        if t.device.type == "cuda":
            self._finding("host_sync", caller(), "item", f"{t.dtype}")
        elif not isinstance(t, FakeTensor):
            return func(*args)
        known = self.values.of(t)
        if known is not None:  # metadata whose values the run made itself (see SmallValues)
            with _disable_current_modes():
                return known.item()
        # A fake tensor has no value: 0 (False) stands in. Zero is what keeps a run on its normal
        # path: no stop flag, no overflow, no non-finite norm, no divergence.
        return False if t.dtype == torch.bool else (0.0 if t.dtype.is_floating_point else 0)

    def _check_copy(self, func: Any, args: Any, kwargs: Any) -> None:
        if func is torch.ops.aten._to_copy.default:
            src, dst_device = args[0], kwargs.get("device")
            dst_type = torch.device(dst_device).type if dst_device is not None else src.device.type
        else:
            dst, src = args[0], args[1]
            dst_type = dst.device.type
        to_host = src.device.type == "cuda" and dst_type == "cpu"
        to_device = src.device.type == "cpu" and dst_type == "cuda"
        if to_host:
            self._finding("host_sync", caller(), "copy to host", f"{src.dtype}{list(src.shape)}")
        elif to_device and self.phase not in ("other", "data"):
            self._finding("h2d_copy", caller(), "copy to device", f"{src.dtype}{list(src.shape)}")

    def _collective(self, func: Any, name: str, args: Any, kwargs: Any) -> None:
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        groups = [g for g in map(_as_group, flat) if g is not None]
        group = self._group_name(groups[0]) if groups else "?"
        op = name.split(".", 1)[1]
        # barrier's tensor is the process group's own (ProcessGroupNCCL makes a CUDA one itself)
        bad = [] if op.startswith("barrier") else [t for t in tensors if t.device.type != "cuda"]
        if bad:
            where = caller()
            self._finding("cpu_collective", where, op, f"{bad[0].device} {bad[0].dtype} on {group}")
            if self.strict_nccl:
                raise RuntimeError(
                    f"NCCL refuses a {bad[0].device} tensor: c10d {op} over {group} from {where} "
                    "(build the tensor on megaformer.parallel.comm.comm_device(group))"
                )
        if op in ("barrier", "monitored_barrier"):
            nbytes = 0
        elif op in ("allgather_", "allgather_into_tensor_coalesced", "_allgather_base_"):
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        else:
            nbytes = _unique_bytes(tensors)
        rec = self.collectives[self.step].counts[(op, group)]
        rec[0] += 1
        rec[1] += nbytes

    # ---- memory ------------------------------------------------------------------------------------
    def _track(self, out: Any, name: str) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type == "cpu":
                if _HOST_BY_DESIGN[0] or (t.dtype == torch.uint8 and t.numel() == 16):
                    continue  # CUDA generator states are host tensors on a GPU too (16-byte Philox)
                if self.phase not in ("other", "data") and t.dim() > 0 and not name.startswith("c10d."):
                    self.cpu_tensors[(self.phase, caller())] += 1
                continue
            if t.device.type != "cuda":
                continue
            self._track_storage(t)

    def _track_storage(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except Exception:
            return
        key = id(st)
        nbytes = st.nbytes()
        old = self.live.get(key)
        if old is not None and self.storages[key]() is st:
            if nbytes != old:  # resized in place (DeepSpeed frees partitions this way)
                self.current += nbytes - old
                self.live[key] = nbytes
                self._update_peak()
            return
        self.live[key] = nbytes
        self.live_phase[key] = self.phase
        if nbytes >= BIG_ALLOCATION:  # where the large ones come from (the stack walk costs)
            self.live_where[key] = caller()
        self.current += nbytes
        self.storages[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
        self._update_peak()

    def track_tensor(self, t: torch.Tensor) -> None:
        """Count a CUDA tensor made outside the audit (module parameters born before it started)."""
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            self._track_storage(t)

    def label(self, t: torch.Tensor, category: str) -> None:
        """Put ``t``'s storage in ``category`` for the memory report, for as long as it lives
        (object ids are reused after a storage dies: a label recorded by id alone would go to
        whatever storage comes next at that address)."""
        key = storage_key(t)
        if key in self.live:
            self.labels.setdefault(key, category)

    def _free(self, key: int) -> None:
        self.labels.pop(key, None)
        self.live_where.pop(key, None)
        nbytes = self.live.pop(key, 0)
        self.live_phase.pop(key, None)
        self.storages.pop(key, None)
        self.current -= nbytes

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_ids = set(self.live)
            self.peak_step = self.step
            self.peak_phase = self.phase
            self._peak_sizes = dict(self.live)
            self._peak_phases = dict(self.live_phase)
            self._peak_labels = dict(self.labels)
            self._peak_where = dict(self.live_where)

    def peak_snapshot(self) -> tuple[dict[int, int], dict[int, str], dict[int, str]]:
        """``({storage id: bytes}, {storage id: phase made in}, {storage id: label})`` of the
        storages alive at the peak."""
        return (
            getattr(self, "_peak_sizes", {}),
            getattr(self, "_peak_phases", {}),
            getattr(self, "_peak_labels", {}),
        )

    def _finding(self, kind: str, where: str, op: str, detail: str = "") -> None:
        self.findings.append(Finding(kind, where, self.phase, op, detail, self.step))

    def findings_of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]


BIG_ALLOCATION = 16 * 2**20
"""Storages from this size up (bytes) are recorded with the file:line that made them."""


class SmallValues:
    """Real values of the small integer tensors a run builds from host data (pipeline metadata:
    shapes, partition offsets), so that reading them back gives what a GPU would.

    FakeTensors have no values; DeepSpeed's pipeline engine sends tensor shapes and partition tables
    between stages in small int tensors and reads them back (``.tolist()``, ``.item()``). Here each
    such tensor's storage has a CPU shadow: factory ops and ops whose inputs are all known run again
    on the shadows (integer and bool dtypes, at most :attr:`LIMIT` elements); a p2p ``send`` of a
    known tensor is recorded; a ``recv`` into an integer buffer takes the values the sending stage
    would send: the last send of the same dtype and size recorded by this process, else by the
    first pipeline stage's run of the same job (:attr:`peer_sends`, which the harness passes to the
    later stages: every stage boundary carries the same hidden-state layout).
    """

    LIMIT = 4096

    def __init__(self) -> None:
        self.shadow: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.sent: list[tuple[str, int, list[int]]] = []
        self.peer_sends: list[tuple[str, int, list[int]]] = []

    @staticmethod
    def _small_int(t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and not t.dtype.is_floating_point
            and not t.dtype.is_complex
            and t.numel() <= SmallValues.LIMIT
        )

    def of(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s values as a real CPU tensor, or None if unknown."""
        if not isinstance(t, FakeTensor):
            return t if t.device.type == "cpu" else None
        entry = self.shadow.get(id(t.untyped_storage()))
        if entry is None or entry[0]() is None:
            constant = getattr(t, "constant", None)  # torch.tensor(data) under fake mode keeps it
            return constant if isinstance(constant, torch.Tensor) and constant.shape == t.shape else None
        flat = entry[1]
        try:
            with _disable_current_modes():
                return flat.as_strided(t.shape, t.stride(), t.storage_offset())
        except RuntimeError:
            return None

    def _set(self, t: torch.Tensor, values: torch.Tensor) -> None:
        st = t.untyped_storage()
        numel = st.nbytes() // t.element_size()
        shape, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
        with _disable_current_modes():
            flat = torch.zeros(numel, dtype=t.dtype)
            flat.as_strided(shape, stride, offset).copy_(values.reshape(shape))
        self.shadow[id(st)] = (weakref.ref(st), flat)

    def propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Run ``func`` again on the shadows when its integer outputs are small and every tensor
        input is known (an in-place op updates the shadow it writes; a view shares its base's)."""
        flat_out, _ = tree_flatten(out)
        outs = [t for t in flat_out if isinstance(t, FakeTensor) and self._small_int(t)]
        if not outs:
            return
        schema = func._schema
        mutable = schema.is_mutable
        aliasing = any(r.alias_info is not None for r in schema.returns)
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            if not isinstance(args[0], FakeTensor):  # host data becoming a (fake) tensor
                self._set(outs[0], args[0])
            return
        if aliasing and not mutable:
            return  # a view: its storage, hence its shadow, is its base's
        flat_in, spec = tree_flatten((args, kwargs))
        real_in, tensors = [], 0
        for i, a in enumerate(flat_in):
            if isinstance(a, torch.Tensor):
                tensors += 1
                known = self.of(a)
                if known is None and mutable and i == 0 and self._small_int(a):
                    with _disable_current_modes():
                        zeros = torch.zeros(a.shape, dtype=a.dtype)
                    self._set(a, zeros)  # writing into a buffer of unknown values: zeros first
                    known = self.of(a)
                if known is None:
                    return
                real_in.append(known)
            elif isinstance(a, torch.device):
                real_in.append(torch.device("cpu"))
            else:
                real_in.append(a)
        from torch.utils._pytree import tree_unflatten

        r_args, r_kwargs = tree_unflatten(real_in, spec)
        if "device" in r_kwargs:
            r_kwargs["device"] = torch.device("cpu")
        try:
            with _disable_current_modes():
                if tensors == 0 and "empty" in str(func):  # a fresh buffer: zeros stand in
                    r_out = torch.zeros(outs[0].shape, dtype=outs[0].dtype)
                else:
                    r_out = func(*r_args, **r_kwargs)
        except Exception:
            return
        if mutable:
            return  # the op wrote into the shadow itself
        real = [t for t in tree_flatten(r_out)[0] if isinstance(t, torch.Tensor)]
        for fake, value in zip(outs, real):
            if fake.shape == value.shape:
                self._set(fake, value)

    def after_p2p(self, name: str, args: Any) -> None:
        flat, _ = tree_flatten(args)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not tensors or not self._small_int(tensors[0]):
            return
        t = tensors[0]
        if name.startswith("c10d.send"):
            known = self.of(t)
            if known is not None:
                with _disable_current_modes():
                    self.sent.append((str(t.dtype), t.numel(), known.reshape(-1).tolist()))
        elif name.startswith("c10d.recv"):
            for source in (self.sent, self.peer_sends):
                match = [v for d, n, v in source if d == str(t.dtype) and n == t.numel()]
                if match:
                    with _disable_current_modes():
                        value = torch.tensor(match[-1], dtype=t.dtype)
                    self._set(t, value)
                    return


_ACTIVE_VALUES: list[SmallValues | None] = [None]


def _numpy_of_known(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``FakeTensor.numpy()`` for a host tensor whose values are known (DeepSpeed's partitioned
    activation checkpointing keeps each activation's size as ``torch.tensor(x.size())`` and reads
    it back with ``.numpy()``); any other FakeTensor has no values to give."""
    values = _ACTIVE_VALUES[0]
    known = values.of(self) if values is not None else None
    if known is None:
        raise RuntimeError(".numpy() of a fake tensor whose values are unknown (fake CUDA run)")
    with _disable_current_modes():
        return known.numpy(*args, **kwargs)


FakeTensor.numpy = _numpy_of_known


def storage_key(t: torch.Tensor) -> int:
    """The key :class:`Audit` tracks ``t``'s storage under."""
    return id(t.untyped_storage())


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (id(t.untyped_storage()), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _as_group(obj: Any) -> Any:
    """The Python ``ProcessGroup`` an op argument stands for (c10d ops take it as a ScriptObject)."""
    if isinstance(obj, dist.ProcessGroup):
        return obj
    if isinstance(obj, torch.ScriptObject) and "ProcessGroup" in str(obj):
        return dist.ProcessGroup.unbox(obj)
    return None


def _group_key(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:
        pass
    try:
        return str(dist.distributed_c10d._get_process_group_name(group))
    except Exception:
        return str(id(group))


def _as_python_group(pg: Any) -> Any:
    return _as_group(pg) or pg


class _FakeCudaTensorMode(FakeTensorMode):
    """FakeTensorMode that never materialises a tensor on the device: ``torch.tensor(x,
    device="cuda")`` is made on the CPU and lifted (FakeTensorMode decides this by asking
    ``torch.cuda.is_available()``, which the stand-ins answer True)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


def fake_mode() -> FakeTensorMode:
    """The FakeTensorMode of a run: real CPU tensors (numpy batches, constants) are converted on
    entry, as a host-to-device copy would."""
    return _FakeCudaTensorMode(allow_non_fake_inputs=True)


def excepthook_short() -> None:
    """Print tracebacks of the fake run without torch's internals (for the console)."""
    sys.tracebacklimit = 30
