"""Hugging Face export (megaformer.tools.export_hf) at TP = 1 with random weights, every scheme.

The remote-code model loaded by ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``
gives megaformer's logits (fp32, within 1e-4; in practice equal), its KV cache gives the logits of a
full forward, and ``generate()`` gives ``megaformer.tools.generate``'s greedy continuation. The native
GPT-2 export of the Pre-LN baseline does too; XGLM would not (its position offset). The tp 2 x pp 2
checkpoints of every scheme are exported in tests/distributed/test_export_hf_launch.py.
"""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("name", list(SCHEMES))
def test_remote_code_export_computes_megaformers_function(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES[name])
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
