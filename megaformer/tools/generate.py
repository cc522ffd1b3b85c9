"""Sample text from a checkpoint: a quick look at what a run has learned.

    python -m megaformer.tools.generate --checkpoint RUN/checkpoints --prompt "It was a dark night"
        [--tag global_step450] [--max-new-tokens 64] [--temperature 0.8] [--top-k 50] [--seed 0]
        [--num-samples 1] [--vocab-file data/gpt2-bpe/encoder.json --merge-file data/gpt2-bpe/vocab.bpe]

The checkpoint may come from any (tp, pp, dp) layout: its module weights are consolidated
(:func:`megaformer.checkpoint.reshard.consolidate`) into one process at TP = 1, on CPU, in fp32. The
model is the trainer's, :class:`megaformer.model.NormFormerLM` (config from the checkpoint).
Decoding is plain autoregressive sampling without a KV cache (each new token reruns the last
``seq_len`` tokens): fine for a look at a small model, not a serving path.

The vocabulary padding (rows above ``model.vocab_size``, see ``model.make_vocab_size_divisible_by``)
never gets probability mass: the model returns its logits as ``-inf`` (``NormFormerLM``'s contract
for logits), so temperature, top-k and softmax leave it at 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megaformer.config.schema import TRUST_FLAG, ModelConfig

# torch and the model (2-5 s of imports: torch, then torch._dynamo under the model's custom ops) are
# imported in the functions that use them: `--help` and a bad flag answer without them (issue 39).
if TYPE_CHECKING:
    import torch

    # lazy: torch and the model load in the functions that use them (the module's note: --help without them)
    from megaformer.model import NormFormerLM

REPO = Path(__file__).resolve().parents[2]


def load_for_generation(
    ckpt_dir: str, tag: str | None = None, trust_code: bool = False
) -> tuple[NormFormerLM, ModelConfig, int]:
    """The checkpoint's model at TP = 1 in eval mode (fp32, CPU), its config, and the step it was
    saved at. The weights are read with the weights-only unpickler unless ``trust_code``
    (:mod:`megaformer.checkpoint.safe_load`).

    Raises:
        ReshardError: the directory holds no loadable megaformer checkpoint (names the file).
        ConfigError: a masked-LM checkpoint (``model.objective`` mlm): no next-token model.
        UntrustedCheckpointError: a file refers to a type loading weights does not allow.
        CheckpointError: a weights file differs from the manifest (a damaged optimizer or
            generator-state file is only named in a warning: it is not read).
    """
    # lazy: torch and the model load in the functions that use them (the module's note: --help without them)
    from megaformer.checkpoint.integrity import NEEDS_WEIGHTS, verify
    from megaformer.checkpoint.reshard import consolidate, load_full, resolve_tag_dir
    from megaformer.config.load import require_causal_lm

    # lazy: torch and the model load in the functions that use them (the module's note: --help without them)
    from megaformer.model import NormFormerLM

    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    # A damaged weights file is named (with the newest intact checkpoint) before loading; a damaged
    # optimizer or generator-state file, which is not read, in a warning.
    verify(tag_dir, needs=NEEDS_WEIGHTS)
    full, run_config, extra = consolidate(tag_dir, trust_code=trust_code)
    config = ModelConfig(**run_config["model"])
    # Sampling, zero_shot's scoring and evaluate's perplexity read next-token probabilities.
    require_causal_lm(config, tag_dir, "next-token generation / scoring / perplexity")
    model = NormFormerLM(config, tp_group=None, seed=0)  # the seed's weights are all replaced
    load_full(model, {k: v.float() for k, v in full.items()}, config, tp_rank=0, tp=1)
    return model.eval(), config, int(extra.get("step") or 0)


def next_token_probs(
    model: NormFormerLM, config: ModelConfig, tokens: torch.Tensor, temperature: float, top_k: int
) -> torch.Tensor:
    """Distribution of the next token after each row of ``tokens``.

    Args:
        model: a :class:`~megaformer.model.NormFormerLM` at TP = 1 (its logits come with the
            vocabulary padding at ``-inf``).
        tokens: ``int64[B, T]`` with ``1 <= T``; only the last ``config.seq_len`` are read.
        temperature: > 0 divides the logits; 0 puts all mass on the argmax (greedy).
        top_k: keep the ``top_k`` most likely tokens (0: all).

    Returns:
        ``float32[B, padded_vocab]``, rows summing to 1, exactly 0 on the vocabulary padding.
    """
    import torch

    with torch.no_grad():
        logits = model(tokens[:, -config.seq_len :])[:, -1, :].float()  # [B, V_pad], padding -inf
    if temperature == 0:
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    logits = logits / temperature
    if 0 < top_k < config.vocab_size:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    return torch.softmax(logits, dim=-1)


def generate(
    model: NormFormerLM,
    config: ModelConfig,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    num_samples: int = 1,
    eod: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """``num_samples`` continuations of ``prompt`` (token ids), each at most ``max_new_tokens`` long.

    A continuation stops after ``eod`` when it is given. Reproducible from ``seed`` (its own
    generator; the global RNG is untouched).

    Raises:
        ValueError: an empty prompt, a negative temperature or top-k.
    """
    import torch

    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. the EOD id for no prompt)")
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature and top_k must be >= 0, got {temperature} and {top_k}")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt)] * num_samples, dtype=torch.long)
    done = torch.zeros(num_samples, dtype=torch.bool)
    for _ in range(max_new_tokens):
        probs = next_token_probs(model, config, tokens, temperature, top_k)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if eod is not None:
            done |= nxt == eod
            if bool(done.all()):
                break
    out = []
    for row in tokens[:, len(prompt) :].tolist():
        if eod is not None and eod in row:
            row = row[: row.index(eod) + 1]
        out.append(row)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.generate",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows every default
    )
    p.add_argument(
        "--checkpoint", required=True, help="a run directory, its checkpoints/ directory or one global_stepN"
    )
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument("--prompt", default="", help="text to continue; empty: start after an EOD")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = the whole vocabulary")
    p.add_argument("--num-samples", type=int, default=1, help="continuations of the same prompt")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampler (its own generator)")
    p.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"],
        help="the tokenizer the run's data was preprocessed with (data_tools.preprocess's --tokenizer-type)",
    )
    p.add_argument("--vocab-file", default=str(REPO / "data" / "gpt2-bpe" / "encoder.json"), help="GPT-2 BPE")
    p.add_argument("--merge-file", default=str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"), help="GPT-2 BPE")
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model (SentencePieceTokenizer), or a local tokenizer.json or saved tokenizer "
        "directory (HuggingFaceTokenizer)",
    )
    p.add_argument(
        TRUST_FLAG,
        action="store_true",
        help="unpickle the checkpoint in full (it can run code): only for a source you trust",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad checkpoint, tokenizer or flag."""
    args = build_parser().parse_args(argv)  # before the heavy imports: --help, a bad flag
    # lazy: torch and the model load in the functions that use them (the module's note: --help without them)
    from data_tools.errors import DataToolsError
    from data_tools.tokenizer import build_tokenizer
    from megaformer.checkpoint.safe_load import CheckpointReadError

    try:
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file if args.tokenizer_type == "GPT2BPETokenizer" else None,
            merge_file=args.merge_file if args.tokenizer_type == "GPT2BPETokenizer" else None,
            tokenizer_model=args.tokenizer_model,
        )
        model, config, step = load_for_generation(args.checkpoint, args.tag, args.trust_checkpoint_code)
        if tokenizer.vocab_size != config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} entries but the checkpoint's model.vocab_size is "
                f"{config.vocab_size}: pass the tokenizer files the run's data was preprocessed with"
            )
        prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eod]
        samples = generate(
            model,
            config,
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            num_samples=args.num_samples,
            eod=tokenizer.eod,
            seed=args.seed,
        )
    except (DataToolsError, CheckpointReadError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = os.path.abspath(args.checkpoint)
    shape = f"{config.num_layers} layers, d={config.hidden_size}, seq_len {config.seq_len}"
    print(f"# {where}, step {step}: {shape}")
    for i, ids in enumerate(samples):
        print(f"--- sample {i} ({len(ids)} tokens, temperature {args.temperature}, top-k {args.top_k})")
        print(args.prompt + tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
