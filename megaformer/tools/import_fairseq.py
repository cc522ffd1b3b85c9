"""Import a fairseq ``transformer_lm`` checkpoint (NormFormer included) as a megaformer checkpoint.

    python -m megaformer.tools.import_fairseq --checkpoint model.pt [--dict dict.txt] --output DIR
        [--vocab fairseq|gpt2] [--trust-checkpoint-code]

writes ``DIR/checkpoints/global_stepN`` (N: fairseq's ``num_updates``) with its ``manifest.json`` and
``DIR/checkpoints/latest``, in the layout of :func:`megaformer.checkpoint.reshard.write_module_checkpoint`
(the same files ``megaformer.tools.reshard`` writes), so that ``generate``, ``evaluate``, ``export_hf``
and ``train.init_from`` read it like any other; ``DIR/config.yaml`` holds the run config (a starting
point for training: set ``data.*``), and ``DIR/dict.txt`` a copy of the dictionary when one was found.

What is read. Both fairseq layouts: the argparse era's ``{'args': argparse.Namespace, 'model': ...}``
and the hydra era's ``{'cfg': {'model': {...}}, 'model': ...}``. The file goes through
:func:`megaformer.checkpoint.safe_load.load_weights` with exactly one extra allowed type,
``argparse.Namespace`` (a plain attribute bag: unpickling it runs no code); any other type is
refused, naming it, unless ``--trust-checkpoint-code``.

The architecture is read from the state dict's KEYS, not from the flags: fairseq-train builds no
NormFormer module from ``--scale-attn/--scale-fc/--scale-heads/--scale-resids`` (its hydra path drops
them, see tests/fixtures/fairseq/README.md), so ``cfg.model.scale_attn = True`` does not prove the
module exists. ``attn_ln`` -> ``post_attn_ln``, ``ffn_layernorm`` -> ``ffn_ln``, ``c_attn`` ->
``head_scale`` (with ``head_scale_position='after_out_proj'``: fairseq scales out_proj's output,
bias included, in head_dim chunks; γ maps directly), ``w_resid`` -> ``resid_scale``. Sizes come from
the tensors (d, vocabulary, FFN width, layers); the head count and ``seq_len``
(``max_target_positions``) from the flags. The config is fairseq's function: ``init='fairseq'``,
``scale_embedding`` unless ``no_scale_embedding``, ``layernorm_eps`` 1e-5, exact (erf) GELU,
sinusoidal positions with ``position_offset`` = padding_idx + 1 = 2, tied output, the final
LayerNorm; dropouts from ``dropout`` / ``attention_dropout`` (``embedding_dropout`` = ``dropout``,
as fairseq's ``forward_embedding``). ``data.eod_token`` is set to fairseq's ``</s>`` (2).

The vocabulary keeps fairseq's order by default (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, then
``dict.txt``'s symbols); ``vocab_size`` is the embedding's row count, and megaformer pads the table
above it as usual (``make_vocab_size_divisible_by``). ``--dict`` (default: ``dict.txt`` beside the
checkpoint, when present) is checked against that count and copied. ``--vocab gpt2`` reorders the
rows to GPT-2's ids instead (:func:`gpt2_rows`: the model then reads megaformer's GPT-2 ``.bin``
data, ``data.eod_token`` 50256): every GPT-2 id in the dictionary gets exactly fairseq's logit;
the softmax runs over GPT-2's 50,257 ids, without fairseq's ``<s>``/``<pad>``/``madeupword`` rows,
and with ``<unk>``'s logit for each id fairseq never saw, so probabilities differ from fairseq's by
that mass (none for a dictionary that holds every id the data uses).

Refused, naming the key: an untied output projection, learned positions, adaptive softmax,
``layernorm_embedding``, ``project_in_dim`` / ``project_out_dim``, no final LayerNorm (absent, or
``decoder.version`` <= 2, for which fairseq skips it), a GELU other than the exact one (``relu``,
``gelu_accurate``), layers without the same NormFormer modules, and any key with no place in the
model (encoder attention, quantisation noise, ...).

Not detectable: checkpoints trained between fairseq commits c5ff1811 and 7fb37928 (2021-10-19 to
2021-11-03), whose HeadScale einsum also permuted the channels, import as if trained after the fix
and compute another function; nothing in the file tells them apart.

Not supported: fairseq's padding conventions (a pad token gets position vector 0 and is masked as a
key); megaformer runs unpadded sequences, which give fairseq's logits exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import torch

from megaformer.checkpoint.reshard import partition_dims, split, write_module_checkpoint
from megaformer.checkpoint.safe_load import TRUST_FLAG, CheckpointReadError, load_weights
from megaformer.config.load import to_dict
from megaformer.config.schema import ModelConfig, RunConfig

ALLOWED_TYPES = (argparse.Namespace,)
"""The one type this reader allows besides megaformer's own (fairseq's argparse-era ``args``)."""

FAIRSEQ_PADDING_IDX = 1  # fairseq Dictionary: <s>=0, <pad>=1, </s>=2, <unk>=3
FAIRSEQ_EOS = 2
FAIRSEQ_SPECIALS = 4
FAIRSEQ_UNK = 3
GPT2_VOCAB = 50257  # GPT-2 BPE ids 0..50256; 50256 is <|endoftext|>, megaformer's EOD
_MADEUP = re.compile(r"^madeupword\d+$")  # fairseq's rows padding a dictionary to a multiple of 8

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# fairseq layer key -> megaformer block key (the q/k/v projections are fused separately).
_LAYER_MAP = {
    "self_attn_layer_norm.weight": "ln1.weight",
    "self_attn_layer_norm.bias": "ln1.bias",
    "self_attn.out_proj.weight": "out_proj.weight",
    "self_attn.out_proj.bias": "out_proj.bias",
    "c_attn": "head_scale",
    "attn_ln.weight": "post_attn_ln.weight",
    "attn_ln.bias": "post_attn_ln.bias",
    "final_layer_norm.weight": "ln2.weight",
    "final_layer_norm.bias": "ln2.bias",
    "fc1.weight": "fc1.weight",
    "fc1.bias": "fc1.bias",
    "ffn_layernorm.weight": "ffn_ln.weight",
    "ffn_layernorm.bias": "ffn_ln.bias",
    "fc2.weight": "fc2.weight",
    "fc2.bias": "fc2.bias",
    "w_resid": "resid_scale",
}
_QKV = ("q_proj", "k_proj", "v_proj")
# Keys fairseq itself ignores or recreates: the dummy buffer of the sinusoidal table (2021-2023), the
# table itself (older files), the state-dict version.
_IGNORED = ("decoder.embed_positions._float_tensor", "decoder.embed_positions.weights", "decoder.version")
# Present -> a module megaformer does not have: refuse, naming the key.
_REFUSED_PREFIXES = {
    "decoder.embed_positions.weight": "learned positions (megaformer imports fairseq's sinusoidal "
    "positions only)",
    "decoder.adaptive_softmax": "an adaptive softmax",
    "decoder.layernorm_embedding": "a LayerNorm on the embedding (layernorm_embedding)",
    "decoder.project_in_dim": "a projection of the embedding (decoder_input_dim != decoder_embed_dim)",
    "decoder.project_out_dim": "a projection before the output (decoder_output_dim != decoder_embed_dim)",
}


class FairseqImportError(ValueError):
    """A fairseq checkpoint that cannot be imported; the message names the file, the key and why."""


def read_checkpoint(
    path: str, trust_code: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
    """``(flat model args, state dict, num_updates)`` of a fairseq checkpoint file, either layout.

    Raises:
        UntrustedCheckpointError: the file names a type other than torch's defaults, megaformer's
            and ``argparse.Namespace`` (named), without ``trust_code``.
        FairseqImportError: neither layout (names what is missing).
    """
    if not os.path.isfile(path):
        raise FairseqImportError(f"{path}: no such file")
    ckpt = load_weights(path, trust_code=trust_code, mmap=False, extra_globals=ALLOWED_TYPES)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise FairseqImportError(f"{path}: not a fairseq checkpoint (no 'model' state dict)")
    args = ckpt.get("args")
    cfg = ckpt.get("cfg")
    if isinstance(args, argparse.Namespace):
        flat = dict(vars(args))
    elif cfg is not None and hasattr(cfg, "get") and cfg.get("model") is not None:
        flat = dict(cfg["model"])  # a plain dict (fairseq saves to_container), or a trusted DictConfig
    else:
        raise FairseqImportError(
            f"{path}: neither 'args' (argparse.Namespace, fairseq <= 0.10) nor 'cfg' with a 'model' "
            "section (fairseq >= 0.11); not a fairseq checkpoint"
        )
    history = ckpt.get("optimizer_history") or [{}]
    step = int((history[-1] or {}).get("num_updates", 0) or 0)
    return flat, dict(ckpt["model"]), step


def _need(flat: dict[str, Any], key: str, path: str) -> Any:
    if flat.get(key) is None:
        raise FairseqImportError(f"{path}: the model arguments have no '{key}'; cannot size the model")
    return flat[key]


def _check_decoder(flat: dict[str, Any], state: dict[str, torch.Tensor], path: str) -> None:
    """Refuse the decoder-level modules and flags megaformer cannot represent (named)."""
    for key in state:
        for prefix, what in _REFUSED_PREFIXES.items():
            if key.startswith(prefix):
                raise FairseqImportError(f"{path}: key '{key}': {what}; megaformer has no such module")
    if "decoder.embed_tokens.weight" not in state:
        raise FairseqImportError(f"{path}: no 'decoder.embed_tokens.weight'; not a transformer_lm decoder")
    embed = state["decoder.embed_tokens.weight"]
    out = state.get("decoder.output_projection.weight")
    if out is not None and not (out.shape == embed.shape and torch.equal(out, embed)):
        raise FairseqImportError(
            f"{path}: key 'decoder.output_projection.weight' differs from 'decoder.embed_tokens.weight' "
            "(an untied output, share_decoder_input_output_embed=False); the importer maps tied models only"
        )
    version = state.get("decoder.version")
    if version is not None and float(version.reshape(-1)[0]) <= 2:
        raise FairseqImportError(
            f"{path}: key 'decoder.version' = {float(version.reshape(-1)[0])} <= 2: fairseq runs such a "
            "checkpoint without its final LayerNorm, which megaformer's Pre-LN model always has"
        )
    if "decoder.layer_norm.weight" not in state:
        raise FairseqImportError(
            f"{path}: no key 'decoder.layer_norm.weight' (no_decoder_final_norm): megaformer's Pre-LN "
            "model always ends in a final LayerNorm"
        )
    activation = flat.get("activation_fn", "relu")
    if activation != "gelu":
        raise FairseqImportError(
            f"{path}: activation_fn={activation!r}: megaformer has the exact (erf) GELU ('gelu') and "
            "squared ReLU only; 'relu' and the tanh 'gelu_accurate' are other functions"
        )


def _layer_keys(state: dict[str, torch.Tensor], path: str) -> tuple[int, set[str]]:
    """``(number of layers, layer 0's keys relative to the layer)``; refuses a layer key megaformer
    has no place for, layers that differ, a missing projection, and unmapped decoder keys."""
    layers: dict[int, set[str]] = {}
    for key in state:
        m = _LAYER_KEY.match(key)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    if not layers or sorted(layers) != list(range(len(layers))):
        raise FairseqImportError(f"{path}: decoder layers {sorted(layers)}; expected 0..N-1")
    first = layers[0]
    known = set(_LAYER_MAP) | {f"self_attn.{p}.{w}" for p in _QKV for w in ("weight", "bias")}
    for i, keys in layers.items():
        unknown = sorted(keys - known)
        if unknown:
            raise FairseqImportError(
                f"{path}: key 'decoder.layers.{i}.{unknown[0]}' has no place in megaformer's layer"
            )
    for i, keys in layers.items():
        if keys != first:
            raise FairseqImportError(
                f"{path}: decoder.layers.{i} has keys {sorted(keys ^ first)} that layer 0 has not (or "
                "lacks those it has); megaformer's layers all have the same NormFormer modules"
            )
    optional = ("c_attn", "w_resid", "attn_ln.weight", "attn_ln.bias", "ffn_layernorm.weight")
    missing = sorted(known - first - set(optional) - {"ffn_layernorm.bias"})
    if missing:
        raise FairseqImportError(
            f"{path}: no key 'decoder.layers.0.{missing[0]}'; not a Pre-LN transformer_lm layer"
        )
    mapped = {"decoder.embed_tokens.weight", "decoder.output_projection.weight"}
    mapped |= {"decoder.layer_norm.weight", "decoder.layer_norm.bias"}
    for key in state:
        if key not in mapped and key not in _IGNORED and not _LAYER_KEY.match(key):
            raise FairseqImportError(f"{path}: key '{key}' has no place in megaformer's model")
    return len(layers), first


def fairseq_model_config(
    flat: dict[str, Any], state: dict[str, torch.Tensor], path: str = "checkpoint"
) -> ModelConfig:
    """The megaformer config computing the fairseq model's function (see the module docstring).

    Raises:
        FairseqImportError: a key or flag megaformer cannot represent (named).
    """
    _check_decoder(flat, state, path)
    num_layers, first = _layer_keys(state, path)
    vocab, d = state["decoder.embed_tokens.weight"].shape
    heads = int(_need(flat, "decoder_attention_heads", path))
    if "c_attn" in first and state["decoder.layers.0.c_attn"].numel() != heads:
        raise FairseqImportError(
            f"{path}: key 'decoder.layers.0.c_attn' has {state['decoder.layers.0.c_attn'].numel()} "
            f"entries for decoder_attention_heads={heads}"
        )
    seq_len = int(flat.get("max_target_positions") or _need(flat, "tokens_per_sample", path))
    dropout = float(flat.get("dropout", 0.0) or 0.0)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(d),
        num_layers=num_layers,
        num_attention_heads=heads,
        ffn_hidden_size=int(state["decoder.layers.0.fc1.weight"].shape[0]),
        seq_len=seq_len,
        position_embedding="sinusoidal",
        position_offset=FAIRSEQ_PADDING_IDX + 1,
        activation="gelu",
        post_attn_ln="attn_ln.weight" in first,
        head_scale="c_attn" in first,
        head_scale_position="after_out_proj",
        ffn_ln="ffn_layernorm.weight" in first,
        resid_scale="w_resid" in first,
        norm_scheme="pre_ln",
        hidden_dropout=dropout,
        embedding_dropout=dropout,
        attention_dropout=float(flat.get("attention_dropout", 0.0) or 0.0),
        layernorm_eps=1e-5,
        init="fairseq",
        scale_embedding=not bool(flat.get("no_scale_embedding", False)),
        tie_embeddings=True,
    )


def map_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """fairseq's state dict as megaformer's full, unpadded tensors (names of
    :class:`~megaformer.model.NormFormerLM`; block ``i`` is plan entry ``i + 1``), fp32."""
    d, heads, hs = config.hidden_size, config.num_attention_heads, config.head_dim
    full = {"tied_modules.embed.token.weight": state["decoder.embed_tokens.weight"]}
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"{i + 1}."
        for fkey, mkey in _LAYER_MAP.items():
            if src + fkey in state:
                full[dst + mkey] = state[src + fkey]
        # Fused qkv rows are [heads, 3, head_dim]: per head its q, k, v rows.
        w = [state[f"{src}self_attn.{p}.weight"].reshape(heads, hs, d) for p in _QKV]
        b = [state[f"{src}self_attn.{p}.bias"].reshape(heads, hs) for p in _QKV]
        full[dst + "qkv.weight"] = torch.stack(w, dim=1).reshape(3 * d, d)
        full[dst + "qkv.bias"] = torch.stack(b, dim=1).reshape(3 * d)
    final = f"{config.num_layers + 1}.norm."
    full[final + "weight"] = state["decoder.layer_norm.weight"]
    full[final + "bias"] = state["decoder.layer_norm.bias"]
    return {k: v.detach().float().clone().contiguous() for k, v in full.items()}


def read_dict(path: str) -> list[str]:
    """The symbols of a fairseq ``dict.txt`` (``symbol count [#fairseq:overwrite]`` per line)."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").rsplit(" ", 1)[0] for line in f if line.strip()]


def gpt2_rows(symbols: list[str], dict_path: str) -> tuple[torch.Tensor, int]:
    """For ``--vocab gpt2``: the fairseq embedding row of every GPT-2 id, and how many GPT-2 ids the
    dictionary lacks.

    A fairseq LM trained on GPT-2 BPE (fairseq's ``--bpe gpt2``) numbers the BPE ids by frequency:
    ``dict.txt``'s line ``i`` (from 0) holds a GPT-2 id as its symbol and is embedding row
    ``4 + i``. GPT-2 id ``g`` then reads the row of the line whose symbol is ``g``; ``<|endoftext|>``
    (50256, megaformer's EOD) reads fairseq's ``</s>`` (row 2), which ends every fairseq line and
    document as the EOD does in megaformer's data; a GPT-2 id absent from the dictionary (never seen
    in fairseq's training data) reads ``<unk>`` (row 3), as fairseq's encoder would map it.
    ``madeupwordNNNN`` lines (fairseq's padding of the dictionary) are skipped.

    Returns:
        ``(rows int64[50257], absent)``.

    Raises:
        FairseqImportError: a symbol that is not a GPT-2 id (``FILE:LINE``), or one given twice.
    """
    rows = torch.full((GPT2_VOCAB,), FAIRSEQ_UNK, dtype=torch.long)
    seen = torch.zeros(GPT2_VOCAB, dtype=torch.bool)
    for i, symbol in enumerate(symbols):
        if _MADEUP.match(symbol):
            continue
        if not symbol.isdigit() or int(symbol) >= GPT2_VOCAB:
            raise FairseqImportError(
                f"{dict_path}:{i + 1}: symbol {symbol!r} is not a GPT-2 BPE id (0..{GPT2_VOCAB - 1}): "
                "--vocab gpt2 needs the dictionary of a model trained with fairseq's --bpe gpt2; "
                "drop --vocab gpt2 to keep fairseq's own ids"
            )
        g = int(symbol)
        if seen[g]:
            raise FairseqImportError(f"{dict_path}:{i + 1}: GPT-2 id {g} appears twice in the dictionary")
        seen[g] = True
        rows[g] = FAIRSEQ_SPECIALS + i
    # fairseq's end of line / document; a "50256" symbol (rare: raw text never yields it) is overridden.
    rows[GPT2_VOCAB - 1] = FAIRSEQ_EOS
    absent = int((~seen[: GPT2_VOCAB - 1]).sum())
    return rows, absent


def import_fairseq(
    checkpoint: str,
    output: str,
    dict_path: str | None = None,
    trust_code: bool = False,
    vocab: str = "fairseq",
) -> str:
    """Import ``checkpoint`` into ``output`` (see the module docstring); return the tag directory.

    Args:
        vocab: ``fairseq``: the embedding keeps fairseq's row order (``<s>``, ``<pad>``, ``</s>``,
            ``<unk>``, then ``dict.txt``'s symbols); ``gpt2``: reordered to GPT-2's ids
            (:func:`gpt2_rows`; needs the dictionary), so the model reads data preprocessed with
            ``data_tools.preprocess --tokenizer-type GPT2BPETokenizer`` and ``data.eod_token`` is 50256.

    Raises:
        FairseqImportError: what cannot be mapped (named); UntrustedCheckpointError: a disallowed type.
    """
    if vocab not in ("fairseq", "gpt2"):
        raise FairseqImportError(f"--vocab {vocab!r}: use fairseq or gpt2")

    flat, state, step = read_checkpoint(checkpoint, trust_code)
    config = fairseq_model_config(flat, state, checkpoint)
    if dict_path is None:
        beside = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "dict.txt")
        dict_path = beside if os.path.isfile(beside) else None
    if dict_path is not None:
        if not os.path.isfile(dict_path):
            raise FairseqImportError(f"--dict {dict_path}: no such file")
        symbols = read_dict(dict_path)
        if len(symbols) + FAIRSEQ_SPECIALS != config.vocab_size:
            raise FairseqImportError(
                f"{dict_path}: {len(symbols)} symbols + {FAIRSEQ_SPECIALS} fairseq specials = "
                f"{len(symbols) + FAIRSEQ_SPECIALS}, but the checkpoint's embedding has "
                f"{config.vocab_size} rows: not this model's dictionary"
            )
    full = map_state(state, config)
    eod = FAIRSEQ_EOS
    if vocab == "gpt2":
        if dict_path is None:
            raise FairseqImportError(
                f"--vocab gpt2: no dict.txt beside {checkpoint}; pass --dict (the dictionary maps the "
                "embedding rows to GPT-2 ids)"
            )
        rows, absent = gpt2_rows(symbols, dict_path)
        key = "tied_modules.embed.token.weight"
        full[key] = full[key][rows].contiguous()
        config = dataclasses.replace(config, vocab_size=GPT2_VOCAB)
        eod = GPT2_VOCAB - 1
        print(
            f"import_fairseq: embedding reordered to GPT-2 ids ({GPT2_VOCAB - 1 - absent:,} BPE ids from "
            f"{dict_path}, <|endoftext|> = fairseq's </s>, {absent:,} ids absent from it read <unk>)"
        )
    names = set(partition_dims(config))
    if set(full) != names:
        raise FairseqImportError(f"{checkpoint}: mapped {sorted(set(full) ^ names)} do not match the model")
    run = RunConfig(model=config)
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, eod_token=eod))
    run_config = to_dict(run)
    ckpt_dir = os.path.join(output, "checkpoints")
    provenance = {"imported_from": os.path.abspath(checkpoint), "imported_from_format": "fairseq"}
    tag_dir = write_module_checkpoint(
        ckpt_dir, f"global_step{step}", split(full, config, 1), run_config, step, provenance, run_config
    )
    import yaml

    with open(os.path.join(output, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(run_config, f, sort_keys=False)
    if dict_path is not None:
        shutil.copyfile(dict_path, os.path.join(output, "dict.txt"))
    return tag_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megaformer.tools.import_fairseq",
        description="Import a fairseq transformer_lm checkpoint (NormFormer included) as a megaformer "
        "checkpoint DIR/checkpoints/global_stepN that generate, evaluate, export_hf and "
        "train.init_from read.",
    )
    parser.add_argument("--checkpoint", required=True, help="fairseq checkpoint (.pt)")
    parser.add_argument(
        "--dict", default=None, help="fairseq dict.txt (default: dict.txt beside the checkpoint, if any)"
    )
    parser.add_argument("--output", required=True, help="output directory DIR")
    parser.add_argument(
        "--vocab",
        choices=("fairseq", "gpt2"),
        default="fairseq",
        help="embedding row order: fairseq's dictionary (default), or GPT-2's ids (needs dict.txt; "
        "the model then reads data preprocessed with the GPT-2 BPE, EOD 50256)",
    )
    parser.add_argument(
        TRUST_FLAG,
        dest="trust_code",
        action="store_true",
        help="unpickle the checkpoint in full (only for a file from a source you trust)",
    )
    args = parser.parse_args(argv)
    try:
        tag_dir = import_fairseq(args.checkpoint, args.output, args.dict, args.trust_code, args.vocab)
    except (CheckpointReadError, FairseqImportError) as e:
        print(f"import_fairseq: {e}", file=sys.stderr)
        return 2
    print(f"wrote {tag_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
