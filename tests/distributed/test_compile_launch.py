"""train.compile in multi-process runs through the DeepSpeed engine (issue 19): a run whose blocks are
compiled (inductor's C++ backend, 2 processes on gloo) repeats the eager run step for step, with
dropout on, at TP = 2 with sequence parallelism, ZeRO-1 and full recomputation (DeepSpeed's
checkpoint around each compiled block, the dropout states replayed), evaluation included, the
cross-entropy fused; under ZeRO-3 the run says why its blocks stay eager (its loss is fused)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import SMALL_VOCAB, read_scalars, run_ranks

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks); each rank compiles the block

CONFIG = "configs/normformer-quickstart.yaml"
TINY = [
    *SMALL_VOCAB,  # the test tier's 500-entry BPE of the novels (conftest's small_vocab_prefix)
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.seq_len=64",
    "model.resid_scale=true",
    "model.qkv_ln=true",  # every switch on
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "parallel.tp_size=2",
    "parallel.sequence_parallel=true",
    "train.zero_stage=1",
    "train.recompute=full",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.steps=6",
    "train.log_interval=1",
    "train.eval_interval=6",
    "train.eval_batches=1",
    "train.save_interval=0",
    "data.valid_fraction=0.02",
]


def _run(tmp_path, small_vocab_prefix, name: str, extra: list[str]):
    out = tmp_path / name
    proc = run_ranks(CONFIG, [*TINY, *extra, f"data.prefix={small_vocab_prefix}", f"output.dir={out}"])
    assert proc.returncode == 0, (
        f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return read_scalars(str(out / "tensorboard")), proc.stdout


def test_compiled_run_repeats_the_eager_run(tmp_path, small_vocab_prefix):
    eager, _ = _run(tmp_path, small_vocab_prefix, "eager", ["train.compile=false"])
    compiled, log = _run(tmp_path, small_vocab_prefix, "compiled", ["train.compile=true"])
    assert "train.compile=True: 2 blocks compiled with inductor" in log and "run eager" not in log, log[
        -3000:
    ]
    # the loss too: vocab_parallel_cross_entropy(fused=True) between the TP all-reduces
    assert "train.compile=True: the cross-entropy runs as two fused kernels" in log
    for tag in ("train/loss", "train/grad_norm", "valid/loss"):
        assert compiled[tag].keys() == eager[tag].keys()
        for step, want in eager[tag].items():
            assert abs(compiled[tag][step] - want) <= 1e-5 * abs(want), (tag, step, compiled[tag][step], want)


def test_zero3_runs_eager_and_says_why(tmp_path, small_vocab_prefix):
    extra = [
        "train.compile=true",
        "parallel.tp_size=1",
        "parallel.sequence_parallel=false",
        "train.zero_stage=3",
    ]
    _, log = _run(tmp_path, small_vocab_prefix, "zero3", [*extra, "train.recompute=none", "train.steps=2"])
    assert "train.compile=True: the blocks run eager: ZeRO-3 gathers each parameter" in log, log[-3000:]
    assert "the cross-entropy runs as two fused kernels" in log  # no ZeRO-3 hooks inside the loss
