"""The masked LM (model.objective=mlm) as multi-process runs on real text at five layouts, all from
the same seed and samples: one process (2 micro-batches of 4 per step), tp = 2, pp = 2 (2 pipeline
micro-batches), dp = 2 (one micro-batch per rank) and pp = 2 with the LM head decoding the masked
positions only (model.mlm_head_positions masked). Each repeats the one-process run step for step
within 1e-4 relative: the training loss (fairseq's Σ NLL / N over the step's masked tokens, whose
count differs between micro-batches and ranks, so a mean of means would not agree), the gradient
norm and the masked-token validation loss (the quickstart has no dropout: its masks would be
per-rank draws)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import read_scalars, run_ranks

pytestmark = pytest.mark.slow  # multi-process training runs (run_ranks): outside `scripts/check.sh --fast`

CONFIG = "configs/mlm-quickstart.yaml"
TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.steps=8",
    "train.log_interval=1",
    "train.eval_interval=8",
    "train.eval_batches=2",
    "train.save_interval=100",
    "train.zero_stage=0",
    "data.valid_fraction=0.02",
]
STEPS = range(1, 9)
RUNS = {  # name: (processes, overrides)
    "one": (1, []),
    "tp2": (2, ["parallel.tp_size=2"]),
    "pp2": (2, ["parallel.pp_size=2"]),
    "dp2": (2, []),
    # fairseq's head: the decoder at the masked positions only, on the last pipeline stage, against
    # the one-process run that decodes every position (the default).
    "pp2_masked": (2, ["parallel.pp_size=2", "model.mlm_head_positions=masked"]),
}


@pytest.fixture(scope="module")
def runs(gutenberg_prefix, tmp_path_factory):
    out = {}
    for name, (nproc, extra) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(f"mlm_{name}")
        proc = run_ranks(
            CONFIG, [*TINY, *extra, f"data.prefix={gutenberg_prefix}", f"output.dir={run_dir}"], nproc=nproc
        )
        assert proc.returncode == 0, (
            f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
        out[name] = (proc, read_scalars(str(run_dir / "tensorboard")), run_dir)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2", "pp2_masked"])
def test_layout_repeats_one_process_step_for_step(runs, name):
    ref, (proc, got, _) = runs["one"][1], runs[name]
    pp2 = "| pp 2 (parameters) | dp 1 |"
    layout = {"tp2": "| tp 2 |", "pp2": pp2, "dp2": "| dp 2 |", "pp2_masked": pp2}[name]
    assert layout in proc.stdout, proc.stdout[-2000:]
    assert sorted(got["train/loss"]) == list(STEPS)
    for step in STEPS:
        assert _rel(got["train/loss"][step], ref["train/loss"][step]) <= 1e-4, (name, step)
        assert _rel(got["train/grad_norm"][step], ref["train/grad_norm"][step]) <= 1e-4, (name, step)
    assert _rel(got["valid/loss"][8], ref["valid/loss"][8]) <= 1e-4
    loss = ref["train/loss"]
    assert loss[8] < loss[1] - 0.5, loss  # it trains: not a comparison of two stuck runs


def test_pipeline_checkpoint_holds_the_trained_head(runs):
    """The tied head is saved by the first stage (DeepSpeed writes a tied module where it first
    appears): its copy must be the trained one, equal to the one-process run's weights."""
    from megaformer.checkpoint.reshard import consolidate

    ref, _, _ = consolidate(str(runs["one"][2] / "checkpoints" / "global_step8"))
    got, _, _ = consolidate(str(runs["pp2"][2] / "checkpoints" / "global_step8"))
    assert sorted(got) == sorted(ref)
    head = [name for name in ref if ".lm_head." in name]
    assert len(head) == 5, head
    for name in ref:
        a, b = got[name].float(), ref[name].float()
        if name.endswith(".qkv.bias"):
            # The key bias gets no gradient in exact arithmetic (it adds q·b_k to every score of a
            # query, which softmax ignores): what it receives is rounding noise, which Adam scales
            # up to steps of ~lr. The layouts' kernels round differently (on a CPU with AMX the
            # copies end ~1.3e-5 apart), so the key slice (layout: heads, [q, k, v], head_dim) only
            # has to stay near the other copy; the query and value biases are held as tightly as
            # the rest.
            a, b = a.view(2, 3, -1), b.view(2, 3, -1)  # TINY's model.num_attention_heads=2
            assert torch.allclose(a[:, 1], b[:, 1], rtol=0, atol=1e-4), name
            a, b = a[:, 0::2], b[:, 0::2]
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), name
    # and it trained: the head's LayerNorm gain left its init of ones
    gain = ref["tied_modules.embed.lm_head.layer_norm.weight"].float()
    assert (gain - 1).abs().max() > 1e-3


def test_trained_pipeline_checkpoint_exports_to_hugging_face(runs, tmp_path, monkeypatch):
    """export_hf on the pp = 2 run's checkpoint: transformers' AutoModelForMaskedLM gives the logits
    of megaformer's model built from the same checkpoint, and fill-mask ranks them alike."""
    import transformers

    from megaformer.checkpoint.reshard import consolidate
    from megaformer.config.schema import ModelConfig
    from megaformer.data.mlm import MASK_ID
    from megaformer.model import NormFormerLM
    from megaformer.tools.export_hf import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = runs["pp2"][2] / "checkpoints"
    assert main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    full, run_config, _ = consolidate(str(ckpt / "global_step8"))
    config = ModelConfig(**run_config["model"])
    model = NormFormerLM(config).eval()
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in full.items():
            own[name][: tensor.shape[0]].copy_(tensor)
    pipe = transformers.pipeline(
        "fill-mask", model=str(tmp_path / "hf"), trust_remote_code=True, device="cpu"
    )
    ids = pipe.tokenizer("It is a truth universally<mask> that a single man.")["input_ids"]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        ours = model(tokens)[..., : config.vocab_size]
        theirs = pipe.model(tokens).logits
    assert (theirs - ours).abs().max().item() < 1e-4
    top = torch.topk(ours[0, ids.index(MASK_ID)], 3).indices.tolist()
    assert [p["token"] for p in pipe("It is a truth universally<mask> that a single man.", top_k=3)] == top
