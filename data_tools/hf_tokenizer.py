"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``: a local Hugging Face tokenizer.

``PATH`` is a ``tokenizer.json`` file or a directory holding one (as ``save_pretrained`` writes
it, with its ``tokenizer_config.json``); nothing is downloaded, so a hub name is refused with the
fix. Read with the ``tokenizers`` library (no ``transformers`` needed). As in Megatron
(``HuggingFaceTokenizer`` with its default ``include_special_tokens``, i.e.
``tokenizer(text).input_ids``), a text's ids include what the tokenizer's post-processor adds
(e.g. a BOS); the EOD id is the EOS token named by ``tokenizer_config.json`` (else the first of
``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` in the vocabulary); the vocabulary
size counts the added tokens (``len(tokenizer)``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from data_tools.errors import TokenizerError

__all__ = ["HuggingFaceTokenizer"]

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def _configured_eos(config: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` (a string or ``{"content": ...}``), if any."""
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


class HuggingFaceTokenizer:
    """A local Hugging Face ``tokenizer.json`` with Megatron's tokenizer interface.

    Attributes:
        vocab_size: entries including the added tokens.
        eod: id of the EOS token.

    Raises:
        TokenizerError: a path that does not exist (a hub name), a file that is not a tokenizer,
            or no EOS token to be found.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                "HuggingFaceTokenizer needs the tokenizers package (pip install tokenizers)"
            ) from None
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(
                f"{file}: not found; --tokenizer-model takes a local tokenizer.json or a directory saved by "
                "save_pretrained (nothing is downloaded: fetch a hub tokenizer first)"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = _configured_eos(file.parent / "tokenizer_config.json")
        eos = eos if eos in vocab else next((t for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise TokenizerError(
                f"{file}: no EOS token (used as EOD) found; put its tokenizer_config.json (eos_token) "
                "beside it"
            )
        self.eod = vocab[eos]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, with the special tokens the tokenizer's post-processor adds."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
