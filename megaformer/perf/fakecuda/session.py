"""One rank of a GPU job, run on fake CUDA: the trainer's own parts, two optimizer steps, audited.

``python -m megaformer.perf.fakecuda.session REQUEST.json`` (started by :mod:`.launch`, the shim
preloaded) plays rank ``rank`` of a ``world_size``-rank job: the fake process group, then the
trainer's builders (:func:`~megaformer.training.builders.build_layout`, ``build_model``,
``build_optimizer``), the DeepSpeed config and engine of the recipe
(:func:`~megaformer.training.ds_adapter.initialize`: ZeRO stage, precision, the pipeline engine at
pp > 1), and the trainer's :class:`~megaformer.training.trainer.TrainLoop` for ``steps`` steps
(its metrics, health checks, stop check) plus one evaluation, all at the recipe's full size on
FakeTensors. What differs from a real run, and why:

* the samples are synthetic (tokens drawn from the vocabulary by sample index): the dataset and its
  indices are CPU work the CPU tests cover, and the recipes name corpora a login node may not have;
  the loader runs in-process (``data.num_workers=0``);
* checkpoints are not written (a FakeTensor has no bytes to save); the save is recorded;
* ``train.eval_batches`` is 1 (one evaluation's worth of micro-batches shows its memory and syncs).

The report (JSON, to the path the request names) holds the audit's findings, the collectives per
step, the peak of the fake device memory by category, dtypes of parameters, gradients and optimizer
state, and the loss and gradient norm the step computed (as placeholders: fake tensors have no
values, but their dtype and device are checked).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any

import numpy as np


class SyntheticSamples:
    """``int64[seq_len + 1]`` token rows, drawn from ``[0, vocab)`` by a generator seeded with the
    sample index (so any rank and step reads its own rows without a dataset)."""

    def __init__(self, seq_len: int, vocab: int, count: int) -> None:
        self.seq_len, self.vocab, self.count = seq_len, vocab, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        return np.random.default_rng(i).integers(0, self.vocab, self.seq_len + 1, dtype=np.int64)


class SyntheticMaskedSamples:
    """The masked LM's rows: ``(input_ids, labels)``, ``int64[seq_len]`` each, as
    :class:`~megaformer.data.mlm.MaskedLMSamples` serves them: ``<s>`` then GPT-2 ids drawn by a
    generator seeded with the sample index, masked by :func:`~megaformer.data.mlm.mask_block` (15%,
    80/10/10) keyed by the same index."""

    def __init__(self, seq_len: int, count: int, seed: int) -> None:
        self.seq_len, self.count, self.seed = seq_len, count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
        from megaformer.data.mlm import BOS_ID, EOD_ID, mask_block

        tokens = np.random.default_rng(i).integers(0, EOD_ID + 1, self.seq_len, dtype=np.int64)
        tokens[0] = BOS_ID
        return mask_block(tokens, seed=self.seed, epoch=0, index=i)


def _synthetic_data(cfg: Any) -> Any:
    """Training and validation samples of the run's objective, without a dataset."""
    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.training.builders import Data

    t, m = cfg.train, cfg.model
    count = t.steps * t.global_batch_size
    if m.objective == "mlm":
        train = SyntheticMaskedSamples(m.seq_len, count, t.seed)
        return Data(train, SyntheticMaskedSamples(m.seq_len, t.global_batch_size, t.seed + 1), {}, 0.0)
    train = SyntheticSamples(m.seq_len, m.vocab_size, count)
    return Data(train, SyntheticSamples(m.seq_len, m.vocab_size, t.global_batch_size), {}, 0.0)


class _InPhase:
    """An iterable whose items are produced in one of the audit's phases (the loader: "data")."""

    def __init__(self, iterable: Any, audit: Any, phase: str) -> None:
        self.iterable, self.audit, self.phase = iterable, audit, phase

    def __iter__(self) -> Any:
        it = iter(self.iterable)
        while True:
            with self.audit.in_phase(self.phase):
                item = next(it, None)
            if item is None:
                return
            yield item


class _NoCheckpoints:
    """Stands in for the checkpoint manager: FakeTensors cannot be written. Records what would be saved."""

    def __init__(self) -> None:
        self.saves: list[int] = []

    def save(self, step: int, extra: dict) -> None:
        self.saves.append(step)


class _AuditPhases:
    """The audit as the engine's phase observer (``Engine.observe_phases``): each step counted and
    its loss kept; the end of each backward noted (``audit.after_backward``)."""

    def __init__(self, audit: Any) -> None:
        self.audit = audit
        self.losses: list = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        if name == "step":
            self.audit.step += 1  # what follows, up to the next step, is this step's (stop check included)
        with self.audit.in_phase(name):
            yield
        if name == "backward":
            self.audit.after_backward.append(self.audit.current)

    def step_ended(self, loss: Any) -> None:
        self.losses.append(loss)


def _install_phase_marks(engine: Any, audit: Any) -> _AuditPhases:
    """Mark forward / backward / optimizer phases and count the steps of the engine (plain and
    pipeline) through its public doors; returns the observer (its ``losses``)."""
    observer = _AuditPhases(audit)
    engine.observe_phases(observer)
    if engine.pipelined:  # its own schedule: the instructions are marked instead
        # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
        from megaformer.training.ds_adapter import wrap_pipeline_instructions

        def marked(fn: Any, phase: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with audit.in_phase(phase):
                    return fn(*args, **kwargs)

            return wrapper

        wrap_pipeline_instructions(type(engine.engine), marked)
    return observer


def _tensors_of(obj: Any, path: str, out: list, seen: set, depth: int = 0) -> None:
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts (depth ≤ 5),
    with its path: how the DeepSpeed optimizer's buffers are found and named."""
    import torch

    if depth > 5 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if isinstance(obj, torch.nn.Module) or (callable(obj) and not hasattr(obj, "__dict__")):
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            _tensors_of(
                v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", out, seen, depth + 1
            )
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors_of(v, f"{path}[{i}]", out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
        "deepspeed",
        "torch",
        "megaformer",
    ):
        if type(obj).__module__.startswith("torch.distributed"):
            return
        for k, v in list(vars(obj).items()):
            _tensors_of(v, f"{path}.{k}", out, seen, depth + 1)


GRADIENT_BUFFER_SITES = (
    r"deepspeed/runtime/zero/stage_1_and_2\.py:\d+ \((setup_buckets|reduce_gradients)\)"
    r"|deepspeed/runtime/engine\.py:\d+ \(allreduce_bucket\)"
)
"""Where DeepSpeed 0.19 allocates its gradient-reduction buffers (ZeRO's ``ipg_buckets``; the
engine's flattened all-reduce buckets under the pipeline engine): a large storage made there is a
gradient buffer (they are made anew each step, so the optimizer's attributes at the end no longer
hold the ones alive at the peak)."""


def classify_peak(audit: Any, engine: Any) -> dict[str, int]:
    """Bytes of the fake device memory alive at the peak, by category: ``parameters`` (the module's
    weights and the flat buffers they are views of), ``gradients`` (parameter ``.grad`` and every
    optimizer buffer whose path names a gradient: DeepSpeed's fp32 accumulation, ZeRO's partitions
    and buckets), ``optimizer_state`` (fp32 master weights, Adam moments), ``activations`` (made in
    forward and alive then), ``other`` (backward temporaries, communication buffers, the rest)."""
    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.perf.fakecuda.runtime import storage_key

    sizes, phases, labels = audit.peak_snapshot()
    category: dict[int, str] = dict(labels)  # gradients, labelled while they lived
    for p in engine.module.parameters():
        category.setdefault(storage_key(p), "parameters")
    found: list = []
    _tensors_of(engine.engine.optimizer, "optimizer", found, set())
    for path, t in found:
        if t.device.type != "cuda":
            continue
        low = path.lower()
        if "grad" in low or "ipg" in low or "bucket" in low:
            kind = "gradients"
        elif "bf16_groups" in low or "fp16_groups" in low or "bit16" in low:
            kind = "parameters"
        else:
            kind = "optimizer_state"
        category.setdefault(storage_key(t), kind)
    totals = Counter()
    largest = []
    for key, nbytes in sizes.items():
        kind = category.get(key)
        if kind is None and re.search(GRADIENT_BUFFER_SITES, audit._peak_where.get(key, "")):
            kind = "gradients"  # DeepSpeed's reduction buckets, made anew each step
        if kind is None:
            kind = "activations" if phases.get(key) == "forward" else "other"
        totals[kind] += nbytes
        if key in audit._peak_where:
            largest.append((nbytes, kind, phases.get(key, ""), audit._peak_where[key]))
    grouped = Counter()
    for nbytes, kind, phase, where in largest:
        grouped[(kind, phase, where)] += nbytes
    audit.peak_largest = [
        {"category": k, "phase": ph, "where": w, "bytes": b} for (k, ph, w), b in grouped.most_common(15)
    ]
    return {
        k: int(totals.get(k, 0))
        for k in ("parameters", "gradients", "optimizer_state", "activations", "other")
    }


def run(request: dict) -> dict:
    """Run the request (see the module docstring); return the report."""
    # lazy: the session's order: the fake runtime (torch), then its CUDA stubs, then DeepSpeed and
    # the trainer (below and in the helpers), which must import onto the fake device
    from megaformer.config import load_config
    from megaformer.perf.fakecuda.runtime import (
        GPUS,
        Audit,
        check_shim_loaded,
        fake_mode,
        init_fake_process_group,
        install_cuda_stubs,
    )

    check_shim_loaded()
    install_cuda_stubs(GPUS[request["gpu"]])
    for module in request.get("setup_modules", []):  # instrumentation a test plants (tests/fakecuda)
        importlib.import_module(module)
    if request.get("unchecked_engine_json"):  # to show the DeepSpeed crash the check prevents is real
        # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
        import megaformer.training.deepspeed_config as dsc

        dsc.check_engine_combination = lambda *args, **kwargs: None
    world, rank, steps = int(request["world_size"]), int(request["rank"]), int(request.get("steps", 2))
    out_dir = request.get("output_dir") or tempfile.mkdtemp(prefix="megaformer-dryrun-")
    overrides = list(request.get("overrides", [])) + [
        "data.num_workers=0",
        "train.eval_batches=1",
        "train.resume=none",
        f"output.dir={out_dir}",
        "output.overwrite=true",
        "output.wandb_project=",
    ]
    cfg = load_config(request["config"], overrides)
    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.training.preflight import validate_layout

    dp_size = validate_layout(cfg, world)
    cap = request.get("max_micro_batches")
    t = cfg.train
    if cap and t.global_batch_size // (t.micro_batch_size * dp_size) > cap:
        # Fewer micro-batches per step (the test tier's time); each one at full size.
        cfg = load_config(
            request["config"], [*overrides, f"train.global_batch_size={t.micro_batch_size * dp_size * cap}"]
        )
        report_gas = (t.global_batch_size // (t.micro_batch_size * dp_size), cap)
    else:
        report_gas = None
    init_fake_process_group(rank, world)
    audit = Audit(strict_nccl=request.get("strict_nccl", True))
    audit.values.peer_sends = [tuple(x) for x in request.get("peer_sends", [])]
    report: dict[str, Any] = {"config": request["config"], "overrides": request.get("overrides", [])}
    report |= {"world_size": world, "rank": rank, "gpu": request["gpu"], "steps": steps}
    if report_gas:
        report["micro_batches_capped"] = {"recipe": report_gas[0], "run": report_gas[1]}
    t0 = time.perf_counter()
    with fake_mode(), audit:
        _run_rank(cfg, dp_size, audit, report, steps, out_dir)
    report["seconds"] = time.perf_counter() - t0
    report["findings"] = [vars(f) for f in audit.findings]
    report["collectives"] = {
        str(step): [
            {"op": op, "group": group, "calls": calls, "bytes": nbytes}
            for (op, group), (calls, nbytes) in sorted(rec.counts.items())
        ]
        for step, rec in sorted(audit.collectives.items())
    }
    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.perf.fakecuda.runtime import ATTENTION_KERNELS

    report["attention_kernels"] = dict(ATTENTION_KERNELS)
    report["peak_bytes"] = audit.peak
    report["p2p_int_sends"] = audit.values.sent
    report["cpu_tensors"] = [
        {"phase": phase, "where": where, "count": n} for (phase, where), n in audit.cpu_tensors.most_common()
    ]
    report["live_after_backward"] = audit.after_backward
    report["peak_at"] = {"step": audit.peak_step, "phase": audit.peak_phase}
    return report


def _audited_engine(cfg: Any, layout: Any, dp_size: int, audit: Any, report: dict) -> tuple[Any, Any, Any]:
    """Build this rank's model (its parameters tracked by ``audit``), optimizer and DeepSpeed engine
    as the trainer does; the engine's phases marked. Returns ``(engine, schedule, observer)``."""
    import torch

    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.parallel.rng import DropoutRNG
    from megaformer.training.builders import build_model, build_optimizer, count_parameters_global
    from megaformer.training.deepspeed_config import build_deepspeed_config
    from megaformer.training.ds_adapter import initialize
    from megaformer.training.schedule import Schedule

    t, s = cfg.train, layout.state
    torch.manual_seed(t.seed)
    dropout_rng = DropoutRNG(
        t.seed, tp_rank=s.tp_rank, dp_rank=s.dp_rank, pp_rank=s.pp_rank, device=layout.device
    )
    model = build_model(cfg, layout, dropout_rng)
    for p in model.parameters():
        audit.track_tensor(p)
    report["parameters_total"] = count_parameters_global(model, layout)
    report["parameters_rank"] = sum(p.numel() for p in model.parameters())
    schedule = Schedule(t)
    optimizer, scheduler = build_optimizer(model, cfg, 0, schedule)
    ds_config = build_deepspeed_config(cfg, dp_size)
    engine = initialize(model, optimizer, scheduler, ds_config, s, pipelined=cfg.parallel.pp_size > 1)
    ds = engine.engine
    report["engine"] = {"class": type(ds).__name__, "optimizer": type(ds.optimizer).__name__}
    report["engine"]["gas"] = engine.gas
    observer = _install_phase_marks(engine, audit)
    return engine, schedule, observer


def _label_gradients(engine: Any, audit: Any, report: dict) -> set[str]:
    """Label every gradient for the audit (as accumulated, and as DeepSpeed holds them before the
    optimizer step); returns the set the gradients' dtypes are collected into."""
    grad_dtypes: set[str] = set()

    def before_step() -> None:  # the gradients are complete; label what DeepSpeed holds them in
        for p in engine.module.parameters():
            if p.grad is not None:
                audit.label(p.grad, "gradients")
        report["dtypes"] = dtypes(engine)

    engine.before_optimizer_step(before_step)

    def grad_arrives(grad: Any) -> None:  # every gradient autograd hands a parameter, before any
        # accumulation hook (DeepSpeed's own, registered first, may move it out and free .grad:
        # ZeRO-2, the fp16 optimizer, bf16.immediate_grad_update)
        audit.label(grad, "gradients")
        grad_dtypes.add(str(grad.dtype))

    def grad_made(p: Any) -> None:  # the accumulated gradient, where DeepSpeed leaves it in .grad
        if p.grad is not None:
            audit.label(p.grad, "gradients")

    for p in engine.module.parameters():
        if p.requires_grad:
            p.register_hook(grad_arrives)
            p.register_post_accumulate_grad_hook(grad_made)
    return grad_dtypes


def _phased_batches(cfg: Any, layout: Any, data: Any, audit: Any) -> Any:
    """The loop's batch source with the loader and the host-to-device copy in phase "data"."""
    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.training.trainer import train_batches

    return lambda start_step: iter(_InPhase(train_batches(cfg, layout, data, start_step), audit, "data"))


def _run_rank(cfg: Any, dp_size: int, audit: Any, report: dict, steps: int, out_dir: str) -> None:
    import torch

    # lazy: after run() installs the CUDA stubs: torch-side modules import onto the fake device
    from megaformer.training.builders import build_layout
    from megaformer.training.stopping import StopCheck
    from megaformer.training.trainer import TrainLoop, compute_meter

    t = cfg.train
    layout = build_layout(cfg, dp_size)
    s = layout.state
    for name in ("tp", "dp", "pp", "mp"):
        audit.name_group(getattr(s, f"{name}_group"), name)
        audit.name_ranks(getattr(s, f"{name}_ranks"), name)
    audit.name_group(torch.distributed.group.WORLD, "world")
    report["layout"] = {"tp": s.tp_size, "pp": s.pp_size, "dp": s.dp_size, "pp_rank": s.pp_rank,
                        "tp_rank": s.tp_rank, "dp_rank": s.dp_rank, "backend": layout.backend}  # fmt: skip
    data = _synthetic_data(cfg)
    engine, schedule, observer = _audited_engine(cfg, layout, dp_size, audit, report)
    grad_dtypes = _label_gradients(engine, audit, report)
    checkpoints = _NoCheckpoints()
    compute = compute_meter(cfg, layout, 0, {})
    batches = _phased_batches(cfg, layout, data, audit)
    real_stop = StopCheck(t.exit_signals, t.exit_duration_mins)
    done = {"steps": 0}

    def stop() -> str | None:
        done["steps"] += 1
        reason = real_stop()
        return f"dry run: {steps} steps" if done["steps"] >= steps else reason

    loop = TrainLoop(engine, cfg, layout, data, checkpoints, 0, compute, schedule, {}, batches, stop=stop)
    for evaluator in (loop.evaluate, loop.evaluate_test):
        if evaluator is not None:
            evaluator.loader = _InPhase(evaluator.loader, audit, "data")

    losses = observer.losses
    with audit.in_phase("step"):
        loop.run(resumed=False)
    audit.step += 1
    with audit.in_phase("eval"):
        loss = loop.evaluate()
    report["eval_loss"] = {"dtype": str(loss.dtype), "device": str(loss.device)}
    report["loss"] = {"dtype": str(losses[-1].dtype), "device": str(losses[-1].device)} if losses else None
    norm = engine.grad_norm()
    report["grad_norm"] = None if norm is None else {"type": type(norm).__name__,
        "device": str(getattr(norm, "device", "host"))}  # fmt: skip
    report["steps_done"] = loop.last_step
    report["checkpoint_saves_skipped"] = checkpoints.saves
    report["peak_by_category"] = classify_peak(audit, engine)
    report["peak_largest"] = audit.peak_largest  # the big storages alive at the peak, by origin
    report.setdefault("dtypes", dtypes(engine))
    report["dtypes"]["gradients"] = sorted(grad_dtypes)


def dtypes(engine: Any) -> dict[str, list[str]]:
    """The dtypes of the module's parameters and gradients and of the optimizer's tensors."""
    params = sorted({str(p.dtype) for p in engine.module.parameters()})
    grads = sorted({str(p.grad.dtype) for p in engine.module.parameters() if p.grad is not None})
    found: list = []
    _tensors_of(engine.engine.optimizer, "optimizer", found, set())
    state = sorted({f"{t.dtype!s}" for path, t in found if "state" in path or "fp32" in path.lower()})
    return {"parameters": params, "gradients": grads, "optimizer_state": state}


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m megaformer.perf.fakecuda.session REQUEST.json``; writes the report to
    the request's ``report`` path; exit 0, or 3 with ``error`` and ``traceback`` in the report."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        request = json.load(f)
    try:
        report = run(request)
        code = 0
    except Exception as e:
        report = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        code = 3
    tmp = request["report"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, request["report"])
    sys.stdout.flush()
    os._exit(code)  # the fake process group and DeepSpeed's threads: no clean teardown to wait for


if __name__ == "__main__":
    main()
