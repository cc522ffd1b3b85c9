"""On one GPU: bf16 and fp16 training through the launcher (the loss falls; fp16's loss scale moves),
every ZeRO stage × recompute choice that fits one GPU, flash attention chosen in bf16, the
sharded LayerNorm compiled (fused by Inductor) against an fp64 reference, fused AdamW."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import load_config
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM
from megaformer.parallel import sharded_layer_norm
from tests.distributed.conftest import read_scalars, run_pretrain

pytestmark = pytest.mark.gpu

CONFIG = "configs/normformer-quickstart.yaml"
SMALL = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_attention_heads=4",
    "model.seq_len=256",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr=1e-3",
    "train.warmup_steps=5",
    "train.log_interval=1",
    "train.eval_interval=1000",
    "train.eval_batches=1",
    "train.save_interval=0",
    "train.deepspeed_config=",
    "data.valid_fraction=0.1",  # 236 held-out documents: 53 samples of 257 tokens
]


def _train(prefix, out, extra, steps=40):
    proc = run_pretrain(
        CONFIG,
        [*SMALL, f"train.steps={steps}", f"data.prefix={prefix}", f"output.dir={out}", *extra],
        nproc=1,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_scalars(str(out / "tensorboard"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_training_on_one_gpu_lowers_the_loss(precision, gutenberg_prefix, tmp_path):
    extra = [f"train.precision={precision}", "train.zero_stage=1"]
    if precision == "fp16":  # start at 2^32 (overflows, the scaler halves it), grow back every 10 steps
        engine = tmp_path / "fp16.json"
        engine.write_text(
            json.dumps({"fp16": {"loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 10}})
        )
        extra.append(f"train.deepspeed_config={engine}")
    scalars = _train(gutenberg_prefix, tmp_path, extra)
    loss = scalars["train/loss"]
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(36, 41)) / 5
    assert last < first - 1.0, (first, last)
    if precision == "fp16":  # dynamic loss scaling: down after overflows, up after 10 clean steps
        scale = [scalars["train/loss_scale"][s] for s in sorted(scalars["train/loss_scale"])]
        steps = list(itertools.pairwise(scale))
        assert any(b < a for a, b in steps) and any(b > a for a, b in steps), scale


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_every_one_gpu_layout_trains(zero, recompute, gutenberg_prefix, tmp_path):
    scalars = _train(
        gutenberg_prefix,
        tmp_path,
        ["train.precision=bf16", f"train.zero_stage={zero}", f"train.recompute={recompute}"],
        10,
    )
    assert sorted(scalars["train/loss"]) == list(range(1, 11))
    assert scalars["train/loss"][10] < scalars["train/loss"][1]


def test_flash_attention_is_chosen_in_bf16():
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, num_layers=1, num_attention_heads=4, seq_len=512)
    model = NormFormerLM(cfg).cuda().to(torch.bfloat16).train()
    tokens = torch.randint(0, 1000, (2, 512), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(tokens, tokens).backward()
        torch.cuda.synchronize()
    names = {e.name.lower() for e in prof.events()}
    assert any("flash" in n for n in names), sorted(n for n in names if "attention" in n or "fmha" in n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_sharded_layer_norm_against_fp64(dtype):
    n = 4096
    x = (3000 + torch.randn(16, 256, n, device="cuda")).to(dtype)
    w = 1 + 0.5 * torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    fused = torch.compile(
        lambda x, w, b: sharded_layer_norm(x, w, b, normalized_size=n, eps=1e-5, tp_group=None)
    )
    exact = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    ours = (fused(x, w, b).double() - exact).abs().max()
    torch_err = (F.layer_norm(x, (n,), w.to(dtype), b.to(dtype), 1e-5).double() - exact).abs().max()
    assert ours <= 10 * torch_err, (float(ours), float(torch_err))


def test_adamw_is_fused_on_cuda():
    from megaformer.training.builders import build_optimizer

    cfg = load_config(CONFIG, SMALL)
    model = NormFormerLM(cfg.model).cuda()
    optimizer, _ = build_optimizer(model, cfg, 0)
    assert optimizer.defaults["fused"] is True


def test_dropout_states_are_cuda_philox_states_and_follow_the_model():
    """``cuda_philox_state`` is what CUDA's generator reports (fake-CUDA runs rely on the format),
    and a DropoutRNG built for the CPU, then used on CUDA tensors, draws from CUDA's generator."""
    from megaformer.parallel.rng import DropoutRNG, cuda_philox_state

    for seed in (0, 7, 2**40 + 3):
        assert torch.equal(
            torch.Generator(device="cuda").manual_seed(seed).get_state(), cuda_philox_state(seed)
        )
    rng = DropoutRNG(5)
    x = torch.ones(64, 64, device="cuda")
    with rng.fork("sharded", x.device):
        a = F.dropout(x, 0.5)
    again = DropoutRNG(5, device="cuda")
    with again.fork("sharded", x.device):
        b = F.dropout(x, 0.5)
    assert torch.equal(a, b)


def test_fused_cross_entropy_on_cuda_follows_the_unfused_one():
    """The loss as two Triton kernels (``fused=True``, what compiled runs use) against the unfused
    passes over an fp32 copy, at the 125M recipe's vocabulary (50,304 padded, 50,257 real)."""
    from megaformer.parallel import layers, vocab_parallel_cross_entropy

    vocab, padded = 50257, 50304
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(4, 512, padded, device="cuda", generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (4, 512), device="cuda", generator=gen)
    out = {}
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, labels, None, vocab, fused=fused)
        loss.mean().backward()
        out[fused] = (loss, x.grad)
    assert layers._FUSED.failed is None
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[True][1].float(), out[False][1].float(), rtol=1e-2, atol=1e-7)
    assert torch.all(out[True][1][..., vocab:] == 0)


@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_keeps_the_parameters_aligned_on_cuda(zero):
    """The 125M NormFormer's parameters stay 16-byte aligned in DeepSpeed's flat bf16 buffers on
    CUDA (the H200 run of 2026-11-26 found half of them 8 bytes off: sm80 CUTLASS GEMMs)."""
    from tests.distributed.test_param_alignment import run_alignment

    params = run_alignment(zero, "aligned", ["model.num_layers=4"], cpu=False)["params"]
    off = [p["name"] for p in params if p["numel"] % 16 == 0 and p["offset_mod_16"]]
    assert not off, off
