"""The NormFormer paper's recipes (configs/paper/*.yaml) and the 3D-layout recipes built on them.

Checked against the paper (Shleifer, Weston & Ott 2021, arXiv:2110.09456: Table 1, Sec. 2.2,
Table 2) and the authors' fairseq commands (examples/normformer/train_lm.sh and README.md):
parameter counts equal Table 2's |θ| (the model built on the meta device), the hyperparameters,
and both hardware layouts each recipe states in its header (A100 = the file, V100 = the
``# V100 overrides:`` line) load and build their DeepSpeed config at the stated world size. The
memory estimate in each header is recomputed here from its stated formula, and the per-block
activation coefficient it uses is measured. The masked-LM recipes (configs/paper/mlm-125m-*.yaml,
the paper's Sec. 3 / Table 3 on RoBERTa-base, Liu et al. 2019 Table 9) pass the same layout and memory
checks; their |θ| is checked against transformers' RobertaForMaskedLM at roberta-base's config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megaformer.config import load_config, validate_layout
from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM, count_parameters
from megaformer.training.deepspeed_config import build_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
SEQ = 2048
ROWS = 51200  # embedding rows of the paper's models (pinned by Table 2, see the test below)

# file -> what the paper (P) and fairseq's commands (F) say. |θ| in millions, P Table 2.
PAPER = {
    "125m-baseline": dict(
        theta=124.4, lr=3e-3, d=768, L=12, heads=12, drop=0.1, act="gelu", nf=False, resid=False
    ),
    "125m-normformer": dict(
        theta=124.5, lr=3e-3, d=768, L=12, heads=12, drop=0.1, act="gelu", nf=True, resid=True
    ),
    "355m-baseline": dict(
        theta=354.7, lr=1e-3, d=1024, L=24, heads=16, drop=0.0, act="gelu", nf=False, resid=False
    ),
    "355m-normformer": dict(
        theta=355.0, lr=1e-3, d=1024, L=24, heads=16, drop=0.0, act="gelu", nf=True, resid=True
    ),
    "1.3b-baseline": dict(
        theta=1313.5, lr=6e-4, d=2048, L=24, heads=32, drop=0.1, act="gelu", nf=False, resid=False
    ),
    "1.3b-normformer": dict(
        theta=1314.0, lr=6e-4, d=2048, L=24, heads=32, drop=0.1, act="gelu", nf=True, resid=False
    ),
    "2.7b-baseline": dict(
        theta=2648.7, lr=1.6e-4, d=2560, L=32, heads=32, drop=0.1, act="relu2", nf=False, resid=False
    ),
    "2.7b-normformer": dict(
        theta=2649.5, lr=6e-4, d=2560, L=32, heads=32, drop=0.1, act="relu2", nf=True, resid=False
    ),
}
RECIPES = sorted(PAPER)

# The masked-LM recipes (P Sec. 3, Table 3; |θ| in millions, P Table 3). lr: RoBERTa-base's (P gives none).
MLM = {
    "mlm-125m-baseline": dict(theta=125.42, lr=6e-4, nf=False, resid=False),
    "mlm-125m-normformer": dict(theta=125.50, lr=6e-4, nf=True, resid=False),
    "mlm-125m-normformer-resscale": dict(theta=125.51, lr=6e-4, nf=True, resid=True),
}
MLM_RECIPES = sorted(MLM)
ALL = {**PAPER, **MLM}
# The recipes whose A100 layout (the file) is bf16 ZeRO-2: they span several nodes, where ZeRO-2's
# gradient reduction overlapped with backward beats ZeRO-1's all-reduce after it (their headers give
# the predicted steps); every other layout, and every V100 layout, is ZeRO-1.
ZERO2_A100 = ("1.3b-baseline", "1.3b-normformer", "2.7b-baseline", "2.7b-normformer")


def _zero_stage(name: str, hw: str) -> int:
    """The ZeRO stage of a recipe's layout on ``hw``."""
    return 2 if hw == "A100" and name in ZERO2_A100 else 1


# The 3D / ZeRO-2 layouts of the paper's NormFormer models: (file, paper recipe, world, layout); the
# world is the one each header names (the 3D layouts are for more GPUs than the model needs).
LAYOUT_RECIPES = [
    (
        "configs/normformer-1.3b-3d-v100.yaml",
        "1.3b-normformer",
        256,
        {"pp": 2, "tp": 2, "zero": 1, "fp16": True},
    ),
    (
        "configs/normformer-2.7b-3d-a100.yaml",
        "2.7b-normformer",
        256,
        {"pp": 4, "tp": 2, "zero": 1, "bf16": True},
    ),
    ("configs/normformer-350m-zero2.yaml", "355m-normformer", 8, {"pp": 1, "tp": 1, "zero": 2, "bf16": True}),
]


def _path(name: str) -> str:
    return f"configs/paper/{name}.yaml"


def _header(name: str) -> str:
    return (REPO / _path(name)).read_text(encoding="utf-8")


def _closed_form(m: ModelConfig, rows: int = ROWS) -> int:
    """Pre-LN decoder with tied embeddings, sinusoidal positions (no parameters) and biases everywhere:
    embedding rows·d; per layer LN 2d + QKV 3d²+3d + W_O d²+d + LN 2d + W1 4d²+4d + W2 4d²+d; final LN 2d.
    NormFormer adds per layer post-attn LN 2d, FFN LN 2·4d and one HeadScale gain per head; ResScale d.
    """
    d, n_layers = m.hidden_size, m.num_layers
    n = rows * d + n_layers * (12 * d * d + 13 * d) + 2 * d
    n += n_layers * ((2 * d if m.post_attn_ln else 0) + (8 * d if m.ffn_ln else 0))
    n += n_layers * (m.num_attention_heads if m.head_scale else 0) + n_layers * (d if m.resid_scale else 0)
    return n


@pytest.mark.parametrize("name", RECIPES)
def test_parameter_count_equals_the_papers(name):
    cfg = load_config(_path(name))
    with torch.device("meta"):
        model = NormFormerLM(cfg.model)
    n = count_parameters(model)
    assert model.padded_vocab_size == ROWS
    assert n == _closed_form(cfg.model)
    assert round(n / 1e6, 1) == PAPER[name]["theta"], f"{name}: {n / 1e6:.3f}M, paper {PAPER[name]['theta']}M"


def test_embedding_rows_are_pinned_by_the_papers_counts():
    """Table 2's four baseline |θ| (rounded to 0.1M) allow only 51,196..51,209 embedding rows; 51,200
    is the one Megatron-style padding gives, with make_vocab_size_divisible_by 1280 at tp 1, 2, 4, 8."""
    lo, hi = 0, 10**9
    for name in ("125m-baseline", "355m-baseline", "1.3b-baseline", "2.7b-baseline"):
        m = load_config(_path(name)).model
        rest = _closed_form(m, rows=0)
        theta = round(PAPER[name]["theta"] * 10) * 100_000  # exact integer parameters
        lo = max(lo, -(-(theta - 50_000 - rest) // m.hidden_size))  # |θ| rounds to the stated 0.1M
        hi = min(hi, (theta + 50_000 - rest) // m.hidden_size)
    assert (lo, hi) == (51196, 51209)
    m = load_config(_path("125m-baseline")).model
    assert [m.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [ROWS] * 4
    assert (
        ModelConfig(make_vocab_size_divisible_by=128).padded_vocab_size(1) == 50304
    )  # default: not the paper's


@pytest.mark.parametrize("name", RECIPES)
def test_hyperparameters_are_the_papers(name):
    p = PAPER[name]
    cfg = load_config(_path(name))
    m, t = cfg.model, cfg.train
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_size) == (
        p["d"],
        p["L"],
        p["heads"],
        4 * p["d"],
    )
    assert (m.seq_len, m.position_embedding, m.activation, m.tie_embeddings) == (
        SEQ,
        "sinusoidal",
        p["act"],
        True,
    )
    assert (m.post_attn_ln, m.head_scale, m.ffn_ln, m.resid_scale) == (p["nf"], p["nf"], p["nf"], p["resid"])
    assert (m.hidden_dropout, m.attention_dropout) == (p["drop"], p["drop"])
    # fairseq, whose runs gave the paper's numbers: its init, dropout on the embedding output too,
    # weight decay on every parameter.
    assert (m.init, m.embedding_dropout, t.weight_decay_params) == ("fairseq", p["drop"], "all")
    assert t.lr == p["lr"]
    big = name.startswith(("1.3b", "2.7b"))
    assert t.global_batch_size * SEQ == (2**20 if big else 2**19)  # 1M / 0.5M tokens
    assert t.steps == (286102 if big else 572204)
    assert t.steps * t.global_batch_size * SEQ == pytest.approx(300e9, rel=1e-4)  # P Sec. 2.2: 300B tokens
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (
        0.9,
        0.98,
        1e-8,
        0.01,
        0.0,
    )
    assert (t.warmup_steps, t.lr_decay, t.min_lr) == (750, "linear", 0.0)


def _layouts(name: str) -> dict[str, tuple[int, list[str], int, bool]]:
    """The header's layouts: hardware -> (world size, overrides, micro-batch, checkpointing)."""
    text = _header(name)
    out = {}
    for hw, pattern in (
        ("A100", r"# A100 layout \(this file\): world (\d+) = .*\n#   micro-batch (\d+), (no )?activation"),
        ("V100", r"# V100 layout: world (\d+) = .*\n#   micro-batch (\d+), (no )?activation"),
    ):
        match = re.search(pattern, text)
        assert match, f"{name}: no {hw} layout line"
        out[hw] = [int(match[1]), [], int(match[2]), match[3] is None]
    overrides = re.search(r"^# V100 overrides: (.*)$", text, re.MULTILINE)
    assert overrides, f"{name}: no '# V100 overrides:' line"
    out["V100"][1] = overrides[1].split()
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("hw", ["A100", "V100"])
@pytest.mark.parametrize("name", RECIPES + MLM_RECIPES)
def test_both_layouts_load_and_build_their_deepspeed_config(name, hw):
    world, overrides, micro, ckpt = _layouts(name)[hw]
    cfg = load_config(_path(name), overrides)
    t = cfg.train
    assert (t.micro_batch_size, t.activation_checkpointing) == (micro, ckpt)
    zero = _zero_stage(name, hw)
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size, t.zero_stage) == (1, 1, zero)
    # the header's layout line states the same stage
    layout = "A100 layout \\(this file\\)" if hw == "A100" else "V100 layout"
    assert re.search(rf"# {layout}: world \d+ = .*; tp 1, pp 1, ZeRO-{zero}, ", _header(name)), name
    dp = validate_layout(cfg, world)
    assert world % 8 == 0 and dp == world
    ds = build_deepspeed_config(cfg, dp)
    assert ds["gradient_accumulation_steps"] * micro * dp == t.global_batch_size
    assert ds["gradient_clipping"] == 0.0 and ds["zero_optimization"]["stage"] == zero
    if hw == "A100":
        assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
        # bf16 + fp32 accumulation: with ZeRO-1 DeepSpeed's BF16 optimizer, with ZeRO-2 the fp32
        # gradient partition of DeepSpeedZeroOptimizer; the states the estimate counts
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"
        if zero == 1:
            assert ds["bf16"]["immediate_grad_update"]  # no bf16 gradients held: the estimate's 6Ψ
        else:  # the estimate's two reduction buckets (overlap_comm's double buffer), contiguous
            assert ds["zero_optimization"]["overlap_comm"] and ds["zero_optimization"]["contiguous_gradients"]
            assert ds["zero_optimization"]["reduce_bucket_size"] == 2e8
    else:
        assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
        assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    # the other hyperparameters are untouched by the V100 overrides
    assert load_config(_path(name)).model == cfg.model and cfg.train.lr == ALL[name]["lr"]


def _estimate_gib(name: str, hw: str) -> float:
    """The header's memory formula, from the meta-device parameter count."""
    world, overrides, micro, ckpt = _layouts(name)[hw]
    cfg = load_config(_path(name), overrides)
    with torch.device("meta"):
        n = count_parameters(NormFormerLM(cfg.model))
    d, layers, seq = cfg.model.hidden_size, cfg.model.num_layers, cfg.model.seq_len
    if hw == "V100":  # fp16 ZeRO-1: fp16 weights and gradients; fp32 master, m, v, gradient per rank
        states = 4 * n + 16 * n / world
    elif _zero_stage(name, hw) == 1:
        # DeepSpeed 0.19's BF16 optimizer with bf16.immediate_grad_update (the recipes' JSON): bf16
        # weights 2Ψ and the fp32 accumulation 4Ψ; each bf16 gradient is freed once added to it
        states = 6 * n + 12 * n / world
    else:
        # ZeRO-2 (DeepSpeedZeroOptimizer): bf16 weights 2Ψ, the fp32 gradient partition 4Ψ/dp, fp32
        # master, m, v 12Ψ/dp, and two bf16 reduction buckets of reduce_bucket_size (overlap_comm)
        zero = json.loads((REPO / cfg.train.deepspeed_config).read_text())["zero_optimization"]
        buckets = (2 if zero["overlap_comm"] else 1) * zero["reduce_bucket_size"] * 2
        states = 2 * n + 16 * n / world + buckets
    block = (48 if ALL[name]["nf"] else 36) * seq * d
    acts = 2 * seq * d * layers + block if ckpt else block * layers
    logits = 8 * seq * cfg.model.padded_vocab_size(cfg.parallel.tp_size)  # 50,265 for the MLM
    return (states + micro * (acts + logits)) / GIB + 2


@pytest.mark.parametrize("hw", ["A100", "V100"])
@pytest.mark.parametrize("name", RECIPES + MLM_RECIPES)
def test_stated_memory_estimate_is_the_formula_and_fits(name, hw):
    match = re.search(rf"^#   {hw}: .* = ([\d.]+) GiB of (\d+)", _header(name), re.MULTILINE)
    assert match, f"{name}: no {hw} memory line"
    stated, capacity = float(match[1]), int(match[2])
    assert stated == pytest.approx(_estimate_gib(name, hw), abs=0.05)
    assert capacity == (80 if hw == "A100" else 32)  # A100 80GB (or H100 80GB); V100 32GB
    assert stated < 0.8 * capacity  # headroom for fragmentation


def _saved_bytes_per_token_and_width(nf: bool, hidden_dropout: float) -> float:
    d, seq, batch = 256, 128, 2
    cfg = ModelConfig(
        vocab_size=1000, make_vocab_size_divisible_by=8, hidden_size=d, num_layers=1,
        num_attention_heads=4, seq_len=seq, post_attn_ln=nf, head_scale=nf, ffn_ln=nf, resid_scale=nf,
        hidden_dropout=hidden_dropout, attention_dropout=0.0,
    )  # fmt: skip
    block = NormFormerLM(cfg).to(torch.bfloat16).train().blocks[0]
    x = torch.randn(batch, seq, d, dtype=torch.bfloat16, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:  # activations only; the weights are the model states
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    # the fused kernel the GPUs run (flash / memory-efficient): no s×s attention scores are kept
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(storages.values()) / (batch * seq * d)


@pytest.mark.parametrize(("nf", "bound"), [(False, 36), (True, 48)])
def test_activation_bytes_per_block_used_by_the_estimates(nf, bound):
    """What one block keeps for backward in bf16 (input included), per token and unit of width: the
    coefficient the headers use (SDPA's fused attention: no s×s scores; hidden dropout masks)."""
    coefficient = _saved_bytes_per_token_and_width(nf, hidden_dropout=0.1)
    print(f"{'NormFormer' if nf else 'Pre-LN'} block: {coefficient:.2f} bytes per token per unit of width")
    assert bound - 2 < coefficient <= bound + 0.25


@pytest.mark.parametrize(("path", "paper", "world", "expect"), LAYOUT_RECIPES)
def test_layout_recipes_train_the_papers_models_with_its_hyperparameters(path, paper, world, expect):
    cfg, ref = load_config(path), load_config(_path(paper))
    assert cfg.model.padded_vocab_size(cfg.parallel.tp_size) == ROWS
    assert cfg.model == ref.model
    keys = ("steps", "global_batch_size", "lr", "min_lr", "warmup_steps", "lr_decay")
    keys += ("adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "weight_decay_params", "grad_clip")
    assert {k: getattr(cfg.train, k) for k in keys} == {k: getattr(ref.train, k) for k in keys}
    assert (cfg.parallel.pp_size, cfg.parallel.tp_size, cfg.train.zero_stage) == (
        expect["pp"], expect["tp"], expect["zero"],
    )  # fmt: skip
    dp = validate_layout(cfg, world)
    ds = build_deepspeed_config(cfg, dp)
    assert ds["fp16"]["enabled"] == expect.get("fp16", False)
    assert ds["bf16"]["enabled"] == expect.get("bf16", False)


TABLE4 = {  # the paper's Table 4 rows 2-6: each one change to NormFormer + ResScale
    "no_post_attn_ln": {"post_attn_ln": False},
    "no_ffn_ln": {"ffn_ln": False},
    "no_head_scale": {"head_scale": False},
    "no_resid_scale": {"resid_scale": False},
    "plus_3_more_ln": {"qkv_ln": True},
}


@pytest.mark.parametrize(
    ("shape", "base"),
    [
        ("table4-cpu", "configs/cpu-compare/normformer_resscale.yaml"),
        ("table4-125m", "configs/paper/125m-normformer.yaml"),
    ],
)
@pytest.mark.parametrize("row", list(TABLE4))
def test_table4_ablations_change_one_switch_of_normformer_with_resscale(shape, base, row):
    import dataclasses

    from megaformer.config import load_config

    reference = load_config(base)
    assert reference.model.resid_scale and reference.model.head_scale and not reference.model.qkv_ln
    ablation = load_config(f"configs/ablations/{shape}/{row}.yaml")
    assert ablation == dataclasses.replace(
        reference, model=dataclasses.replace(reference.model, **TABLE4[row])
    )  # everything else (data, schedule, layout) is the base's


def _roberta_base_masked_lm() -> torch.nn.Module:
    """transformers' RobertaForMaskedLM at roberta-base's config.json (514 positions, one token type;
    RobertaConfig()'s own defaults are BERT's 512 and 2), on the meta device: no pooler, tied decoder."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    with torch.device("meta"):
        return RobertaForMaskedLM(RobertaConfig(max_position_embeddings=514, type_vocab_size=1))


def test_mlm_baseline_parameter_count_is_roberta_base():
    """|θ| of the MLM baseline = roberta-base's masked LM (124,697,433, tied weights counted once)
    less exactly what megaformer's encoder lacks (no embedding LayerNorm, no token-type embedding,
    position rows 512 for RoBERTa's 514) plus the Pre-LN final LayerNorm; everything else (embedding,
    12 layers, LM head dense + LayerNorm + vocabulary bias) is the same shape."""
    hf = _roberta_base_masked_lm()
    n_hf = sum(p.numel() for p in hf.parameters())  # parameters() yields a tied tensor once
    assert n_hf == hf.num_parameters() == 124_697_433
    emb = hf.roberta.embeddings
    cfg = load_config(_path("mlm-125m-baseline"))
    m = cfg.model
    with torch.device("meta"):
        model = NormFormerLM(m)
    n = count_parameters(model)
    assert model.padded_vocab_size == m.vocab_size == emb.word_embeddings.num_embeddings == 50265
    d = m.hidden_size
    lacks = emb.token_type_embeddings.weight.numel() + 2 * d  # token type (768) + embedding LN (1,536)
    lacks += (emb.position_embeddings.num_embeddings - m.seq_len) * d  # 514 - 512 rows (1,536)
    final_ln = 2 * d  # Pre-LN's LayerNorm after the last block (RoBERTa's release is Post-LN)
    assert (lacks, final_ln) == (3840, 1536)
    assert n == n_hf - lacks + final_ln == 124_695_129
    # the closed form: CLM's (embedding rows, layers, final LN) + learned positions + RoBERTa's LM head
    assert n == _closed_form(m, rows=m.vocab_size) + m.seq_len * d + (d * d + d + 2 * d + m.vocab_size)


def test_mlm_recipes_differ_only_where_they_should():
    """Baseline -> NormFormer: the three NormFormer switches; -> + ResScale: resid_scale; the data,
    schedule and layout are the same (so is the compute-matched budget's baseline). Their |θ|
    increments are close to P Table 3's; the baseline's 125.42M is not reproduced (header)."""
    import dataclasses

    base, nf, rs = (load_config(_path(name)) for name in MLM_RECIPES)
    assert [MLM_RECIPES[0], MLM_RECIPES[1], MLM_RECIPES[2]] == [
        "mlm-125m-baseline", "mlm-125m-normformer", "mlm-125m-normformer-resscale",
    ]  # fmt: skip
    switches = dict(post_attn_ln=True, head_scale=True, ffn_ln=True)
    assert nf.model == dataclasses.replace(base.model, **switches)
    assert rs.model == dataclasses.replace(nf.model, resid_scale=True)
    for other in (nf, rs):
        assert (other.data, other.parallel, other.train) == (base.data, base.parallel, base.train)
    counts = []
    for cfg in (base, nf, rs):
        with torch.device("meta"):
            counts.append(count_parameters(NormFormerLM(cfg.model)))
    d, layers, heads = 768, 12, 12
    assert counts[1] - counts[0] == layers * (2 * d + 2 * 4 * d + heads) == 92_304
    assert counts[2] - counts[1] == layers * d == 9_216
    p = [MLM[name]["theta"] for name in MLM_RECIPES]
    # P Table 3's increments, +0.08M and +0.01M, within 0.015M: no rounding of P's 2-decimal |θ| gives
    # +0.0923M (its NormFormer row is 0.01M short, header DISAGREEMENT), ResScale's +0.0092M fits.
    assert abs((counts[1] - counts[0]) / 1e6 - (p[1] - p[0])) < 0.015
    assert abs((counts[2] - counts[1]) / 1e6 - (p[2] - p[1])) < 0.005


@pytest.mark.parametrize("name", MLM_RECIPES)
def test_mlm_hyperparameters_are_roberta_bases_with_the_papers_budget(name):
    p, cfg = MLM[name], load_config(_path(name))
    m, t = cfg.model, cfg.train
    assert (m.objective, m.vocab_size, m.make_vocab_size_divisible_by) == ("mlm", 50265, 1)
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_size, m.seq_len) == (
        768,
        12,
        12,
        3072,
        512,
    )
    assert (m.position_embedding, m.position_offset, m.activation, m.tie_embeddings) == (
        "learned",
        0,
        "gelu",
        True,
    )
    assert (m.post_attn_ln, m.head_scale, m.ffn_ln, m.resid_scale) == (p["nf"], p["nf"], p["nf"], p["resid"])
    assert (m.hidden_dropout, m.attention_dropout, m.embedding_dropout) == (0.1, 0.1, 0.1)
    assert (m.init, m.init_std, m.scale_embedding, m.layernorm_eps) == ("gpt2", 0.02, False, 1e-5)
    assert t.global_batch_size * m.seq_len == 2**20  # P Sec. 3: batches of 1M tokens
    assert t.steps == 2_000_000  # P Sec. 3: the baseline's 2M batches (NormFormer: 1.92M at its GPU time)
    assert t.lr == p["lr"] == 6e-4  # RoBERTa Table 9, BASE
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (
        0.9,
        0.98,
        1e-6,
        0.01,
        0.0,
    )
    assert (t.warmup_steps, t.lr_decay, t.min_lr, t.weight_decay_params) == (24000, "linear", 0.0, "all")
    assert t.warmup_steps >= 5 + cfg.budget.measure_steps  # a --budget-device-hours run can time itself
    text = _header(name)
    if p["nf"]:
        assert "1.92" in text and "--budget-device-hours" in text
