"""Checkpoint integrity: a manifest of every file's size and sha256, written last, and its checks.

A ``global_stepN`` directory is complete when its ``manifest.json`` lists every file the ranks
wrote, with sizes and sha256 digests; the trainer writes it (rank 0, atomically, after every rank
has written and fsynced its files) and only then moves the ``latest`` tag. A reader verifies the
files against it, so a truncated, zero-filled, deleted or half-written file is named before
``torch.load`` sees it, and the newest intact ``global_stepN`` beside it is suggested.

A reader verifies what it reads (:func:`verify`'s ``needs``): the tools that need only the module
weights (``reshard``, ``generate``, ``export_hf``, ``evaluate``, ``train.init_from``) still work when a
ZeRO optimizer file or a generator-state file is truncated or deleted, and name it in a warning; a
resume needs every file but a missing generator-state file (that rank's dropout masks restart from
the seed, with a warning).

Pure Python (no torch): the preflight, ``reshard`` and ``generate`` import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any

from megaformer.config import ConfigError

MANIFEST = "manifest.json"
"""The manifest's file name inside a ``global_stepN`` directory."""
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"global_step(\d+)$")
_CHUNK = 8 << 20  # bytes per read while hashing


class CheckpointError(ConfigError):
    """A checkpoint that is damaged or incomplete; the message names the file and the way out."""


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(tag_dir: str) -> list[str]:
    """Every file under ``tag_dir`` but the manifest and temporaries, relative, sorted."""
    out = []
    for root, _, names in os.walk(tag_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), tag_dir)
            if rel != MANIFEST and ".tmp" not in name:
                out.append(rel)
    return sorted(out)


def fsync_path(path: str, directory: bool = False) -> None:
    """Flush a file's (or a directory entry list's) data to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write_text(path: str, text: str) -> None:
    """Write ``text`` under a temporary name, fsync it, rename it into place, fsync the directory:
    after a crash the file holds the old text or the new one, never a part."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)


def describe_files(tag_dir: str, rel_paths: list[str]) -> dict[str, dict]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of the given files of ``tag_dir``."""
    return {
        rel: {
            "size": os.path.getsize(os.path.join(tag_dir, rel)),
            "sha256": sha256_file(os.path.join(tag_dir, rel)),
        }
        for rel in rel_paths
    }


def write_manifest(
    tag_dir: str,
    files: dict[str, dict],
    step: int,
    config: dict | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write ``tag_dir/manifest.json`` durably (see :func:`durable_write_text`); return its path.
    ``config``: the run config, which a resume compares with its own before building anything;
    ``extra``: further top-level keys (e.g. ``optimizer_param_order``)."""
    path = os.path.join(tag_dir, MANIFEST)
    body = {"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(files.items()))}
    if config is not None:
        body["config"] = config
    body.update(extra or {})
    durable_write_text(path, json.dumps(body, indent=1) + "\n")
    return path


def write_latest(ckpt_dir: str, tag: str) -> None:
    """Point ``ckpt_dir/latest`` at ``tag`` durably (after the tag's manifest exists)."""
    durable_write_text(os.path.join(ckpt_dir, "latest"), tag)


def read_manifest(tag_dir: str) -> dict | None:
    """The manifest of ``tag_dir``, or None where there is none (a checkpoint written before
    manifests existed).

    Raises:
        CheckpointError: an unreadable manifest.
    """
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        if not isinstance(body.get("files"), dict):
            raise ValueError("no 'files' table")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint manifest ({e}){way_out(tag_dir)}") from None
    return body


NEEDS_ALL, NEEDS_WEIGHTS, NEEDS_RESUME = "all", "weights", "resume"
"""What a reader of a checkpoint needs from it (:func:`verify`'s ``needs``): every file; only the
module weights (``reshard``, ``generate``, ``export_hf``, ``evaluate``, ``train.init_from``); or what
an exact resume loads (every file, but a missing generator-state file only restarts that rank's
dropout masks from the seed)."""


def is_weights_file(rel: str) -> bool:
    """Whether the checkpoint file ``rel`` (relative to its tag directory) holds module weights:
    DeepSpeed's ``mp_rank_XX_model_states.pt``, the pipeline engine's
    ``layer_LL-model_XX-model_states.pt``."""
    return "/" not in rel and os.sep not in rel and rel.endswith("model_states.pt")


def is_rng_file(rel: str) -> bool:
    """Whether ``rel`` is a rank's generator-state file (``rng_state/rankNNNNN.pt``)."""
    return rel.replace(os.sep, "/").startswith("rng_state/")


def needed(rel: str, needs: str) -> bool:
    """Whether a reader with ``needs`` reads the file ``rel``."""
    return needs != NEEDS_WEIGHTS or is_weights_file(rel)


def file_problems(
    tag_dir: str, hash_share: tuple[int, int] | None = (0, 1), needs: str = NEEDS_ALL
) -> list[tuple[str, str, bool]]:
    """What is wrong with ``tag_dir`` against its manifest: ``(relative path, line naming the
    file, whether it is missing)`` per missing file, size mismatch or digest mismatch ([] when
    intact or without a manifest).

    Args:
        hash_share: ``(index, count)``: digest only the files ``index::count`` of the sorted list
            (ranks share the reading); sizes and presence are checked for all files. None: sizes only.
        needs: the files a reader does not need (:func:`needed`) get presence and size checks only.
    """
    body = read_manifest(tag_dir)
    if body is None:
        return []
    out = []
    listed = sorted(body["files"])
    for i, rel in enumerate(listed):
        want = body["files"][rel]
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            out.append((rel, f"{path}: missing (the manifest lists it, {want['size']:,} bytes)", True))
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            line = f"{path}: {size:,} bytes, the manifest says {want['size']:,} (truncated or rewritten)"
            out.append((rel, line, False))
        elif _mine(i, hash_share) and needed(rel, needs) and sha256_file(path) != want["sha256"]:
            out.append((rel, f"{path}: sha256 differs from the manifest's (the file is damaged)", False))
    return out


def problems(tag_dir: str, hash_share: tuple[int, int] | None = (0, 1)) -> list[str]:
    """The lines of :func:`file_problems` (every file needed)."""
    return [line for _, line, _ in file_problems(tag_dir, hash_share)]


def triage(found: list[tuple[str, str, bool]], needs: str) -> tuple[list[str], list[str]]:
    """Split :func:`file_problems` into ``(fatal lines, warnings)`` for a reader with ``needs``: a
    file it does not read is a warning; for a resume, so is a missing generator-state file (that
    rank's dropout masks restart from the seed), while a damaged one stays fatal with the way to
    drop it."""
    fatal, warnings = [], []
    for rel, line, missing in found:
        if not needed(rel, needs):
            warnings.append(f"{line}; not needed to read the weights, ignored")
        elif needs == NEEDS_RESUME and is_rng_file(rel):
            if missing:
                warnings.append(f"{line}; that rank's dropout masks restart from the seed")
            else:
                fatal.append(
                    f"{line} (or delete it to resume with that rank's dropout masks restarting from the seed)"
                )
        else:
            fatal.append(line)
    return fatal, warnings


def warn(tag_dir: str, warnings: list[str]) -> None:
    """Print each warning about a file of ``tag_dir`` on stderr."""
    for line in warnings:
        print(f"[megaformer] WARNING: checkpoint {tag_dir}: {line}", file=sys.stderr, flush=True)


def _mine(index: int, share: tuple[int, int] | None) -> bool:
    return share is not None and index % share[1] == share[0]


def step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """``[(step, tag)]`` of the ``global_stepN`` directories of ``ckpt_dir``, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    found = [
        (int(m.group(1)), n)
        for n in names
        if (m := _STEP_DIR.match(n)) and os.path.isdir(os.path.join(ckpt_dir, n))
    ]
    return sorted(found, reverse=True)


def newest_intact(ckpt_dir: str, exclude: str | None = None) -> str | None:
    """The newest ``global_stepN`` of ``ckpt_dir`` with a manifest its files match (fully hashed),
    other than ``exclude``; None when there is none."""
    for _, tag in step_dirs(ckpt_dir):
        tag_dir = os.path.join(ckpt_dir, tag)
        if os.path.normpath(tag_dir) == os.path.normpath(exclude or ""):
            continue
        try:
            if read_manifest(tag_dir) is not None and not problems(tag_dir):
                return tag
        except CheckpointError:
            continue
    return None


def way_out(tag_dir: str) -> str:
    """The sentence that names the newest intact checkpoint beside a damaged one."""
    parent = os.path.dirname(os.path.normpath(tag_dir))
    good = newest_intact(parent, exclude=tag_dir)
    if good is None:
        return "; no intact global_stepN beside it: start again, or restore it from a copy"
    return (
        f"; the newest intact checkpoint beside it is {good}: resume from it by writing "
        f"'{good}' into {os.path.join(parent, 'latest')} (or pass {os.path.join(parent, good)}, "
        f"or --tag {good} to reshard / generate)"
    )


def verify(
    tag_dir: str, hash_share: tuple[int, int] | None = (0, 1), needs: str = NEEDS_ALL, quiet: bool = False
) -> bool:
    """Check ``tag_dir`` against its manifest; return whether it had one.

    Args:
        hash_share: see :func:`file_problems`.
        needs: what the reader reads (:data:`NEEDS_ALL`, :data:`NEEDS_WEIGHTS`,
            :data:`NEEDS_RESUME`): a damaged file it does not need is named in a warning on stderr
            (none when ``quiet``), not refused.

    Raises:
        CheckpointError: a missing, truncated or damaged file the reader needs; the message lists
            them and names the newest intact ``global_stepN`` beside it.
    """
    fatal, warnings = triage(file_problems(tag_dir, hash_share, needs), needs)
    if fatal:
        raise damaged(tag_dir, fatal)
    if not quiet:
        warn(tag_dir, warnings)
    return read_manifest(tag_dir) is not None


def damaged(tag_dir: str, lines: list[str]) -> CheckpointError:
    """The error naming the damaged files of ``tag_dir`` (five at most) and the way out."""
    return CheckpointError(
        f"checkpoint {tag_dir} is damaged: "
        + "; ".join(lines[:5])
        + (f" (and {len(lines) - 5} more)" if len(lines) > 5 else "")
        + way_out(tag_dir)
    )


def resolve_latest(ckpt_dir: str) -> str:
    """The tag directory ``ckpt_dir/latest`` names.

    Raises:
        CheckpointError: ``latest`` is missing, empty, or names no directory (names the newest
            intact ``global_stepN``).
    """
    latest = os.path.join(ckpt_dir, "latest")
    try:
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError as e:
        raise CheckpointError(f"{latest}: unreadable ({e}){way_out(os.path.join(ckpt_dir, '-'))}") from None
    path = os.path.join(ckpt_dir, tag)
    if not tag or "/" in tag or not os.path.isdir(path):
        what = "is empty" if not tag else f"names '{tag}', which is not a directory beside it"
        raise CheckpointError(f"{latest} {what}{way_out(os.path.join(ckpt_dir, tag or '-'))}")
    return path
