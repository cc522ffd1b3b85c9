"""Hugging Face export of a masked LM (``model.objective: mlm``), single process, tiny random models.

The remote-code ``MegaformerForMaskedLM`` loaded by ``AutoModelForMaskedLM.from_pretrained(...,
trust_remote_code=True)`` gives megaformer's logits (fp32, within 1e-4) over the whole
``model.vocab_size`` and its masked-LM loss, with or without padding; the exported tokenizer knows
megaformer's ``<mask>`` / ``<s>`` / ``<pad>`` ids, so ``pipeline("fill-mask")`` ranks megaformer's
logits; a checkpoint saved at tp 2 exports through the command line; ``--format gpt2`` refuses a masked
LM. Why no native RoBERTa export: RoBERTa's classes normalise the embeddings (the last test).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megaformer.config.schema import ModelConfig, ParallelConfig, RunConfig
from megaformer.data.mlm import BOS_ID, EOD_ID, IGNORE_INDEX, MASK_ID, MLM_VOCAB_SIZE, PAD_ID
from megaformer.model import NormFormerLM, vocab_param_names
from megaformer.tools.export_hf import ExportError, main, write_hf_dir

transformers = pytest.importorskip("transformers")

OFF = {"post_attn_ln": False, "head_scale": False, "ffn_ln": False}
SCHEMES = {
    "pre_ln": {"position_embedding": "learned", **OFF},  # the paper's MLM baseline, RoBERTa's positions
    "normformer": {"position_embedding": "learned"},  # NormFormer's three switches at their defaults
    "normformer_resid_qkv_ln_sinusoidal": {"resid_scale": True, "qkv_ln": True},
    "post_ln": {"norm_scheme": "post_ln", "activation": "relu2", **OFF},
}
SHAPE = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "seq_len": 32}
TEXT = "The capital of France is<mask>."


def _model(kw: dict) -> tuple[NormFormerLM, ModelConfig, dict[str, torch.Tensor]]:
    """A random masked LM whose gains, shifts, scales and vocabulary bias are not their init (so a
    misplaced one shows), and its consolidated weights (vocabulary padding cut, as consolidate does)."""
    config = ModelConfig(objective="mlm", vocab_size=MLM_VOCAB_SIZE, **SHAPE, **kw)
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
    return transformers.AutoModelForMaskedLM.from_pretrained(str(path), trust_remote_code=True).eval()


def _masked_batch(seed: int, batch: int = 2, length: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks as megaformer.data.mlm makes them: ``<s>`` first, GPT-2 ids, some ``<mask>``; labels at
    the masked positions, IGNORE_INDEX elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD_ID + 1, (batch, length), generator=gen)
    tokens[:, 0] = BOS_ID
    chosen = torch.rand(batch, length, generator=gen) < 0.3
    chosen[:, 0] = False
    chosen[:, 3] = True
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return tokens.masked_fill(chosen, MASK_ID), labels


@pytest.mark.parametrize("name", list(SCHEMES))
def test_mlm_export_computes_megaformers_function(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES[name])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "configuration_megaformer.py",
        "merges.txt",
        "model.safetensors",
        "modeling_megaformer.py",
        "tokenizer_config.json",
        "vocab.json",
    ]  # no generation_config.json: a masked LM does not generate
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForMaskedLM"] == "modeling_megaformer.MegaformerForMaskedLM"
    assert (cfg["objective"], cfg["vocab_size"]) == ("mlm", MLM_VOCAB_SIZE)
    hf = _load(tmp_path / "hf")
    assert type(hf).__name__ == "MegaformerForMaskedLM"
    tokens, labels = _masked_batch(1)
    with torch.no_grad():
        ref = model(tokens)[..., : config.vocab_size]  # the padded columns (-inf) are not exported
        out = hf(tokens, labels=labels)
        eager = hf(tokens, output_attentions=True)  # the explicit-softmax path
        ref_loss = model(tokens, labels)
    assert out.logits.shape == (2, 20, MLM_VOCAB_SIZE)
    assert (out.logits - ref).abs().max().item() < 1e-4
    assert (eager.logits - ref).abs().max().item() < 1e-4
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5  # mean over the masked positions only
    # Bidirectional: the first token attends to the last one (a causal model gives it weight 0).
    assert all((w[:, :, 0, -1] > 0).all() for w in eager.attentions)


def test_padded_batch_scores_each_row_as_alone(tmp_path, monkeypatch):
    """``attention_mask`` hides right padding (``<pad>``): each row's real positions get the logits
    megaformer gives the row alone, through SDPA and through the explicit path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES["normformer"])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    hf = _load(tmp_path / "hf")
    tokens, _ = _masked_batch(2, length=14)
    lengths = [14, 6]
    batch = tokens.clone()
    batch[1, lengths[1] :] = PAD_ID
    mask = (torch.arange(14) < torch.tensor(lengths).unsqueeze(1)).long()
    with torch.no_grad():
        sdpa = hf(batch, attention_mask=mask).logits
        eager = hf(batch, attention_mask=mask, output_attentions=True)
        for row, n in enumerate(lengths):
            alone = model(tokens[row : row + 1, :n])[0, :, : config.vocab_size]
            assert (sdpa[row, :n] - alone).abs().max().item() < 1e-4
            assert (eager.logits[row, :n] - alone).abs().max().item() < 1e-4
    assert all((w[1, :, : lengths[1], lengths[1] :] == 0).all() for w in eager.attentions)


def test_fill_mask_pipeline_ranks_megaformers_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES["normformer"])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    path = str(tmp_path / "hf")
    pipe = transformers.pipeline("fill-mask", model=path, trust_remote_code=True, device="cpu")
    tok = pipe.tokenizer
    assert (tok.mask_token_id, tok.bos_token_id, tok.cls_token_id, tok.pad_token_id) == (
        MASK_ID,
        BOS_ID,
        BOS_ID,
        PAD_ID,
    )
    assert (tok.sep_token_id, tok.eos_token_id, len(tok)) == (EOD_ID, EOD_ID, config.vocab_size)
    ids = tok(TEXT)["input_ids"]  # <s> The capital of France is <mask> . </s>(= EOD), as training blocks
    assert ids[0] == BOS_ID and ids[-1] == EOD_ID and ids.count(MASK_ID) == 1
    assert tok("The capital of France is <mask>.")["input_ids"] == ids  # <mask> takes the space, as RoBERTa's
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, ids.index(MASK_ID), : config.vocab_size]
    top = torch.topk(logits, 5).indices.tolist()
    predictions = pipe(TEXT, top_k=5)
    assert [p["token"] for p in predictions] == top
    assert predictions[0]["token"] == int(logits.argmax())
    assert predictions[0]["sequence"] == tok.decode(ids[1:-1][:5] + [top[0]] + ids[-2:-1])
    # A batch of unequal lengths goes through padding and the attention mask: the same ranking.
    both = pipe([TEXT, "It was<mask> best of times, it was the worst of times."], top_k=5, batch_size=2)
    assert [p["token"] for p in both[0]] == top


def test_cli_exports_a_tp2_mlm_checkpoint_and_gpt2_format_refuses_it(tmp_path, monkeypatch, capsys):
    """Through ``consolidate`` (the vocabulary-parallel head bias reassembled from 2 TP shards and cut
    to ``model.vocab_size``) and the command line; ``--format gpt2`` names itself and the way out."""
    from megaformer.checkpoint.reshard import split, write_module_checkpoint
    from megaformer.config.load import to_dict

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config, full = _model(SCHEMES["pre_ln"])
    run = to_dict(dataclasses.replace(RunConfig(model=config), parallel=ParallelConfig(tp_size=2)))
    ckpt = tmp_path / "checkpoints"
    write_module_checkpoint(str(ckpt), "global_step7", split(full, config, 2), run, 7)
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(ckpt), "--output", str(out), "--format", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "--format gpt2: model.objective='mlm'" in err and "--format megaformer" in err
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()
    assert main(["--checkpoint", str(ckpt), "--output", str(out)]) == 0
    assert "MegaformerForMaskedLM, step 7" in capsys.readouterr().out
    tokens, _ = _masked_batch(3)
    with torch.no_grad():
        diff = (_load(out)(tokens).logits - model(tokens)[..., : config.vocab_size]).abs().max().item()
    assert diff < 1e-4


def test_register_auto_classes_loads_without_remote_code(tmp_path, monkeypatch):
    from megaformer.tools.export_hf import register_auto_classes
    from megaformer.tools.hf_remote.modeling_megaformer import MegaformerForMaskedLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, config, full = _model(SCHEMES["pre_ln"])
    write_hf_dir(full, config, str(tmp_path / "hf"))
    register_auto_classes()
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"))  # no trust_remote_code
    assert type(hf) is MegaformerForMaskedLM


def test_mlm_export_refuses_a_tokenizer_without_gpt2s_ids(tmp_path):
    _, config, full = _model(SCHEMES["pre_ln"])
    vocab = tmp_path / "small.json"
    vocab.write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ExportError, match=r"small\.json has 2 entries: a masked LM's <mask>"):
        write_hf_dir(full, config, str(tmp_path / "x"), vocab_file=str(vocab))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["roberta", "roberta_prelayernorm"])
def test_roberta_classes_normalise_the_embeddings(family):
    """Why ``--format`` offers no RoBERTa class: ``RobertaEmbeddings`` (and the Pre-LN variant's)
    end in a LayerNorm over token + position + token-type embeddings, which no weights switch off
    (with gain 1 and shift 0 every position comes out with mean 0 and variance 1); megaformer's
    embedding is the raw sum. (The token-type row could be zero and RoBERTa's position offset
    absorbed in the table; the LayerNorm cannot. Plain RoBERTa is also Post-LN.)"""
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg_cls = getattr(transformers, "RobertaConfig" if family == "roberta" else "RobertaPreLayerNormConfig")
    emb_cls = getattr(mod, "RobertaEmbeddings" if family == "roberta" else "RobertaPreLayerNormEmbeddings")
    config = cfg_cls(vocab_size=50, hidden_size=16, max_position_embeddings=20, type_vocab_size=1)
    emb = emb_cls(config).eval()
    with torch.no_grad():
        out = emb(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert out.mean(-1).abs().max().item() < 1e-5
    assert (out.var(-1, unbiased=False) - 1).abs().max().item() < 1e-3
