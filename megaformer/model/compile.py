"""Regional compilation (``train.compile``): ``torch.compile`` each decoder block, not the whole model.

As torchtitan (``apply_compile``: one ``torch.compile`` per ``TransformerBlock``) and the PyTorch
recipe "regional compilation": the blocks are identical, so dynamo traces one block and every other
block reuses its graph (parameters are graph inputs, not constants); the compile time is one
block's, whatever the depth, and the rest of the model (embedding, vocabulary-parallel loss,
DeepSpeed's pipeline schedule and hooks) stays eager. Each block is compiled in place
(:meth:`torch.nn.Module.compile`), so parameter and checkpoint names do not change.

``dynamic=False``: shapes and Python numbers (the dropout probabilities, DeepNorm's α) are constants
of the graph, as a training run's are; a new value compiles another graph. (By default dynamo turns
a float that differs between two compilations of the same code, e.g. the dropout of two models in
one process, into a symbolic input, and the dropout scale, eager's float32 constant, cannot be
folded from it.)

``fullgraph=True``: a block that does not compile into one graph (a graph break) or that inductor
cannot build raises when it is compiled; that error is logged with its reason and every block then
runs eager, rather than the run stopping. Dropout inside the graph: see
:mod:`megaformer.parallel.rng_ops`.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megaformer.model.normformer import NormFormerBlock


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """``train.compile``: ``True`` / ``False`` as given; ``'auto'`` is on for CUDA, off elsewhere."""
    if isinstance(setting, bool):
        return setting
    return device.type == "cuda"


def why_not_compiled(device: torch.device, *, zero_stage: int = 0) -> str | None:
    """Why the blocks cannot be compiled here (a sentence for the log), or None when they can."""
    if zero_stage == 3:
        return (
            "ZeRO-3 gathers each parameter in hooks on every submodule, inside the block, and "
            "DeepSpeed marks them torch.compiler.disable (a graph break: 'Skip calling "
            "`torch.compiler.disable()`d function')"
        )
    if device.type == "cuda":
        if "megaformer.perf.fakecuda.runtime" in sys.modules:  # a dry run: tensors without values
            return "fake CUDA (a dry run) has no device for inductor's Triton kernels; a GPU run compiles"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "inductor needs Triton for CUDA kernels: pip install triton"
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "inductor's CPU backend needs a C++ compiler (g++ or clang++; none on PATH, CXX unset)"
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.isfile(header):
        return f"inductor's CPU backend needs the Python headers ({header} is missing: python3-dev)"
    return None


class _EagerOnCompileFailure:
    """A block's compiled call. If compiling fails (a graph break under ``fullgraph``, an inductor
    error), on the first call or on a later recompilation (eval mode, no_grad), every block goes
    back to eager, the call is rerun eager, and the reason is logged once. Errors of the code itself
    are not dynamo's exceptions and propagate."""

    def __init__(self, block: nn.Module, compiled: Callable, shared: dict, log: Callable[[str], None]):
        self.block, self.compiled, self.shared, self.log = block, compiled, shared, log

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            # Compiling precedes running, and dynamo applies a graph's side effects only after it
            # ran: nothing of this call has happened yet.
            lines = str(e).strip().splitlines()
            for block in self.shared["blocks"]:
                # reach-in: torch has no public way to undo Module.compile(); without the compiled
                # call, nn.Module.__call__ runs the eager forward
                block._compiled_call_impl = None
            self.log(f"train.compile: the blocks run eager; compiling failed: {type(e).__name__}: {lines[0]}")
            return self.block._call_impl(*args, **kwargs)


def compile_blocks(
    model: nn.Module, *, log: Callable[[str], None] = print, backend: str = "inductor", **options: Any
) -> int:
    """Compile every :class:`NormFormerBlock` of ``model`` (a ``NormFormerLM`` or a pipeline stage)
    in place, ``torch.compile(fullgraph=True, dynamic=False, backend=backend, **options)``; returns
    how many.

    A block's first call compiles it (and a call in a new mode, e.g. eval, compiles it again); a
    failure to compile (a graph break, a compiler error) is logged through ``log`` and from then
    on all blocks run eager, starting with that call."""
    blocks = [m for m in model.modules() if isinstance(m, NormFormerBlock)]
    shared = {"blocks": blocks}
    for block in blocks:
        block.compile(fullgraph=True, dynamic=False, backend=backend, **options)
        # reach-in: Module.compile() keeps its compiled call here and offers no hook around it
        block._compiled_call_impl = _EagerOnCompileFailure(block, block._compiled_call_impl, shared, log)
    return len(blocks)
