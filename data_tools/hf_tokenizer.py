"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``: a local Hugging Face tokenizer.

``PATH`` is a ``tokenizer.json`` file or a directory holding one (with its
``tokenizer_config.json``, as ``save_pretrained`` writes it); nothing is downloaded, so a hub name
is refused with the fix. As in Megatron (``HuggingFaceTokenizer`` with its default
``include_special_tokens``), a text's ids are ``tokenizer(text).input_ids``: the tokenizer's own
special tokens (e.g. a BOS) are added; the EOD id is the tokenizer's EOS token; the vocabulary size
is ``len(tokenizer)`` (added tokens included).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from data_tools.errors import TokenizerError

__all__ = ["HuggingFaceTokenizer"]

# EOS names tried, in order, for a bare tokenizer.json (no tokenizer_config.json names its EOS).
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class HuggingFaceTokenizer:
    """A local Hugging Face fast tokenizer with Megatron's tokenizer interface.

    Attributes:
        vocab_size: ``len(tokenizer)``.
        eod: id of the EOS token.

    Raises:
        TokenizerError: a path that does not exist (a hub name), a file that is not a tokenizer,
            or a tokenizer without an EOS token.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        p = Path(path)
        if not p.exists():
            raise TokenizerError(
                f"{p}: no such file or directory; --tokenizer-model takes a local tokenizer.json or a "
                "directory saved by save_pretrained (nothing is downloaded: fetch a hub tokenizer first)"
            )
        try:
            if p.is_dir() or (p.parent / "tokenizer_config.json").is_file():
                folder = p if p.is_dir() else p.parent
                self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            else:
                self._tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
        except (OSError, ValueError, Exception) as e:  # tokenizers raises its own Exception type
            raise TokenizerError(f"{p}: could not load a Hugging Face tokenizer from it ({e})") from None
        eos = self._tok.eos_token
        if eos is None:
            vocab = self._tok.get_vocab()
            eos = next((t for t in _EOS_CANDIDATES if t in vocab), None)
            if eos is None:
                raise TokenizerError(
                    f"{p}: the tokenizer names no EOS token (used as EOD); save it with its "
                    "tokenizer_config.json (eos_token) beside tokenizer.json"
                )
            self._tok.eos_token = eos
        self.eod = int(self._tok.convert_tokens_to_ids(eos))
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text).input_ids`` (the tokenizer's special tokens included, as Megatron)."""
        return self._tok(text).input_ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text."""
        return self._tok(list(texts)).input_ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids])
