"""train.compile (issue 19): each decoder block compiled with inductor (C++ on this CPU) computes what
the eager block computes, for every normalisation scheme, with dropout on.

What is bitwise and what is not, in fp32:

* bitwise: the dropout masks (the compiled graph draws them from the same generator states with the
  same kernels, through ``megaformer::dropout_keep``), the generator states after every step, the
  dropout product alone (``x * keep * scale`` is eager's ``x * noise``, fp32 and bf16), and the GPU
  attention operator ``megaformer::attention_dropout`` (eager's own call inside; run here on the CPU);
* within fp32 rounding: the block's output and gradients, and the CPU attention with dropout (ATen's
  math kernel written out in the graph). Inductor fuses and reorders the reductions (LayerNorm
  statistics, softmax, the sums of backward) and the products it fuses, so results differ in the
  last bits: measured at most 7.2e-7 of each tensor's largest magnitude (6 ulps) over the four
  schemes. The tolerance, 1e-5 of the largest magnitude, is 10x that and far below what a wrong
  mask would give (one element dropped or kept differently changes the output by a unit of its own
  size, i.e. O(1e-1) relative).

The block-level comparisons compile a block's forward and backward with inductor (about 20 s for the
first on 2 cores, the C++ toolchain's warm-up included): they are in the slow tier.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import ConfigError, load_config
from megaformer.model import NormFormerLM, compile_blocks, compile_wanted, why_not_compiled
from megaformer.model.normformer import NormFormerBlock
from megaformer.parallel.rng import DropoutRNG
from megaformer.pipeline import checkpointed
from tests.tiny_model import TINY_MODEL

torch.set_num_threads(1)

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
SCHEMES = {  # every normalisation scheme, NormFormer with every switch on
    "normformer": dict(resid_scale=True, qkv_ln=True),
    "pre_ln": dict(post_attn_ln=False, head_scale=False, ffn_ln=False),
    "post_ln": dict(norm_scheme="post_ln", post_attn_ln=False, head_scale=False, ffn_ln=False),
    "deepnorm": dict(norm_scheme="deepnorm", post_attn_ln=False, head_scale=False, ffn_ln=False),
}
REL_TOL = 1e-5  # of the largest magnitude of each tensor (see the module docstring)


@pytest.fixture(autouse=True)
def _fresh_dynamo_cache():
    """Each test compiles from an empty cache: graphs that other test files compiled in this
    process (other shapes and configs of the same block code) would count against dynamo's
    recompile limit of 8 per code object, which fullgraph=True turns into a failure."""
    torch._dynamo.reset()
    yield


def _assert_close_rel(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = float(want.abs().max().clamp_min(1e-30))
    assert float((got - want).abs().max()) <= REL_TOL * scale, (float((got - want).abs().max()), scale)


def _run_block(config, compiled: bool) -> tuple[list[torch.Tensor], dict]:
    """Two training micro-batches through one block: [outputs, input grads, parameter grads], states."""
    rng = DropoutRNG(5)
    block = NormFormerBlock(config, 0, None, seed=3, dropout_rng=rng).train()
    if compiled:
        assert compile_blocks(block, log=pytest.fail) == 1
    g = torch.Generator().manual_seed(0)
    results = []
    for _ in range(2):  # the second draws from the states the first left
        x = torch.randn(2, 16, config.hidden_size, generator=g, requires_grad=True)
        y = block(x)
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        results += [y.detach(), x.grad]
    return results + [p.grad for p in block.parameters()], rng.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compiled_block_equals_eager_with_dropout(scheme):
    config = dataclasses.replace(TINY_MODEL, **DROPOUT, **SCHEMES[scheme])
    eager, eager_states = _run_block(config, compiled=False)
    compiled, compiled_states = _run_block(config, compiled=True)
    for region in eager_states:
        assert torch.equal(compiled_states[region], eager_states[region])  # the same draws
    for got, want in zip(compiled, eager, strict=True):
        _assert_close_rel(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_under_compile_is_eager_bitwise(dtype):
    """x * keep * scale, compiled by inductor, gives eager F.dropout's bits in fp32 and bf16, in both
    regions, and leaves the states where eager leaves them. (Fused with a neighbour in bf16, e.g.
    ``(x + 1) * keep * scale``, inductor skips eager's rounding of ``x + 1`` to bf16: close, not equal.)"""
    x, y = torch.randn(2, 4, 8, 32, generator=torch.Generator().manual_seed(1)).to(dtype)

    def draw(rng: DropoutRNG, x, y):
        return [rng.dropout(x, 0.1, "replicated"), rng.dropout(y, 0.3, "sharded")]

    eager_rng, compiled_rng = DropoutRNG(7, tp_rank=1), DropoutRNG(7, tp_rank=1)
    eager = draw(eager_rng, x, y)
    compiled = torch.compile(draw, fullgraph=True)(compiled_rng, x, y)
    for got, want in zip(compiled, eager, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)
    for region, state in eager_rng.state_dict().items():
        assert torch.equal(compiled_rng.state_dict()[region], state)


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_attention_dropout_on_cpu_equals_eager(recompute):
    """On a CPU the compiled attention with dropout is ATen's math kernel in the graph with the mask
    eager draws (the same state after it); with recompute only q, k, v and the state are kept and
    backward draws the mask again. Outputs and gradients within fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, 4, 16, 8, generator=gen))
    grad = torch.randn(2, 4, 16, 8, generator=gen)

    def core(rng, q, k, v):
        return rng.attention(q, k, v, 0.3, "sharded", is_causal=True, recompute=recompute)

    results = []
    for fn in (core, torch.compile(core, fullgraph=True)):
        rng = DropoutRNG(9)
        out = fn(rng, q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad), rng.state_dict()["sharded"]])
    (*want, want_state), (*got, got_state) = results
    assert torch.equal(got_state, want_state)
    for a, b in zip(got, want, strict=True):
        _assert_close_rel(a, b)


def test_attention_dropout_operator_is_eager_bitwise():
    """megaformer::attention_dropout (the compiled attention on GPUs; here on the CPU): eager's own
    call inside, so the output and, through its rerun in backward, the gradients are eager's bits."""
    from megaformer.parallel import rng_ops

    gen = torch.Generator().manual_seed(4)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, 4, 16, 8, generator=gen))
    grad = torch.randn(2, 4, 16, 8, generator=gen)
    state = DropoutRNG(9).state_dict()["sharded"]
    eager_rng = DropoutRNG(9)
    want = eager_rng.attention(q, k, v, 0.3, "sharded", is_causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)

    def op(q, k, v, state):
        return rng_ops.attention_dropout(q, k, v, 0.3, True, state)

    got, got_state = torch.compile(op, fullgraph=True)(q, k, v, state)
    assert torch.equal(got, want) and torch.equal(got_state, eager_rng.state_dict()["sharded"])
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), want_grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_compiled_blocks_under_recompute_equal_the_eager_model(recompute):
    """Full recomputation (DeepSpeed's checkpoint around each compiled block, dropout states
    replayed) and selective recomputation (the attention core rerun in backward) of compiled
    blocks: the losses and gradients of the eager model without recomputation, the same states."""
    config = dataclasses.replace(TINY_MODEL, **DROPOUT)
    g = torch.Generator().manual_seed(0)
    batches = [
        [torch.randint(0, config.vocab_size, (2, 16), generator=g) for _ in range(2)] for _ in range(2)
    ]

    def run(mode: str, compiled: bool):
        rng = DropoutRNG(5)
        ckpt = checkpointed(rng) if mode == "full" else None
        model = NormFormerLM(config, seed=3, dropout_rng=rng, checkpoint_fn=ckpt).train()
        for block in model.blocks:
            block.recompute_core_attention = mode == "selective"
        if compiled:
            compile_blocks(model, log=pytest.fail)
        losses = []
        for tokens, labels in batches:
            loss = model(tokens, labels)
            loss.backward()
            losses.append(loss.detach())
        return losses + [p.grad for p in model.parameters()], rng.state_dict()

    eager, eager_states = run("none", compiled=False)
    got, got_states = run(recompute, compiled=True)
    for region in eager_states:
        assert torch.equal(got_states[region], eager_states[region])
    for a, b in zip(got, eager, strict=True):
        _assert_close_rel(a, b)


# 4.5 s with inductor's cache warm, 17 s on a fresh clone's first --fast run (2026-12-02): over 5 s
@pytest.mark.slow
def test_the_blocks_share_one_graph():
    """Regional compilation compiles one block: 4 blocks, training steps and an evaluation trace two
    graphs (train, eval), not one per block (torch's cache holds 8 per code object)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = dataclasses.replace(TINY_MODEL, num_layers=4, **DROPOUT)
    model = NormFormerLM(config, seed=3, dropout_rng=DropoutRNG(5))
    assert compile_blocks(model, log=pytest.fail) == 4
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.train()(tokens, tokens).backward()
    with torch.no_grad():
        model.eval()(tokens, tokens)
    assert counters["stats"]["unique_graphs"] == 2


def test_a_block_that_does_not_compile_runs_eager_and_says_why():
    config = dataclasses.replace(TINY_MODEL, **DROPOUT)
    blocks = [NormFormerBlock(config, 0, None, seed=3, dropout_rng=DropoutRNG(5)) for _ in range(2)]
    broken = blocks[1]
    activation = broken.activation
    broken.activation = lambda x: activation(torch.tensor(x.tolist()))  # .tolist(): a graph break
    messages = []
    compile_blocks(broken, log=messages.append)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(broken.eval()(x), blocks[0].eval()(x), rtol=0, atol=0)
    assert len(messages) == 1 and "the blocks run eager; compiling failed: Unsupported" in messages[0]
    assert broken._compiled_call_impl is None


def test_train_compile_key_and_where_it_is_on(monkeypatch):
    base = "configs/normformer-quickstart.yaml"
    assert load_config(base).train.compile == "auto"
    assert load_config(base, ["train.compile=true"]).train.compile is True
    assert load_config(base, ["train.compile=false"]).train.compile is False
    with pytest.raises(ConfigError, match=r"train\.compile='fast': use true, false or 'auto'"):
        load_config(base, ["train.compile=fast"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not compile_wanted("auto", cpu) and compile_wanted("auto", cuda)
    assert compile_wanted(True, cpu) and not compile_wanted(False, cuda)
    assert why_not_compiled(cpu) is None  # g++ and Python.h on this machine
    assert "ZeRO-3" in why_not_compiled(cpu, zero_stage=3)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "needs a C++ compiler" in why_not_compiled(cpu)


def test_eager_dropout_path_is_the_fork_it_always_was():
    """Outside torch.compile, DropoutRNG.dropout is F.dropout inside fork: the masks of every
    existing test and checkpoint are unchanged."""
    x = torch.randn(3, 5, 7)
    a, b = DropoutRNG(11, tp_rank=1), DropoutRNG(11, tp_rank=1)
    with a.fork("sharded", x.device):
        want = F.dropout(x, 0.25, training=True)
    assert torch.equal(b.dropout(x, 0.25, "sharded"), want)
    assert torch.equal(a.state_dict()["sharded"], b.state_dict()["sharded"])


def test_models_with_other_dropouts_in_one_process_each_compile():
    """compile_blocks compiles with dynamic=False: the dropout of a second model in the process is a
    new constant (a second graph), not a symbolic float the dropout scale could not be folded from
    (dynamo's default: 'assume_constant_result argument conversion failed', and eager blocks)."""
    messages = []
    for p in (0.0, 0.1, 0.2):
        config = dataclasses.replace(TINY_MODEL, hidden_dropout=p, attention_dropout=p)
        block = NormFormerBlock(config, 0, None, seed=3, dropout_rng=DropoutRNG(5)).train()
        compile_blocks(block, log=messages.append, backend="aot_eager")
        block(torch.randn(2, 16, config.hidden_size, requires_grad=True)).sum().backward()
        assert block._compiled_call_impl is not None
    assert messages == []
