"""Every collective megaformer issues gets tensors on its group's communication device.

NCCL refuses CPU tensors (``No backend type associated with device type cpu``), gloo takes them, so
a CPU suite cannot see a counter or a norm built on the CPU and all-reduced over an NCCL group: that
bug stopped every GPU pipeline run at start-up. This test makes the mistake visible on CPU:

* the code paths that communicate run with the default device set to ``meta``
  (``with torch.device("meta")``): a tensor built without an explicit device (``torch.tensor(x)``)
  lands on ``meta``, as it lands on the CPU on a GPU machine; the model and its inputs are built
  outside, on the CPU, as they would be on the GPU;
* every ``torch.distributed`` collective is wrapped by a spy that checks each tensor handed to it is
  on ``comm_device(group)`` (the CPU for gloo), and names the collective and the device otherwise.

Paths covered, in spawned gloo processes: the parameter count over pipeline stages, the pipeline
engine's fp32 clipping and its norm, the TP-aware gradient norm, the data-parallel loss mean, the
integer all-reduce of the checkpoint bookkeeping, a TP = 2 NormFormer forward and backward
(every tensor-parallel layer, the vocabulary-parallel cross-entropy, sequence parallelism), and the
per-layer gradient norms, learned-scale means and parameter norm of the training diagnostics.
The code before this test existed (``_count_parameters``, ``_pipeline_fp32_clipping`` building CPU
tensors) fails it.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaformer.config.schema import ModelConfig
from tests.distributed.conftest import free_port

TINY = ModelConfig(
    vocab_size=300,
    make_vocab_size_divisible_by=8,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    seq_len=16,
    resid_scale=True,
)

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
)


class WrongDeviceError(AssertionError):
    pass


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


@contextlib.contextmanager
def strict_collectives(seen: list[str]):
    """Default device ``meta``; every collective's tensors checked against ``comm_device(group)``."""
    from megaformer.parallel.comm import comm_device

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def spy(name):
        original = originals[name]

        def checked(*args, **kwargs):
            group = kwargs.get("group")
            expected = comm_device(group)
            for t in [*_tensors(args), *_tensors(list(kwargs.values()))]:
                if t.device != expected:
                    raise WrongDeviceError(
                        f"dist.{name} got a tensor on {t.device}; its group's backend takes {expected} "
                        "tensors: build it on comm_device(group)"
                    )
            seen.append(name)
            return original(*args, **kwargs)

        return checked

    for name in COLLECTIVES:
        setattr(dist, name, spy(name))
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _layout(tp: int, pp: int, dp: int):
    from megaformer.parallel.layout import Layout
    from megaformer.parallel.state import ParallelState

    state = ParallelState.build(tp, pp, dp)
    return Layout(dist.get_rank(), dist.get_world_size(), 0, "gloo", torch.device("cpu"), state)


def _check_pipeline_count_and_clipping() -> None:
    """pp = 2: the parameter count over stages, and the fp32 pipeline clipping with its norm."""
    from megaformer.model import NormFormerLM, count_parameters
    from megaformer.pipeline import build_pipeline_module, pipe_topology
    from megaformer.training.builders import count_parameters_global
    from megaformer.training.ds_adapter import _install_pipeline_fp32_clipping

    layout = _layout(1, 2, 1)
    stage = build_pipeline_module(TINY, topology=pipe_topology(layout.state), tp_group=None, seed=1)
    seen: list[str] = []
    with strict_collectives(seen):
        total = count_parameters_global(stage, layout)
    assert "all_reduce" in seen
    assert total == count_parameters(NormFormerLM(TINY, seed=1))

    for i, p in enumerate(stage.parameters()):
        p.grad = torch.full_like(p, 0.01 * (i + 1))

    class _Engine:  # the two calls the clipping makes on DeepSpeed's engine
        module = stage
        _global_grad_norm = None

        def gradient_clipping(self):
            return 1e-3

    engine = _Engine()
    _install_pipeline_fp32_clipping(engine, layout.state)
    seen.clear()
    with strict_collectives(seen):
        engine.clip_fp32_gradients()
    assert seen == ["all_reduce"]
    assert engine._global_grad_norm.device.type == "cpu" and float(engine._global_grad_norm) > 1e-3


def _check_tp_model_and_norms() -> None:
    """tp = 2: a NormFormer forward and backward (with and without sequence parallelism), the
    TP-aware gradient norm, the data-parallel mean and the integer all-reduce."""
    from megaformer.model import NormFormerLM
    from megaformer.parallel.comm import all_reduce_ints, mean_over_group
    from megaformer.parallel.utils import grad_norm_squared
    from megaformer.training.diagnostics import LayerDiagnostics, param_norm_squared

    layout = _layout(2, 1, 1)
    group = layout.state.tp_group
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    for sp in (False, True):
        model = NormFormerLM(TINY, tp_group=group, seed=2, sequence_parallel=sp)
        seen: list[str] = []
        with strict_collectives(seen):
            loss = model(tokens, tokens)
            loss.backward()
            norm = grad_norm_squared(model.parameters(), group)
        assert {"all_reduce"} <= set(seen) and norm.device.type == "cpu" and float(norm) > 0
        # the per-layer diagnostics, the learned scales and the parameter norm (.diagnostics)
        diag = LayerDiagnostics(model, TINY, layout.state)
        seen.clear()
        with strict_collectives(seen):
            diag.collect_grads()
            grads, means = diag.grad_scalars(), diag.scale_means()
            param_norm = param_norm_squared(model, layout.state)
        assert seen == ["all_reduce"] * 3 and param_norm.device.type == "cpu"
        assert all(v.device.type == "cpu" for v in [*grads.values(), *means.values()])
        hists = diag.scale_histograms()  # whole parameters: TP shards concatenated
        assert len(hists) == 4 * TINY.num_layers  # post_attn_ln, ffn_ln, head_scale, resid_scale
        assert hists["scales/head_scale/layer_00"].numel() == TINY.num_attention_heads
        assert hists["scales/ffn_ln/layer_01"].numel() == TINY.ffn_size
        assert hists["scales/resid_scale/layer_01"].numel() == TINY.hidden_size
    dp_layout = _layout(1, 1, 2)
    seen = []
    with strict_collectives(seen):
        mean = mean_over_group(
            torch.tensor(float(dist.get_rank()), device="cpu"), dp_layout.state.dp_group, 2
        )
        counts = all_reduce_ints([1, dist.get_rank()])
    assert float(mean) == 0.5 and counts == [2, 1] and seen == ["all_reduce", "all_reduce"]


def _worker(rank: int, world_size: int, port: int, check: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    from megaformer.training.ds_adapter import init_distributed

    init_distributed("gloo")  # DeepSpeed's comm too: the pipeline module asks it for ranks
    try:
        {"pipeline": _check_pipeline_count_and_clipping, "tp": _check_tp_model_and_norms}[check]()
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks build and step a model (7-9 s on 2 cores): outside `--fast`
@pytest.mark.parametrize("check", ["pipeline", "tp"])
def test_collectives_get_tensors_on_the_communication_device(check):
    mp.spawn(_worker, args=(2, free_port(), check), nprocs=2, join=True)


def test_the_spy_catches_a_tensor_built_without_a_device():
    """The harness itself: ``torch.tensor(x)`` inside it is refused before it reaches the backend."""
    seen: list[str] = []
    with pytest.raises(WrongDeviceError, match="got a tensor on meta"), strict_collectives(seen):
        # Deliberately built without a device: the mistake the harness exists to catch.
        dist.all_reduce(torch.tensor([1]))
