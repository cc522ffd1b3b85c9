"""What ``megaformer/training/ds_adapter.py`` relies on in DeepSpeed beyond its public API, checked on
the installed DeepSpeed's own source: a DeepSpeed that changes under the adapter fails here, naming
the behaviour, before a run meets it (``check_deepspeed_version`` refuses other versions at start-up;
this test is what tells a maintainer what to re-check when ``TESTED_DEEPSPEED`` moves).

Each case is one bullet of the adapter's module docstring.
"""

from __future__ import annotations

import inspect

import pytest

from megaformer.checkpoint import formats
from megaformer.training import ds_adapter


def _source(obj: object) -> str:
    """The source of ``obj``; of the function inside DeepSpeed's NVTX decorator (``wrapped_fn``)."""
    for cell in getattr(obj, "__closure__", None) or ():
        if getattr(obj, "__name__", "") == "wrapped_fn" and inspect.isfunction(cell.cell_contents):
            return inspect.getsource(cell.cell_contents)
    return inspect.getsource(obj)


def test_the_installed_deepspeed_is_the_tested_one():
    import deepspeed

    assert ds_adapter.check_deepspeed_version(deepspeed.__version__) == deepspeed.__version__


def test_the_moment_between_backward_and_step_is_take_model_step_on_both_engines():
    """``Engine.before_optimizer_step`` wraps ``_take_model_step``: the plain engine's ``step()`` and
    the pipeline engine's optimizer instruction must both go through it, once per update."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert list(inspect.signature(DeepSpeedEngine._take_model_step).parameters) == ["self", "lr_kwargs"]
    assert "self._take_model_step(" in _source(DeepSpeedEngine.step)
    assert "self._take_model_step(" in _source(PipelineEngine._exec_optimizer_step)


def test_pipeline_fp32_clipping_is_replaced_where_deepspeed_calls_it_and_its_norm_is_read():
    """The fp32 clipping the adapter replaces is called from ``_take_model_step``, and
    ``get_global_grad_norm`` returns the ``_global_grad_norm`` it records."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "self.clip_fp32_gradients()" in _source(DeepSpeedEngine._take_model_step)
    assert "_global_grad_norm" in _source(DeepSpeedEngine.get_global_grad_norm)


def test_sequence_parallel_reduction_precedes_allreduce_gradients_at_the_boundary():
    """The SP gradient sum goes before ``allreduce_gradients``, which acts at the accumulation
    boundary: at pp = 1 the loop calls it after ``backward``, which skips it when the engine's
    ``enable_backward_allreduce`` is off (and managed accumulation's ``step()`` does not call it);
    the pipeline engine's reduce-gradients instruction calls it (wrapped there). The optimizer types
    the adapter excludes are still where it imports them."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: F401
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    # The reduction is in _backward_epilogue, after every micro-batch's backward, behind the switch;
    # allreduce_gradients itself acts at the boundary only.
    epilogue = _source(DeepSpeedEngine._backward_epilogue)
    assert "if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:" in epilogue
    assert "self.allreduce_gradients()" in epilogue
    assert "is_gradient_accumulation_boundary" in _source(DeepSpeedEngine.allreduce_gradients)
    # step() reduces only without managed accumulation (which megaformer never turns off), before
    # its _take_model_step.
    step = _source(DeepSpeedEngine.step)
    assert step.index("if not self.managed_gradient_accumulation():") < step.index(
        "self.allreduce_gradients()"
    )
    assert "self.allreduce_gradients(" in _source(PipelineEngine._exec_reduce_grads)


def test_the_fp16_give_up_message_and_loss_scale_readers():
    """fp16's give-up at the minimum scale is recognised by its message; the loss scale and skipped
    steps are read from the engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    assert ds_adapter._MIN_SCALE_MESSAGE in _source(DynamicLossScaler)
    assert callable(DeepSpeedEngine._get_optimizer_loss_scale)
    assert "self.skipped_steps" in _source(DeepSpeedEngine.__init__)


def test_the_shared_memory_collective_switch_and_the_pipeline_instruction_table():
    import deepspeed.ops
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert isinstance(deepspeed.ops.__compatible_ops__, dict)
    table = PipelineEngine._INSTRUCTION_MAP
    for instruction in (
        schedule.ForwardPass,
        schedule.BackwardPass,
        schedule.OptimizerStep,
        schedule.RecvGrad,
    ):
        assert instruction in table, instruction.__name__


@pytest.mark.parametrize("cls", formats.checkpoint_data_classes(), ids=lambda c: c.__name__)
def test_checkpoint_data_classes_still_exist_where_checkpoints_name_them(cls):
    import importlib

    assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls


def test_checkpoint_data_class_names_are_the_classes_names():
    """The names safe_load allows without importing DeepSpeed are the classes' own (issue 39: tools
    that only read weights do not import DeepSpeed)."""
    names = tuple(f"{c.__module__}.{c.__qualname__}" for c in formats.checkpoint_data_classes())
    assert names == formats.CHECKPOINT_DATA_CLASS_NAMES
