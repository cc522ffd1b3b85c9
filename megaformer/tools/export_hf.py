"""Export a megaformer checkpoint to a Hugging Face model directory.

    python -m megaformer.tools.export_hf --checkpoint RUN/checkpoints --output DIR [--tag global_step450]
        [--format megaformer|gpt2] [--overwrite]
        [--vocab-file data/gpt2-bpe/encoder.json --merge-file data/gpt2-bpe/vocab.bpe]

``DIR`` then holds ``model.safetensors`` (fp32), ``config.json``, ``generation_config.json``, the GPT-2
tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``) and, for ``--format megaformer``
(the default, every scheme), the modeling code (``configuration_megaformer.py``,
``modeling_megaformer.py``: transformers' ``PreTrainedModel`` + ``GenerationMixin`` with a KV cache),
so that ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it offline. The tokenizer's ``model_max_length`` is the
model's ``seq_len``; every file gets the mode ``open()`` gives (``0o666 & ~umask``, 0644 under umask 022).

The checkpoint may come from any (tp, pp, dp) layout: its module weights are consolidated by
:func:`megaformer.checkpoint.reshard.consolidate` (the loader every tool shares), vocabulary padding cut.

A masked LM (``model.objective: mlm``) exports as ``MegaformerForMaskedLM`` (remote code, loaded with
``AutoModelForMaskedLM``; no ``generation_config.json``): bidirectional attention and RoBERTa's LM
head exactly as megaformer's (``lm_head.{dense,layer_norm,bias}``, the decoder tied to the token
embedding), logits over the whole ``model.vocab_size`` (50265; only the padding beyond it is cut).
Its tokenizer is transformers' ``RobertaTokenizer`` on the GPT-2 files with the ids of
:mod:`megaformer.data.mlm` (:func:`mlm_tokenizer_config`), so ``pipeline("fill-mask", model=DIR,
trust_remote_code=True)`` works. No native RoBERTa export: transformers' ``RobertaModel`` and
``RobertaPreLayerNormModel`` apply a LayerNorm to the sum of token, position and token-type
embeddings, which no weights switch off and megaformer does not have (the token-type row could be
zero and RoBERTa's position offset absorbed into the table; the LayerNorm cannot), and
``RobertaModel`` is Post-LN (``tests/unit/test_export_hf_mlm.py`` shows the normalised embeddings).

``--format gpt2`` writes transformers' native ``GPT2LMHeadModel`` instead (no remote code). It is
offered only where GPT-2 computes exactly megaformer's function (never a masked LM): the Pre-LN
baseline (``norm_scheme`` pre_ln, every NormFormer switch and ``qkv_ln`` off), GELU or ReLU²; the
sinusoidal table goes into GPT-2's position table ``wpe`` (exact: a table lookup either way), and
with ``scale_embedding`` the input embedding is written as ``sqrt(d)·E`` and the output projection as
``E``, untied. Why not XGLM, the native sinusoidal Pre-LN model: its
``XGLMSinusoidalPositionalEmbedding`` looks position ``p`` up at row ``p + 2`` of a fairseq table whose
row 1 (the padding index) is zeroed, where megaformer uses row ``p``; the same weights give other
logits (``tests/unit/test_export_hf.py`` shows the offset).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from megaformer.checkpoint.integrity import NEEDS_WEIGHTS, CheckpointError, verify
from megaformer.checkpoint.safe_load import TRUST_FLAG, CheckpointReadError
from megaformer.config.schema import ModelConfig
from megaformer.data.mlm import BOS_ID, EOD_ID, MASK_ID, PAD_ID

REPO = Path(__file__).resolve().parents[2]
REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_megaformer.py", "modeling_megaformer.py")
EOD = 50256
MLM_HEAD = "tied_modules.embed.lm_head."  # megaformer's MaskedLMHead, held by the embedding module


class ExportError(ValueError):
    """A checkpoint or option the export cannot serve; the message says why and what to do."""


def _block_prefixes(config: ModelConfig) -> tuple[list[str], str, str]:
    """megaformer's parameter prefixes: blocks ``<1..L>.``, final norm ``<L+1>.norm.``, output ``<L+2>.``."""
    n = config.num_layers
    return [f"{i + 1}." for i in range(n)], f"{n + 1}.norm.", f"{n + 2}."


def hf_config(config: ModelConfig) -> dict:
    """``config.json`` of the remote-code model (:mod:`megaformer.tools.hf_remote`):
    ``MegaformerForCausalLM``, or ``MegaformerForMaskedLM`` under ``model.objective`` mlm (then also
    ``objective``, no KV cache, and the special ids of :mod:`megaformer.data.mlm`)."""
    # lazy: the model's module imports torch._dynamo (1 s): --help and bad flags answer without it
    from megaformer.model.normformer import deepnorm_alpha

    mlm = config.objective == "mlm"
    arch, auto = (
        ("MegaformerForMaskedLM", "AutoModelForMaskedLM")
        if mlm
        else ("MegaformerForCausalLM", "AutoModelForCausalLM")
    )
    cfg = {
        "architectures": [arch],
        "auto_map": {
            "AutoConfig": "configuration_megaformer.MegaformerConfig",
            auto: f"modeling_megaformer.{arch}",
        },
        "model_type": "megaformer",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.ffn_size,
        "max_position_embeddings": config.seq_len,
        "position_embedding": config.position_embedding,
        "activation": config.activation,
        "norm_scheme": config.norm_scheme,
        "post_attn_ln": config.post_attn_ln,
        "head_scale": config.head_scale,
        "ffn_ln": config.ffn_ln,
        "resid_scale": config.resid_scale,
        "qkv_ln": config.qkv_ln,
        "head_scale_position": config.head_scale_position,
        "position_offset": config.position_offset,
        "deepnorm_alpha": deepnorm_alpha(config.num_layers) if config.norm_scheme == "deepnorm" else 1.0,
        "layer_norm_eps": config.layernorm_eps,
        "scale_embedding": config.scale_embedding,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True,
        "bos_token_id": EOD,
        "eos_token_id": EOD,
        "torch_dtype": "float32",
    }
    if mlm:
        # Only the masked LM's config.json names its objective: the causal one stays as it was.
        cfg |= {"objective": "mlm", "use_cache": False, "bos_token_id": BOS_ID, "pad_token_id": PAD_ID}
    return cfg


def to_hf_state(full: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """megaformer's consolidated weights (:func:`~megaformer.checkpoint.reshard.consolidate`) renamed for
    ``MegaformerForCausalLM`` (or ``MegaformerForMaskedLM``), fp32, contiguous. The tied output
    projection is not repeated (transformers ties ``lm_head.weight``, the masked LM's
    ``lm_head.decoder.weight``, to ``model.embed_tokens.weight`` on load). The masked LM's head,
    ``tied_modules.embed.lm_head.{dense,layer_norm,bias}``, becomes ``lm_head.*`` (its vocabulary
    bias cut to ``model.vocab_size`` by ``consolidate``, as the embedding rows).

    Raises:
        ExportError: a weight that has no place in the exported model (another model version).
    """
    blocks, final, output = _block_prefixes(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name == "tied_modules.embed.token.weight":
            new = "model.embed_tokens.weight"
        elif name == "tied_modules.embed.position":
            new = "model.embed_positions.weight"
        elif name.startswith(MLM_HEAD):
            new = "lm_head." + name[len(MLM_HEAD) :]
        elif name.startswith(final):
            new = "model.final_norm." + name[len(final) :]
        elif name == output + "proj.weight":
            new = "lm_head.weight"
        else:
            index, _, rest = name.partition(".")
            if not (index.isdigit() and f"{index}." in blocks):
                raise ExportError(f"checkpoint weight '{name}' has no place in the exported model")
            if rest.split(".")[0] in ("qkv", "qkv_ln", "head_scale", "out_proj"):
                rest = "attn." + rest
            new = f"model.layers.{int(index) - 1}.{rest}"
        out[new] = tensor.detach().float().contiguous()
    return out


def gpt2_refusal(config: ModelConfig) -> str | None:
    """Why GPT-2 cannot compute this model's function exactly, or None when it can."""
    if config.objective != "clm":
        return (
            f"model.objective={config.objective!r} (a masked LM): GPT2LMHeadModel is a causal LM (and "
            "transformers' RoBERTa classes cannot compute megaformer's encoder exactly: they apply a "
            "LayerNorm to the embeddings, which megaformer has not)"
        )
    on = [k for k in ("post_attn_ln", "head_scale", "ffn_ln", "resid_scale", "qkv_ln") if getattr(config, k)]
    if config.norm_scheme != "pre_ln":
        return f"model.norm_scheme={config.norm_scheme!r}: GPT-2 is Pre-LN"
    if on:
        return f"NormFormer switches {on} on: GPT-2 has no such LayerNorms or scales"
    return None


def gpt2_config(config: ModelConfig) -> dict:
    """``config.json`` of the native ``GPT2LMHeadModel`` for a Pre-LN baseline."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_size,
        "activation_function": "relu2" if config.activation == "relu2" else "gelu",  # gelu: erf form
        "layer_norm_epsilon": config.layernorm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "initializer_range": config.init_std,
        # sqrt(d)·E in, E out cannot share one tensor; unscaled tied weights can.
        "tie_word_embeddings": config.tie_embeddings and not config.scale_embedding,
        "use_cache": True,
        "bos_token_id": EOD,
        "eos_token_id": EOD,
        "torch_dtype": "float32",
    }


def to_gpt2_state(full: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Weights of ``GPT2LMHeadModel`` computing the Pre-LN baseline's function (see the module
    docstring). GPT-2's ``Conv1D`` stores ``[in, out]`` (our ``Linear`` transposed) and orders the
    fused projection ``[q | k | v]``, each ``[heads, head_dim]``; ours is ``[heads, 3, head_dim]``.

    Raises:
        ExportError: the model is not a Pre-LN baseline (:func:`gpt2_refusal` says why).
    """
    # lazy: the model's module imports torch._dynamo (1 s): --help and bad flags answer without it
    from megaformer.model.normformer import sinusoidal_positions

    reason = gpt2_refusal(config)
    if reason:
        raise ExportError(f"--format gpt2: {reason}; export with --format megaformer (remote code)")
    d, nh, hs = config.hidden_size, config.num_attention_heads, config.head_dim
    blocks, final, output = _block_prefixes(config)
    emb = full["tied_modules.embed.token.weight"].float()
    scale = math.sqrt(d) if config.scale_embedding else 1.0
    if config.position_embedding == "learned":
        wpe = full["tied_modules.embed.position"].float()
    else:
        wpe = sinusoidal_positions(config.seq_len, d)
    out = {"transformer.wte.weight": emb * scale, "transformer.wpe.weight": wpe}
    for i, p in enumerate(blocks):
        h = f"transformer.h.{i}."
        w = full[p + "qkv.weight"].float().view(nh, 3, hs, d).transpose(0, 1).reshape(3 * d, d)
        b = full[p + "qkv.bias"].float().view(nh, 3, hs).transpose(0, 1).reshape(3 * d)
        out |= {
            h + "ln_1.weight": full[p + "ln1.weight"],
            h + "ln_1.bias": full[p + "ln1.bias"],
            h + "attn.c_attn.weight": w.t(),
            h + "attn.c_attn.bias": b,
            h + "attn.c_proj.weight": full[p + "out_proj.weight"].t(),
            h + "attn.c_proj.bias": full[p + "out_proj.bias"],
            h + "ln_2.weight": full[p + "ln2.weight"],
            h + "ln_2.bias": full[p + "ln2.bias"],
            h + "mlp.c_fc.weight": full[p + "fc1.weight"].t(),
            h + "mlp.c_fc.bias": full[p + "fc1.bias"],
            h + "mlp.c_proj.weight": full[p + "fc2.weight"].t(),
            h + "mlp.c_proj.bias": full[p + "fc2.bias"],
        }
    out["transformer.ln_f.weight"] = full[final + "weight"]
    out["transformer.ln_f.bias"] = full[final + "bias"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = full[output + "proj.weight"]
    elif config.scale_embedding:
        out["lm_head.weight"] = emb
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def mlm_tokenizer_config(vocab_size: int, model_max_length: int | None) -> dict:
    """``tokenizer_config.json`` of a masked LM: transformers' ``RobertaTokenizer`` (byte-level BPE
    over GPT-2's files; ``<s> A </s>`` and ``<s> A </s></s> B </s>`` as RoBERTa) with megaformer's
    ids (:mod:`megaformer.data.mlm`): ``</s>`` is GPT-2's ``<|endoftext|>`` (50256, the document
    separator of the training stream), ``<mask>`` 50257 (absorbing the space before it, as RoBERTa's),
    ``<s>`` 50258 (every training block's first token), ``<pad>`` 50259, and the rows no input or
    target uses, 50260 .. ``vocab_size - 1``, as special ``madeupwordNNNN`` tokens (fairseq's name for
    the rows that pad its dictionary), so that ``len(tokenizer) == vocab_size``, the logits' width."""

    names = {EOD_ID: "<|endoftext|>", MASK_ID: "<mask>", BOS_ID: "<s>", PAD_ID: "<pad>"}
    names |= {i: f"madeupword{i - PAD_ID - 1:04d}" for i in range(PAD_ID + 1, vocab_size)}
    added = {
        str(i): {
            "content": text,
            "lstrip": i == MASK_ID,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, text in sorted(names.items())
    }
    return {
        "tokenizer_class": "RobertaTokenizer",
        "bos_token": "<s>",
        "cls_token": "<s>",
        "eos_token": "<|endoftext|>",
        "sep_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",  # byte-level BPE needs none; GPT-2's choice
        "pad_token": "<pad>",
        "mask_token": "<mask>",
        "add_prefix_space": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
    }


def write_tokenizer(
    out_dir: str,
    vocab_file: str,
    merge_file: str,
    vocab_size: int,
    model_max_length: int | None = None,
    mlm: bool = False,
) -> None:
    """GPT-2 byte-level BPE files under transformers' names, for ``AutoTokenizer``;
    ``model_max_length`` (the model's ``seq_len``) goes into ``tokenizer_config.json``. A masked LM
    (``mlm``) gets :func:`mlm_tokenizer_config`: GPT-2's 50257 ids plus the specials above them.

    Raises:
        ExportError: missing files, or a vocabulary whose size is not the model's (GPT-2's 50257
            for a masked LM).
    """
    for path in (vocab_file, merge_file):
        if not os.path.isfile(path):
            raise ExportError(f"{path}: tokenizer file not found; pass --vocab-file / --merge-file")
    with open(vocab_file, encoding="utf-8") as f:
        size = len(json.load(f))
    if mlm and size != EOD + 1:
        raise ExportError(
            f"{vocab_file} has {size} entries: a masked LM's <mask>/<s>/<pad> are ids 50257..50259 above "
            f"GPT-2's {EOD + 1} BPE ids (megaformer.data.mlm); pass GPT-2's encoder.json / vocab.bpe"
        )
    if not mlm and size != vocab_size:
        raise ExportError(
            f"{vocab_file} has {size} entries but the checkpoint's model.vocab_size is {vocab_size}: pass "
            "the GPT-2 files the run's data was preprocessed with (SentencePiece runs are not exported yet)"
        )
    shutil.copyfile(vocab_file, os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(merge_file, os.path.join(out_dir, "merges.txt"))
    eod = "<|endoftext|>"
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": eod,
        "eos_token": eod,
        "unk_token": eod,
        "add_prefix_space": False,
        "model_max_length": model_max_length,
    }
    if mlm:
        tok_config = mlm_tokenizer_config(vocab_size, model_max_length)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)


def export(
    checkpoint: str,
    output: str,
    *,
    tag: str | None = None,
    fmt: str = "megaformer",
    vocab_file: str | None = None,
    merge_file: str | None = None,
    overwrite: bool = False,
    trust_code: bool = False,
) -> dict:
    """Write the Hugging Face directory ``output`` (see the module docstring); return its config.
    The checkpoint is read with the weights-only unpickler unless ``trust_code``
    (:mod:`megaformer.checkpoint.safe_load`).

    Everything is written under ``output + '.tmp'`` and renamed when complete.

    Raises:
        ExportError: an existing non-empty ``output`` without ``overwrite``, a model ``--format gpt2``
            cannot express, bad tokenizer files.
        ReshardError: the checkpoint cannot be read (names the file).
        UntrustedCheckpointError: a file refers to a type loading weights does not allow.
        CheckpointError: a weights file differs from the checkpoint's manifest (names it and the newest
            intact ``global_stepN``).
    """
    # lazy: the model's module imports torch._dynamo (1 s): --help and bad flags answer without it
    from megaformer.checkpoint.reshard import consolidate, resolve_tag_dir

    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ExportError(f"{output}: exists and is not empty; pass --overwrite or another --output")
    tag_dir = resolve_tag_dir(checkpoint, tag)
    # A damaged weights file is named (with the newest intact checkpoint) before loading; a damaged
    # optimizer or generator-state file, which is not read, in a warning.
    verify(tag_dir, needs=NEEDS_WEIGHTS)
    full, run_config, extra = consolidate(tag_dir, trust_code=trust_code)
    config = ModelConfig(**run_config["model"])
    info = {"step": extra.get("step"), "checkpoint": os.path.abspath(checkpoint)}
    return write_hf_dir(
        full, config, output, fmt=fmt, vocab_file=vocab_file, merge_file=merge_file, info=info
    )


def _umask() -> int:
    """The process's umask (from /proc where it says, else set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _chmod_files(directory: str) -> None:
    """Give every file in ``directory`` the mode ``open()`` and ``torch.save`` give, ``0o666 & ~umask``:
    safetensors >= 0.8 writes ``model.safetensors`` as 0600, which other users (a shared cluster's
    group) cannot read."""
    mode = 0o666 & ~_umask()
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, mode)


def register_auto_classes() -> None:
    """Register megaformer's own Hugging Face classes (this installation's ``hf_remote`` code) with
    ``AutoConfig`` / ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` under
    ``model_type="megaformer"``, so an export loads with ``trust_remote_code=False``: transformers then
    uses the registered classes, and the Python files inside the directory (which anyone could have
    edited) never run. Idempotent."""
    import transformers

    # lazy: transformers loads only when the Auto classes are registered (a plain export does not need it)
    from megaformer.tools.hf_remote.configuration_megaformer import MegaformerConfig
    from megaformer.tools.hf_remote.modeling_megaformer import MegaformerForCausalLM, MegaformerForMaskedLM

    transformers.AutoConfig.register("megaformer", MegaformerConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(MegaformerConfig, MegaformerForCausalLM, exist_ok=True)
    transformers.AutoModelForMaskedLM.register(MegaformerConfig, MegaformerForMaskedLM, exist_ok=True)


def write_hf_dir(
    full: dict[str, torch.Tensor],
    config: ModelConfig,
    output: str,
    *,
    fmt: str = "megaformer",
    vocab_file: str | None = None,
    merge_file: str | None = None,
    info: dict | None = None,
) -> dict:
    """Write consolidated weights ``full`` (megaformer's names, unpadded) of a model ``config`` as the
    Hugging Face directory ``output`` (replaced when it exists), via ``output + '.tmp'``; return the
    written ``config.json`` dict (``info`` under its ``megaformer`` key).

    Raises:
        ExportError: ``fmt='gpt2'`` for a model GPT-2 cannot express, bad tokenizer files.
    """
    from safetensors.torch import save_file

    if fmt == "gpt2":
        state, cfg = to_gpt2_state(full, config), gpt2_config(config)
    else:
        state, cfg = to_hf_state(full, config), hf_config(config)
    cfg["megaformer"] = dict(info or {})
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_tokenizer(
        tmp,
        vocab_file or str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
        merge_file or str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
        config.vocab_size,
        model_max_length=config.seq_len,
        mlm=config.objective == "mlm",
    )
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    if config.objective == "clm":  # a masked LM does not generate
        gen = {"bos_token_id": EOD, "eos_token_id": EOD, "pad_token_id": EOD}
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(gen, f, indent=2)
    if fmt == "megaformer":
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_CODE / name, os.path.join(tmp, name))
    _chmod_files(tmp)
    if os.path.isdir(output):
        shutil.rmtree(output)
    os.replace(tmp, output)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad checkpoint, option or tokenizer."""

    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.export_hf",
        description="Export a megaformer checkpoint (any tp, pp) as a Hugging Face model directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint", required=True, help="a run directory, its checkpoints/ directory or one global_stepN"
    )
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument(
        "--format",
        default="megaformer",
        choices=["megaformer", "gpt2"],
        help="megaformer: remote code, every scheme, causal or masked LM; "
        "gpt2: native GPT2LMHeadModel, causal Pre-LN baseline only",
    )
    p.add_argument("--vocab-file", default=str(REPO / "data" / "gpt2-bpe" / "encoder.json"))
    p.add_argument("--merge-file", default=str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"))
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.add_argument(
        TRUST_FLAG,
        action="store_true",
        help="unpickle the checkpoint in full (it can run code): only for a source you trust",
    )
    args = p.parse_args(argv)
    try:
        cfg = export(
            args.checkpoint,
            args.output,
            tag=args.tag,
            fmt=args.format,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            overwrite=args.overwrite,
            trust_code=args.trust_checkpoint_code,
        )
    except (ExportError, CheckpointReadError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({cfg['architectures'][0]}, step {cfg['megaformer']['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
