"""``bf16.immediate_grad_update`` (the bf16 recipes' DeepSpeed JSONs set it) changes no number.

With it, DeepSpeed 0.19's ``BF16_Optimizer`` adds each parameter's bf16 gradient into its fp32
accumulation buffer from a post-accumulate-grad hook during backward and frees the bf16 gradient;
without it, one pass after each micro-batch's backward does the same addition and the bf16
gradients stay allocated (2 bytes per parameter: ``megaformer.perf.plan`` counts the difference).
Here both run as multi-process runs on real text in bf16 with fp32 accumulation at ZeRO-1 and two
micro-batches per step, in the layouts where megaformer's own gradient work meets DeepSpeed's:
tp 2 with sequence parallelism × dp 2 (the sequence-parallel gradients' TP all-reduce in backward,
the data-parallel reduction of the fp32 buffers, per-layer diagnostics through
``safe_get_full_grad``) and pp 2 (the pipeline engine's own accumulation and its tied-embedding
gradient sum). Every logged loss, gradient norm and diagnostic must be bitwise the same.

And the 1.3B / 2.7B recipes' ZeRO-2 with the same JSON (fp32 accumulation in DeepSpeed's ZeRO
optimizer, each micro-batch's gradients reduced during backward: the step-time model predicts it
faster across nodes, BENCHMARKS.md) follows the BF16 optimizer's run.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import SMALL_VOCAB, read_scalars, run_ranks

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks): outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
TINY = [
    *SMALL_VOCAB,  # the test tier's 500-entry BPE of the novels (conftest's small_vocab_prefix)
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.seq_len=64",
    "model.resid_scale=true",  # every NormFormer switch on
    "model.hidden_dropout=0.1",
    "train.precision=bf16",
    "train.zero_stage=1",
    "train.micro_batch_size=2",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.steps=8",
    "train.log_interval=1",
    "train.diagnostics_interval=4",
    "train.eval_interval=8",
    "train.eval_batches=1",
    "train.save_interval=0",
    "data.valid_fraction=0.02",
]
LAYOUTS = {  # name: (processes, overrides); each gets 2 micro-batches per step
    "tp2_sp_dp2": (4, ["parallel.tp_size=2", "parallel.sequence_parallel=true", "train.global_batch_size=8"]),
    "pp2": (2, ["parallel.pp_size=2", "train.global_batch_size=4"]),
}


def _engine_json(tmp_path, immediate: bool) -> str:
    path = tmp_path / f"bf16-immediate-{str(immediate).lower()}.json"
    path.write_text(
        json.dumps({"data_types": {"grad_accum_dtype": "fp32"}, "bf16": {"immediate_grad_update": immediate}})
    )
    return str(path)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_immediate_grad_update_gives_the_same_run(layout, small_vocab_prefix, tmp_path):
    nproc, extra = LAYOUTS[layout]
    scalars = {}
    for immediate in (False, True):
        run_dir = tmp_path / f"immediate-{immediate}"
        proc = run_ranks(
            CONFIG,
            [
                *TINY,
                *extra,
                f"train.deepspeed_config={_engine_json(tmp_path, immediate)}",
                f"data.prefix={small_vocab_prefix}",
                f"output.dir={run_dir}",
            ],
            nproc=nproc,
        )
        assert proc.returncode == 0, f"{layout} {immediate}: {proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        # The setting took effect: DeepSpeed's BF16 optimizer, with or without the hooks.
        want = "BF16_Optimizer (immediate_grad_update)" if immediate else "BF16_Optimizer\n"
        assert f"DeepSpeed optimizer {want}" in proc.stdout, proc.stdout[-3000:]
        scalars[immediate] = read_scalars(str(run_dir / "tensorboard"))
    off, on = scalars[False], scalars[True]
    assert sorted(off["train/loss"]) == list(range(1, 9))
    diag = [tag for tag in off if tag.startswith(("grads/", "scales/"))]
    assert any(tag.startswith("grads/l2/") for tag in diag), sorted(off)  # the diagnostics ran
    for tag in ["train/loss", "train/grad_norm", "valid/loss", *diag]:
        assert on[tag] == off[tag], (layout, tag)  # bitwise: the same additions in the same order
    assert off["train/loss"][8] < off["train/loss"][1] - 0.5  # it trains


def test_bf16_zero2_with_fp32_accumulation_follows_the_bf16_optimizer(small_vocab_prefix, tmp_path):
    """The multi-node bf16 recipes' ZeRO-2 (DeepSpeed's ZeRO optimizer with the same JSON: each
    micro-batch's gradients reduced during backward and added into an fp32 partition) against ZeRO-1 (the BF16
    optimizer: one reduction after the last backward), dp 2 with 2 micro-batches per step: the same
    run up to where the bf16 communication rounds (each micro-batch's reduction against the step's).
    Seen, relative: losses within 2e-5 and gradient norms within 4e-4 on an Intel Xeon VM; losses
    within 1.1e-4 (step 4) and gradient norms within 6.7e-4 on an AMD EPYC VM with AVX-512 BF16
    (2026-12-07), whose bf16 arithmetic rounds differently: the loss bound is 3e-4, under a tenth of
    bf16's 2^-8 spacing. The bound still tells a wrong run: the same ZeRO-2 run with one
    micro-batch per step (half the step's samples, as a dropped micro-batch would give) lies
    2e-3 to 3e-2 away at every step there, and must fall outside it at every step here."""
    scalars = {}
    for zero, batch in ((1, 8), (2, 8), (2, 4)):
        run_dir = tmp_path / f"zero{zero}-batch{batch}"
        proc = run_ranks(
            CONFIG,
            [
                *TINY,
                f"train.global_batch_size={batch}",
                f"train.zero_stage={zero}",
                "train.deepspeed_config=configs/deepspeed/paper-bf16-a100.json",
                f"data.prefix={small_vocab_prefix}",
                f"output.dir={run_dir}",
            ],
            nproc=2,
        )
        assert proc.returncode == 0, f"zero {zero}: {proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        want = "BF16_Optimizer (immediate_grad_update)" if zero == 1 else "DeepSpeedZeroOptimizer"
        assert "| dp 2 |" in proc.stdout and f"ZeRO {zero} | DeepSpeed optimizer {want}" in proc.stdout
        scalars[zero, batch] = read_scalars(str(run_dir / "tensorboard"))
    one, two, half = scalars[1, 8], scalars[2, 8], scalars[2, 4]
    for step in range(1, 9):
        assert two["train/loss"][step] == pytest.approx(one["train/loss"][step], rel=3e-4), step
        assert half["train/loss"][step] != pytest.approx(one["train/loss"][step], rel=3e-4), step
        assert two["train/grad_norm"][step] == pytest.approx(one["train/grad_norm"][step], rel=3e-3), step
    assert two["valid/loss"][8] == pytest.approx(one["valid/loss"][8], rel=1e-4)
    assert one["train/loss"][8] < one["train/loss"][1] - 0.5  # it trains
