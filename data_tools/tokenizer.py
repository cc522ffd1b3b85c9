"""Tokenizers for preprocessing: GPT-2 byte-level BPE (through tiktoken) and SentencePiece.

Both give Megatron's tokenizer interface: ``encode``, ``decode``, ``vocab_size``, ``eod``.

GPT-2 BPE is built from the local ``encoder.json`` + ``vocab.bpe`` (or Hugging Face's
``vocab.json`` + ``merges.txt``, the same formats under other names); nothing is downloaded.
tiktoken applies BPE by *rank*: it repeatedly merges the adjacent pair whose concatenation has the
lowest id. That equals GPT-2's merge-list BPE when merge ``i`` (pair ``a b``) produces the token
with id ``256 + i``, which is what GPT-2's files satisfy; ``load_gpt2_bpe`` checks it, so a
vocabulary for which tiktoken would tokenize differently is refused instead of silently used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from data_tools.errors import TokenizerError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "GPT2_PATTERN",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "bytes_to_unicode",
    "load_gpt2_bpe",
]

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")

# GPT-2's pre-tokenizer (openai/gpt-2 encoder.py, Megatron's gpt2_tokenization.py): contractions,
# letter runs, digit runs, punctuation runs, each with an optional leading space; whitespace runs
# give their last space to the following word.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    """What preprocessing needs from a tokenizer."""

    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte 0..255 to the printable character that stands for it in vocab files.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves;
    the other 68 (control characters, space, soft hyphen...) get ``chr(256 + k)`` in increasing
    byte order, so that no vocabulary entry contains whitespace or control characters.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    for k, b in enumerate(shifted):
        table[b] = chr(256 + k)
    return dict(sorted(table.items()))


@lru_cache(maxsize=1)
def _translation_table() -> dict[int, int]:
    """``str.translate`` table from each byte-to-unicode character to the code point of its byte."""
    return {ord(c): b for b, c in bytes_to_unicode().items()}


def _token_bytes(token: str, path: Path, char_to_byte: dict[str, int], checked: bool = False) -> bytes:
    """The bytes a vocabulary token stands for; ``checked``: every character is known to be in
    ``char_to_byte`` (then str.translate + latin-1 do it in C: 50k tokens in ~10 ms instead of
    ~150 ms, which every preprocessing worker pays at start-up)."""
    if checked:
        return token.translate(_translation_table()).encode("latin-1")
    try:
        return bytes(char_to_byte[c] for c in token)
    except KeyError as e:
        raise TokenizerError(
            f"{path}: token {token!r} contains {e.args[0]!r}, which is not in GPT-2's byte-to-unicode "
            "alphabet; this is not a byte-level BPE vocabulary (use --tokenizer-type SentencePieceTokenizer "
            "for a SentencePiece model)"
        ) from None


def _read_vocab(path: Path) -> dict[str, int]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"{path}: vocabulary file not found (pass --vocab-file encoder.json)") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: expected a UTF-8 JSON vocabulary, found invalid UTF-8 ({e})") from None
    if text.startswith("#version"):
        raise TokenizerError(
            f"{path}: expected a JSON vocabulary (encoder.json / vocab.json), found a BPE merges file; "
            "did you swap --vocab-file and --merge-file?"
        )
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(
            f"{path}:{e.lineno}: expected a JSON vocabulary (encoder.json / vocab.json), found invalid "
            f"JSON: {e.msg}; pass GPT-2's encoder.json as --vocab-file"
        ) from None
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(
            f"{path}: expected a JSON object mapping token strings to ids, found {type(vocab).__name__}"
            + (" (empty)" if not vocab else "")
        )
    for token, idx in vocab.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise TokenizerError(
                f"{path}: expected a non-negative integer id for every token, found {token!r}: {idx!r}"
            )
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerError(f"{path}: expected distinct token ids, found some id used twice")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str, int]]:
    """Merges as ``(a, b, line number)``, highest priority first."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise TokenizerError(f"{path}: merges file not found (pass --merge-file vocab.bpe)") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: expected a UTF-8 merges file, found invalid UTF-8 ({e})") from None
    if not lines[0].startswith("#version"):
        hint = (
            "; did you swap --vocab-file and --merge-file?"
            if lines[0].lstrip().startswith("{")
            else "; pass GPT-2's vocab.bpe (or merges.txt) as --merge-file"
        )
        raise TokenizerError(
            f"{path}:1: expected a BPE merges file starting with '#version', found {lines[0][:40]!r}{hint}"
        )
    merges = []
    for lineno, line in enumerate(lines[1:], start=2):
        line = line.rstrip("\r")
        if not line:
            continue  # trailing newline(s)
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(
                f"{path}:{lineno}: expected a merge of two tokens separated by one space, found {line!r}; "
                "the file is damaged (re-copy vocab.bpe / merges.txt)"
            )
        merges.append((parts[0], parts[1], lineno))
    return merges


def load_gpt2_bpe(vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]):
    """Reads and cross-checks GPT-2 BPE files; returns ``(mergeable_ranks, special_tokens)``.

    Args:
        vocab_file: ``encoder.json`` / ``vocab.json``, a JSON object ``{token: id}`` whose tokens are
            written in GPT-2's byte-to-unicode alphabet.
        merge_file: ``vocab.bpe`` / ``merges.txt``: a ``#version`` line, then one ``a b`` merge per line,
            highest priority first.

    Returns:
        ``mergeable_ranks``: ``{token bytes: id}`` for the 256 byte tokens and every merge result;
        ``special_tokens``: ``{token: id}`` for the other vocabulary entries (``<|endoftext|>``).

    Raises:
        TokenizerError: a file that is missing, not JSON, not ``{str: int}``, a merges file without
            ``#version`` or with a malformed line, or ids that are not merge ranks (the message names
            the file and line).
    """
    vocab_path, merges_path = Path(vocab_file), Path(merge_file)
    vocab = _read_vocab(vocab_path)
    merges = _read_merges(merges_path)
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}

    ranks: dict[bytes, int] = {}
    for byte, char in bytes_to_unicode().items():
        idx = vocab.get(char)
        if idx is None or idx >= 256:
            found = "missing" if idx is None else f"id {idx}"
            raise TokenizerError(
                f"{vocab_path}: expected byte token {char!r} (byte {byte}) with an id below 256, "
                f"found {found}; "
                "a byte-level BPE vocabulary starts with the 256 byte tokens"
            )
        ranks[bytes([byte])] = idx
    # One pass over all merge characters decides whether the fast byte conversion is safe.
    checked = set("".join(a + b for a, b, _ in merges)) <= char_to_byte.keys()
    for i, (a, b, lineno) in enumerate(merges):
        for part in (a, b):
            if part not in vocab:
                raise TokenizerError(
                    f"{merges_path}:{lineno}: merge {a!r} {b!r} uses {part!r}, which is not in {vocab_path}; "
                    "the vocabulary and merges files do not belong together"
                )
        merged = a + b
        if vocab.get(merged) != 256 + i:
            raise TokenizerError(
                f"{merges_path}:{lineno}: merge {i} ({a!r} {b!r}) should produce token id {256 + i} "
                f"(ids of merge results must follow the merge order), but {vocab_path} has "
                f"{merged!r} -> {vocab.get(merged)}; the vocabulary and merges files do not belong "
                "together, or the ids are not GPT-2 style ranks"
            )
        ranks[_token_bytes(merged, vocab_path, char_to_byte, checked)] = 256 + i
    # Everything else (GPT-2: only <|endoftext|>) is a special token: never produced by BPE.
    mergeable_ids = set(ranks.values())
    special = {t: i for t, i in vocab.items() if i not in mergeable_ids}
    _check_merges_complete(special, merges, vocab_path, merges_path)
    return ranks, special


def _check_merges_complete(
    special: dict[str, int], merges: list, vocab_path: Path, merges_path: Path
) -> None:
    """Refuse vocabulary tokens that no merge produces, unless they look like special tokens.

    A merges file cut short still parses, and its merges still match the vocabulary; without this
    check every token whose merge was cut off would silently become an unreachable "special" token
    and the text would be tokenized into shorter pieces (GPT-2: 256 bytes + 50,000 merges +
    ``<|endoftext|>`` = 50,257 entries).

    Raises:
        TokenizerError: naming both files, the counts and the fix.
    """
    orphans = sorted((i, t) for t, i in special.items() if not (t.startswith("<") and t.endswith(">")))
    if orphans:
        last = merges[-1][2] if merges else 1
        raise TokenizerError(
            f"{merges_path}: {len(merges)} merges (last at line {last}), but {vocab_path} has "
            f"{len(orphans)} more tokens that no merge produces (ids {orphans[0][0]}..{orphans[-1][0]}, "
            f"e.g. {orphans[0][1]!r}); the merges file is truncated (GPT-2's vocab.bpe has 50,000 "
            "merges after its #version line) or belongs to another vocabulary: re-copy it"
        )


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE, ids identical to OpenAI's encoder and Megatron's ``GPT2BPETokenizer``.

    ``<|endoftext|>`` inside the text is encoded as ordinary text (``<``, ``|``, ``endo``...), as
    Megatron's GPT-2 tokenizer does; the EOD id is only ever added by ``--append-eod``.

    Attributes:
        vocab_size: entries of the vocabulary file (50257 for GPT-2).
        eod: id of ``<|endoftext|>`` (50256 for GPT-2).

    Raises:
        TokenizerError: see ``load_gpt2_bpe``; also a vocabulary without ``<|endoftext|>``.
    """

    # How the vocabulary is read: ``(vocab_file, merge_file) -> (ranks, special)``; a subclass may
    # read it another way (data_tools.bpe_cache: from a cache of checked ranks).
    _load_vocabulary = staticmethod(load_gpt2_bpe)

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]) -> None:
        import tiktoken  # imported here so that SentencePiece-only use does not need it

        ranks, special = self._load_vocabulary(vocab_file, merge_file)
        if EOD_TOKEN not in special:
            raise TokenizerError(f"{vocab_file}: expected an {EOD_TOKEN!r} entry (the EOD token), found none")
        self.vocab_size = len(ranks) + len(special)
        self.eod = special[EOD_TOKEN]
        self._enc = tiktoken.Encoding(
            name=f"gpt2-bpe:{os.fspath(vocab_file)}",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are plain text."""
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a uint32 array straight from tiktoken's token buffer, without making a
        Python int per token (about 10% faster than ``encode`` plus a conversion). With no special
        token allowed or disallowed, tiktoken encodes special-token strings as plain text, exactly
        as ``encode_ordinary`` does."""
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, on tiktoken's thread pool (tiktoken releases the GIL)."""
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte sequences that are not UTF-8 become U+FFFD (as Megatron decodes)."""
        return self._enc.decode([int(i) for i in ids], errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model (``.model`` file); ``eod`` is the model's end-of-sentence id.

    Raises:
        TokenizerError: for a missing or unreadable model, or a model without an EOS piece.
    """

    def __init__(self, model_file: str | os.PathLike[str]) -> None:
        import sentencepiece

        path = Path(model_file)
        if not path.is_file():
            raise TokenizerError(f"{path}: SentencePiece model not found (pass --tokenizer-model X.model)")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=os.fspath(path))
        except (RuntimeError, OSError) as e:
            raise TokenizerError(
                f"{path}: expected a SentencePiece .model file, could not load it ({e})"
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(
                f"{path}: the model has no EOS piece, which is used as the EOD token; train it with "
                "eos_id >= 0 (python -m data_tools.train_tokenizer does)"
            )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, on SentencePiece's own threads."""
        return self._sp.encode(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``."""
        return self._sp.decode([int(i) for i in ids])


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | os.PathLike[str] | None = None,
    merge_file: str | os.PathLike[str] | None = None,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Builds a tokenizer by Megatron's ``--tokenizer-type`` name.

    Args:
        tokenizer_type: ``"GPT2BPETokenizer"`` (needs ``vocab_file`` and ``merge_file``) or
            ``"SentencePieceTokenizer"`` (needs ``tokenizer_model``) or ``"HuggingFaceTokenizer"``
            (``tokenizer_model``: a local tokenizer.json or saved directory, see
            :mod:`data_tools.hf_tokenizer`).

    Raises:
        TokenizerError: for an unknown type, a missing flag, or bad files.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise TokenizerError(
                "GPT2BPETokenizer needs --vocab-file (encoder.json / vocab.json) and --merge-file "
                "(vocab.bpe / merges.txt)"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise TokenizerError(
                "SentencePieceTokenizer needs --tokenizer-model (a SentencePiece .model file)"
            )
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise TokenizerError(
                "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a saved tokenizer "
                "directory)"
            )
        from data_tools.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(tokenizer_model)
    raise TokenizerError(
        f"unknown tokenizer type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}"
    )
