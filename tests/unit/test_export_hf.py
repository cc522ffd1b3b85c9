"""Hugging Face export (megaformer.tools.export_hf) at TP = 1 with random weights, every scheme.

The remote-code model loaded by ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``
gives megaformer's logits (fp32, within 1e-4; in practice equal), its KV cache gives the logits of a
full forward, and ``generate()`` gives ``megaformer.tools.generate``'s greedy continuation. The native
GPT-2 export of the Pre-LN baseline does too; XGLM would not (its position offset). The tp 2 x pp 2
checkpoints of every scheme are exported in tests/distributed/test_export_hf_launch.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerLM, vocab_param_names
from megaformer.tools.export_hf import ExportError, write_hf_dir
from megaformer.tools.generate import generate

transformers = pytest.importorskip("transformers")

OFF = {"post_attn_ln": False, "head_scale": False, "ffn_ln": False}
SCHEMES = {
    "pre_ln": dict(OFF),
    "normformer_resid_qkv_ln": {"resid_scale": True, "qkv_ln": True},
    "post_ln": {"norm_scheme": "post_ln", **OFF},
    "deepnorm": {"norm_scheme": "deepnorm", **OFF},
    "pre_ln_learned_untied_relu2": {
        "position_embedding": "learned",
        "tie_embeddings": False,
        "activation": "relu2",
        **OFF,
    },
}
# fairseq parity switches (megaformer.tools.import_fairseq): HeadScale on out_proj's output,
# sinusoidal positions from row 2; checked by the remote-code export test only.
FAIRSEQ_SWITCHES = {
    "resid_scale": True,
    "init": "fairseq",
    "head_scale_position": "after_out_proj",
    "position_offset": 2,
}
SHAPE = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "seq_len": 24}


def _model(kw: dict) -> tuple[NormFormerLM, ModelConfig, dict[str, torch.Tensor]]:
    """A random model whose gains, shifts and scales are not their init (so a misplaced one shows),
    and its consolidated weights (vocabulary padding cut, as reshard.consolidate returns them)."""
    config = ModelConfig(**SHAPE, **kw)
    model = NormFormerLM(config, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    vocab_rows = set(vocab_param_names(config))
    full = {
        n: (p.detach()[: config.vocab_size] if n in vocab_rows else p.detach()).clone()
        for n, p in model.named_parameters()
    }
    return model, config, full


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True).eval()


@pytest.mark.parametrize("name", [*SCHEMES, "fairseq_switches"])
def test_remote_code_export_computes_megaformers_function(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model({**SCHEMES, "fairseq_switches": FAIRSEQ_SWITCHES}[name])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "configuration_megaformer.py",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "modeling_megaformer.py",
        "tokenizer_config.json",
        "vocab.json",
    ]
    hf = _load(tmp_path / "hf")
    assert type(hf).__name__ == "MegaformerForCausalLM"
    tokens = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens)[..., : config.vocab_size]
        out = hf(tokens, use_cache=True)
        assert (out.logits - ref).abs().max().item() < 1e-4
        assert out.past_key_values.get_seq_length() == 20
        # The KV cache: one more token on top of the cached 20 gives the full forward's last logits.
        nxt = torch.tensor([[7], [9]])
        step = hf(nxt, past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
        full_fwd = model(torch.cat([tokens, nxt], dim=1))[:, -1, : config.vocab_size]
    assert out.past_key_values.get_seq_length() == 21  # the cache grew in place
    assert (step - full_fwd).abs().max().item() < 1e-4
    prompt = tokens[0, :4].tolist()
    ours = generate(model, config, prompt, max_new_tokens=12, temperature=0)[0]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    assert theirs == ours
    if name == "normformer_resid_qkv_ln":
        # A left-padded batch (attention_mask; generate() derives the positions from it) scores the
        # short row as it scores it alone.
        short = tokens[1, :3]
        batch = torch.stack([tokens[0, :6], torch.cat([torch.full((3,), 50256), short])])
        mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
        kw = {"max_new_tokens": 3, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
        padded = hf.generate(batch, attention_mask=mask, pad_token_id=50256, **kw).scores
        alone = hf.generate(short[None], pad_token_id=50256, **kw).scores
        assert max((a[1] - b[0]).abs().max().item() for a, b in zip(padded, alone, strict=True)) < 1e-4


@pytest.mark.parametrize("name", ["pre_ln", "pre_ln_learned_untied_relu2"])
def test_native_gpt2_export_of_the_pre_ln_baseline(name, tmp_path):
    model, config, full = _model(SCHEMES[name])
    write_hf_dir(full, config, str(tmp_path / "gpt2"), fmt="gpt2")
    assert not (tmp_path / "gpt2" / "modeling_megaformer.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2")).eval()  # no remote code
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)[..., : config.vocab_size]).abs().max().item()
    assert diff < 1e-4


def test_gpt2_export_refuses_what_gpt2_cannot_compute(tmp_path):
    _, config, full = _model(SCHEMES["normformer_resid_qkv_ln"])
    with pytest.raises(ExportError, match=r"NormFormer switches .*--format megaformer"):
        write_hf_dir(full, config, str(tmp_path / "x"), fmt="gpt2")
    assert not (tmp_path / "x").exists()


def test_xglm_is_not_the_sinusoidal_pre_ln_baseline():
    """Why there is no XGLM export: XGLM reads position p at row p + 2 of the fairseq sinusoidal table
    (whose row 1, the padding index, is zero); megaformer reads row p."""
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    from megaformer.model.normformer import sinusoidal_positions

    xglm = XGLMSinusoidalPositionalEmbedding(16, 32, padding_idx=1)
    theirs = xglm(torch.arange(16).unsqueeze(0))[0]
    ours = sinusoidal_positions(18, 32)
    assert torch.allclose(theirs, ours[2:18], atol=1e-6)  # the same table, shifted by two rows
    assert (theirs - ours[:16]).abs().max() > 0.5


def test_exported_tokenizer_is_gpt2_bpe(tmp_path):
    from data_tools.tokenizer import build_tokenizer
    from megaformer.tools.export_hf import REPO

    _, config, full = _model(SCHEMES["pre_ln"])
    write_hf_dir(full, config, str(tmp_path / "hf"), info={"step": 5})
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["megaformer"] == {"step": 5}
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    ours = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(REPO / "data/gpt2-bpe/encoder.json"),
        merge_file=str(REPO / "data/gpt2-bpe/vocab.bpe"),
    )
    text = "It was the best of times,\n it was the worst of times.  Ünïcode ok?"
    assert hf_tok(text)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == 50256


def _export(tmp_path, name: str, fmt: str = "megaformer"):
    model, config, full = _model(SCHEMES[name])
    write_hf_dir(full, config, str(tmp_path / fmt), fmt=fmt)
    return model, config, tmp_path / fmt


# Every scheme plus NormFormer with every switch on (HeadScale, post-attention and FFN LayerNorms).
ALL_SCHEMES = [*SCHEMES, "normformer_all"]
SCHEMES_ALL = {**SCHEMES, "normformer_all": {"resid_scale": True}}


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_hidden_states_and_attentions(name, tmp_path, monkeypatch):
    """output_hidden_states: embedding output, then each block's, the last after the final LayerNorm
    (GPT-2's convention); output_attentions: explicit softmax weights, whose outputs equal SDPA's; both
    with return_dict True and False, with a KV cache and with padding."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES_ALL[name])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    hf = _load(tmp_path / "hf")
    L, nh = config.num_layers, config.num_attention_heads
    tokens = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        sdpa = hf(tokens, use_cache=True)
        out = hf(tokens, use_cache=True, output_hidden_states=True, output_attentions=True)
        base = hf.model(tokens, output_hidden_states=True)
        assert sdpa.hidden_states is None and sdpa.attentions is None
        assert (out.logits - sdpa.logits).abs().max().item() < 1e-5  # explicit attention == SDPA
        assert (out.logits - model(tokens)[..., : config.vocab_size]).abs().max().item() < 1e-4
        hs = out.hidden_states
        assert len(hs) == L + 1 and all(h.shape == (2, 10, config.hidden_size) for h in hs)
        # The base model, SDPA path: the same states (to fp32 rounding); the last is last_hidden_state.
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(hs, base.hidden_states, strict=True))
        assert torch.equal(base.hidden_states[-1], base.last_hidden_state)
        emb = hf.model.embed_tokens(tokens) * hf.model.embed_scale + hf.model._positions(
            torch.arange(10)[None]
        )
        assert torch.allclose(hs[0], emb, atol=1e-6)
        for i, layer in enumerate(hf.model.layers):
            y = layer(hs[i])[0]
            if i == L - 1 and hf.model.final_norm is not None:
                y = hf.model.final_norm(y)
            assert torch.allclose(hs[i + 1], y, atol=1e-5), i
        att = out.attentions
        assert len(att) == L and all(a.shape == (2, nh, 10, 10) for a in att)
        for a in att:
            assert torch.allclose(a.sum(-1), torch.ones(2, nh, 10), atol=1e-5)
            assert a.triu(1).abs().max().item() == 0.0  # no future key
        # return_dict=False: the non-None fields in order.
        tup = hf(
            tokens, use_cache=False, output_hidden_states=True, output_attentions=True, return_dict=False
        )
        assert isinstance(tup, tuple) and len(tup) == 3
        assert torch.allclose(tup[0], out.logits, atol=1e-6)  # (cached k, v: other strides)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(tup[1], hs, strict=True))
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(tup[2], att, strict=True))
        assert len(hf(tokens, use_cache=True, return_dict=False)) == 2  # logits, cache
        # With the KV cache: the new token's states and its weights over cached + new keys.
        nxt = torch.tensor([[7], [9]])
        step = hf(nxt, cache=out.past_key_values, output_hidden_states=True, output_attentions=True)
        full_fwd = model(torch.cat([tokens, nxt], dim=1))[:, -1, : config.vocab_size]
        assert (step.logits[:, -1] - full_fwd).abs().max().item() < 1e-4
        assert len(step.hidden_states) == L + 1 and step.hidden_states[0].shape == (2, 1, config.hidden_size)
        assert all(a.shape == (2, nh, 1, 11) for a in step.attentions)
        # Left padding: padded keys get weight 0; outputs equal the SDPA path's.
        mask = torch.tensor([[1] * 10, [0, 0, 0] + [1] * 7])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = hf(tokens, attention_mask=mask, position_ids=pos, use_cache=False)
        padded_eager = hf(
            tokens, attention_mask=mask, position_ids=pos, use_cache=False, output_attentions=True
        )
        assert (padded.logits - padded_eager.logits)[1, 3:].abs().max().item() < 1e-5
        assert (padded.logits - padded_eager.logits)[0].abs().max().item() < 1e-5
        assert all(a[1, :, 3:, :3].abs().max().item() == 0.0 for a in padded_eager.attentions)
    # attn_implementation="eager": the explicit path for every call, the same function.
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        assert (hf(tokens, use_cache=False).logits - sdpa.logits).abs().max().item() < 1e-5


def test_hidden_states_and_attentions_match_gpt2s(tmp_path):
    """The Pre-LN baseline exported both ways: transformers' GPT-2 (eager attention) returns the same
    hidden-state tuple (ln_f's output last) and attention weights as the remote-code model."""
    _, config, full = _model(SCHEMES["pre_ln"])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    write_hf_dir(full, config, str(tmp_path / "gpt2"), fmt="gpt2")
    ours = _load(tmp_path / "hf")
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "gpt2"), attn_implementation="eager"
    )
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    kw = {"output_hidden_states": True, "output_attentions": True, "use_cache": False}
    with torch.no_grad():
        a, b = ours(tokens, **kw), gpt2.eval()(tokens, **kw)
    assert len(a.hidden_states) == len(b.hidden_states) == config.num_layers + 1
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        assert (x - y).abs().max().item() < 1e-4
    for x, y in zip(a.attentions, b.attentions, strict=True):
        assert x.shape == y.shape and (x - y).abs().max().item() < 1e-5


def test_generate_uses_the_kv_cache_and_returns_states(tmp_path, monkeypatch):
    """generate() hands the cache over (as ``cache`` in recent transformers): one token per step after
    the prompt, and each step's scores equal a full forward over the sequence so far."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, config, path = _export(tmp_path, "normformer_resid_qkv_ln")
    hf = _load(path)
    seen = []
    hook = hf.model.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    prompt = torch.tensor([[11, 400, 3, 9000, 5]])
    gen = hf.generate(
        prompt,
        max_new_tokens=4,
        do_sample=False,
        output_scores=True,
        output_hidden_states=True,
        output_attentions=True,
        return_dict_in_generate=True,
    )
    hook.remove()
    assert seen == [(1, 5), (1, 1), (1, 1), (1, 1)]
    with torch.no_grad():
        for i, score in enumerate(gen.scores):
            ref = hf(gen.sequences[:, : 5 + i], use_cache=False).logits[:, -1]
            assert (score - ref).abs().max().item() < 1e-4, i
    assert [h[0].shape[1] for h in gen.hidden_states] == [5, 1, 1, 1]
    assert all(len(h) == config.num_layers + 1 for h in gen.hidden_states)
    assert [a[0].shape[-2:] for a in gen.attentions] == [(5, 5), (1, 6), (1, 7), (1, 8)]


@pytest.mark.parametrize("name", ["normformer_resid_qkv_ln", "deepnorm"])
def test_gradient_checkpointing_gives_the_same_gradients(name, tmp_path):
    import warnings

    _, config, path = _export(tmp_path, name)
    hf = _load(path).train()
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))

    def grads():
        hf.zero_grad()
        out = hf(tokens, labels=tokens)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in hf.named_parameters()}

    calls = []
    hf.model.layers[0].attn.register_forward_hook(lambda *_: calls.append(1))
    plain, ref = grads()
    assert len(calls) == 1 and plain.past_key_values is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers >= 5.2x: an alias
        hf.gradient_checkpointing_enable()
    assert hf.model.gradient_checkpointing and all(b.gradient_checkpointing for b in hf.model.layers)
    ckpt, got = grads()
    assert len(calls) == 3  # the block ran again in the backward pass
    assert ckpt.past_key_values is None  # no cache while training with checkpointing
    assert torch.equal(ckpt.loss, plain.loss)
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-7), n
    # Trainer's token count: the summed loss over it (transformers' causal LM convention).
    with torch.no_grad():
        n_items = torch.tensor(17)
        summed = hf(tokens, labels=tokens, num_items_in_batch=n_items).loss
    assert torch.allclose(summed, plain.loss * (2 * 11) / 17, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trainer_step_with_gradient_checkpointing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, config, path = _export(tmp_path, "normformer_resid_qkv_ln")
    hf = _load(path)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    gen = torch.Generator().manual_seed(7)
    data = [
        {"input_ids": t, "labels": t} for t in torch.randint(0, config.vocab_size, (4, 12), generator=gen)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        learning_rate=1e-2,
        gradient_checkpointing=True,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=data)
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
    assert all(b.gradient_checkpointing for b in hf.model.layers)
    changed = [n for n, p in hf.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "model.layers.0.attn.qkv.weight" in changed and "model.embed_tokens.weight" in changed


@pytest.mark.parametrize("how", ["trust_remote_code", "register_auto_classes"])
def test_text_generation_pipeline(how, tmp_path, monkeypatch):
    from megaformer.tools.export_hf import register_auto_classes

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, path = _export(tmp_path, "normformer_resid_qkv_ln")
    if how == "register_auto_classes":
        register_auto_classes()
        kw = {}
    else:
        kw = {"trust_remote_code": True}
    pipe = transformers.pipeline("text-generation", model=str(path), device="cpu", **kw)
    assert type(pipe.model).__name__ == "MegaformerForCausalLM"
    if how == "register_auto_classes":  # this installation's class, not the directory's copy
        from megaformer.tools.hf_remote.modeling_megaformer import MegaformerForCausalLM

        assert type(pipe.model) is MegaformerForCausalLM
    out = pipe("It was the best", max_new_tokens=6, do_sample=False, return_tensors=True)
    prompt = pipe.tokenizer("It was the best")["input_ids"]
    ours = generate(model, config, prompt, max_new_tokens=6, temperature=0)[0]
    assert out[0]["generated_token_ids"] == prompt + ours
    text = pipe("It was the best", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text.startswith("It was the best")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_modes_and_tokenizer_length(umask, tmp_path):
    """Every file gets 0o666 & ~umask (safetensors 0.8 alone writes 0600); the tokenizer knows seq_len."""
    import os
    import stat

    old = os.umask(umask)
    try:
        _, config, path = _export(tmp_path, "pre_ln")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask) and "model.safetensors" in modes
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == config.seq_len
    assert transformers.AutoTokenizer.from_pretrained(str(path)).model_max_length == config.seq_len == 24
