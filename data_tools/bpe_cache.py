"""GPT-2 BPE tokenizers built from a cache of checked vocabularies, for preprocessing's start-up.

:func:`data_tools.tokenizer.load_gpt2_bpe` reads GPT-2's ``encoder.json`` and 50k merges and
cross-checks them (~0.1 s). Every ``data_tools.preprocess`` run pays that before its workers can
start: on 2 cores and 100 MB of text, 4 % of the run. Its result depends only on the two files'
bytes, so it is cached: :func:`load_gpt2_bpe_cached` hashes both files (~2 ms), and loads the
checked ranks from ``{cache_dir()}/gpt2-bpe-{SHA-256}.ranks`` (~10 ms) or, the first time, builds
them with ``load_gpt2_bpe`` (its checks and errors unchanged) and saves them.

A cache file holds the ranks and the special tokens behind a SHA-256 of its own content: a
damaged or truncated file is ignored (and rewritten). It is written only after the checks passed,
under a temporary name renamed into place (concurrent runs, e.g. the tasks of a Slurm array, each
write a whole file); a cache directory that cannot be written is skipped without a word.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import itertools
import json
import os
import struct
from pathlib import Path

from data_tools.tokenizer import GPT2BPETokenizer, load_gpt2_bpe

__all__ = ["CachedGPT2BPETokenizer", "cache_dir", "load_gpt2_bpe_cached"]

_MAGIC = b"MFRANKS1"  # the files' layout (bump with any change below)


def cache_dir() -> Path:
    """``$MEGAFORMER_CACHE/tokenizers`` or ``~/.cache/megaformer/tokenizers`` (beside the fake-CUDA
    shim's cache)."""
    root = os.environ.get("MEGAFORMER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megaformer")
    return Path(root) / "tokenizers"


def load_gpt2_bpe_cached(vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]):
    """``load_gpt2_bpe(vocab_file, merge_file)``, from the cache when these files were checked
    before (see the module docstring).

    Returns:
        ``(mergeable_ranks, special_tokens)``, equal to ``load_gpt2_bpe``'s (same order too).

    Raises:
        TokenizerError: as ``load_gpt2_bpe`` (bad files are never cached).
    """
    try:
        contents = Path(vocab_file).read_bytes(), Path(merge_file).read_bytes()
    except OSError:  # missing or unreadable: load_gpt2_bpe names the problem
        return load_gpt2_bpe(vocab_file, merge_file)
    digest = hashlib.sha256(_MAGIC)
    for data in contents:
        digest.update(hashlib.sha256(data).digest())
    path = cache_dir() / f"gpt2-bpe-{digest.hexdigest()[:40]}.ranks"
    cached = _read(path)
    if cached is not None:
        return cached
    ranks, special = load_gpt2_bpe(vocab_file, merge_file)
    _write(path, ranks, special)
    return ranks, special


class CachedGPT2BPETokenizer(GPT2BPETokenizer):
    """:class:`~data_tools.tokenizer.GPT2BPETokenizer` whose vocabulary comes through
    :func:`load_gpt2_bpe_cached`: the same ids, attributes and errors."""

    _load_vocabulary = staticmethod(load_gpt2_bpe_cached)


def _read(path: Path) -> tuple[dict[bytes, int], dict[str, int]] | None:
    """A cache file's ``(ranks, special)``, or ``None`` if it is missing or not intact."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = memoryview(data)[40:]
    if data[:8] != _MAGIC or hashlib.sha256(payload).digest() != data[8:40]:
        return None
    (header_size,) = struct.unpack_from("<I", payload)
    header = json.loads(bytes(payload[4 : 4 + header_size]))
    n, at = header["count"], 4 + header_size
    ids, lengths = array.array("i"), array.array("i")
    ids.frombytes(payload[at : at + 4 * n])
    lengths.frombytes(payload[at + 4 * n : at + 8 * n])
    blob = bytes(payload[at + 8 * n :])
    ends = list(itertools.accumulate(lengths))
    tokens = map(blob.__getitem__, map(slice, [0, *ends[:-1]], ends))
    return dict(zip(tokens, ids)), header["special"]


def _write(path: Path, ranks: dict[bytes, int], special: dict[str, int]) -> None:
    """Writes a cache file: magic, SHA-256 of the rest, header size, JSON header (count, special
    tokens), int32 ids, int32 token lengths, the tokens' bytes back to back, all in ``ranks``'s
    order. Best effort: an unwritable cache is skipped."""
    header = json.dumps({"count": len(ranks), "special": special}).encode()
    payload = b"".join(
        [
            struct.pack("<I", len(header)),
            header,
            array.array("i", ranks.values()).tobytes(),
            array.array("i", map(len, ranks)).tobytes(),
            b"".join(ranks),
        ]
    )
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
