"""Reading checkpoint files without running their code.

A ``.pt`` file is a pickle, and unpickling it in full (``torch.load(..., weights_only=False)``) calls
whatever callables the file names: a checkpoint handed over by someone else can run code with the
reader's rights. Every megaformer tool that reads weights (``generate``, ``export_hf``, ``evaluate``,
``zero_shot``, ``reshard``, ``train.init_from``) therefore reads them through :func:`load_weights`:
``torch.load(weights_only=True)`` (PyTorch's restricted unpickler, its default since 2.6), which
builds tensors, plain containers and the types listed in :data:`ALLOWED_GLOBALS`, and nothing else.

What megaformer's checkpoints hold (checked with ``torch.serialization.get_unsafe_globals_in_checkpoint``
on the runs of the test suite):

- ``mp_rank_XX_model_states.pt`` (DeepSpeed's module file, with our client state: the run config as
  a plain dict, step, tokens): tensors, ``OrderedDict``, ``torch.Size``, numbers and strings. At ZeRO
  stage 0 DeepSpeed also writes its optimizer's state into it, which may hold the data classes in
  :data:`ALLOWED_GLOBALS` (a loss scaler, the ZeRO stage enum, a fragment address).
- ``layer_LL-model_XX-model_states.pt`` (pipeline engine): a module ``state_dict``, tensors only.
- ``rng_state/rankNNNNN.pt``: tensors, tuples and numbers (older files: numpy arrays, read with
  numpy's array types allowed; see :mod:`megaformer.checkpoint.rng_state`).

One reader allows one more type: :mod:`megaformer.tools.import_fairseq` passes ``argparse.Namespace``
(``extra_globals``), the ``args`` of fairseq's argparse-era checkpoints, a plain attribute bag.

DeepSpeed's optimizer files (``*_optim_states.pt``) are read only by DeepSpeed itself, when a run
resumes from its own ``output.dir`` (the user's own files); no tool opens them.

A file that names any other global is refused with :class:`UntrustedCheckpointError`, naming the
file and the globals, before any of it is unpickled. For a source the user trusts, the tools take
``--trust-checkpoint-code`` and the trainer ``train.trust_checkpoint_code=true``: the full unpickler,
with a warning on stderr naming the file.
"""

from __future__ import annotations

import glob
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import torch

from megaformer.checkpoint.formats import CHECKPOINT_DATA_CLASS_NAMES, checkpoint_data_classes

# the tools' switch and its config key, named where no torch is imported (a tool's --help)
from megaformer.config.schema import TRUST_FLAG, TRUST_KEY


class CheckpointReadError(ValueError):
    """A checkpoint file that cannot be read (damaged, or not allowed); the message names the file."""


class UntrustedCheckpointError(CheckpointReadError):
    """A checkpoint file whose pickle names a callable or class outside :data:`ALLOWED_GLOBALS`.

    Attributes:
        path: the file.
        globals: the disallowed ``module.name`` strings the file refers to.
    """

    def __init__(self, path: str, names: list[str]):
        self.path, self.globals = path, names
        shown = ", ".join(names) if names else "a type torch's weights-only unpickler refuses"
        super().__init__(
            f"{path}: refers to {shown}, which loading weights does not allow: unpickling it could run "
            f"code with your rights. If you trust whoever made this file, pass {TRUST_FLAG} to the tool "
            f"({TRUST_KEY}=true for train.init_from); otherwise ask for a checkpoint written by "
            "megaformer.train, which needs no such type"
        )


def allowed_globals() -> list[Any]:
    """The globals a megaformer checkpoint file may name besides torch's defaults (see module doc):
    DeepSpeed's plain data classes (:func:`~megaformer.checkpoint.formats.checkpoint_data_classes`)."""

    return checkpoint_data_classes()


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def referenced_globals(path: str) -> list[str] | None:
    """The globals outside torch's defaults that ``path``'s pickle refers to, from its opcodes only
    (``torch.serialization.get_unsafe_globals_in_checkpoint``: nothing in the file runs); None when
    the file cannot be scanned (a legacy non-zip file, torch < 2.5, a damaged file)."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:  # torch < 2.5: the load's own error names the first one
        return None
    try:
        return list(scan(path))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):
        return None


def unsafe_globals(path: str, extra_globals: Sequence[Any] = ()) -> list[str]:
    """The globals ``path``'s pickle refers to that the weights-only load would refuse.

    Reads the pickle's opcodes only (:func:`referenced_globals`): nothing in the file runs, and
    DeepSpeed is not imported (its allowed classes are known by name). A file that cannot be
    scanned: ``[]``, and the load itself refuses what it must. ``extra_globals``: types this caller
    allows besides :func:`allowed_globals`.
    """

    names = referenced_globals(path) or []
    allowed = set(CHECKPOINT_DATA_CLASS_NAMES) | {_qualified(g) for g in extra_globals}
    return sorted(n for n in names if n not in allowed)


def refuse_untrusted(paths: list[str], trust_code: bool = False) -> None:
    """Scan every file of ``paths`` (opcodes only, nothing runs) before any of them is loaded.

    Raises:
        UntrustedCheckpointError: the first file that refers to a disallowed global, unless
            ``trust_code``.
    """
    if trust_code:
        return
    for path in paths:
        bad = unsafe_globals(path)
        if bad:
            raise UntrustedCheckpointError(path, bad)


def weight_files(tag_dir: str) -> list[str]:
    """The files of a checkpoint tag directory that hold module weights (``*model_states.pt``:
    DeepSpeed's ``mp_rank_XX_model_states.pt`` and the pipeline engine's ``layer_LL-model_XX-...``)."""
    return sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt")))


def warn_trusted(path: str) -> None:
    """Say on stderr that ``path`` is unpickled in full because the user trusted it."""
    print(
        f"[megaformer] WARNING: {TRUST_FLAG}: unpickling {path} in full (weights_only=False); "
        "any code it carries runs",
        file=sys.stderr,
        flush=True,
    )


def load_weights(
    path: str, trust_code: bool = False, mmap: bool = True, extra_globals: Sequence[Any] = ()
) -> Any:
    """``torch.load`` of a checkpoint file that may come from someone else, on the CPU.

    Args:
        path: a ``.pt`` file.
        trust_code: unpickle in full (the old behaviour), with a warning naming the file.
        mmap: memory-map the file (tensors are read from disk when touched); a legacy (non-zip)
            file, which cannot be mapped, is read whole.
        extra_globals: plain data types this one reader also allows (e.g. ``argparse.Namespace``
            for :mod:`megaformer.tools.import_fairseq`: fairseq's argparse-era checkpoints pickle
            their arguments as one); each must be a class without side effects on construction.

    Raises:
        UntrustedCheckpointError: the file refers to a global outside torch's defaults and
            :data:`allowed_globals` (named), and ``trust_code`` is off. Nothing of it was unpickled.
        CheckpointReadError: the file is truncated or damaged (names it and the way out).
    """

    if trust_code:
        warn_trusted(path)
    else:
        bad = unsafe_globals(path, extra_globals)
        if bad:
            raise UntrustedCheckpointError(path, bad)
    names = referenced_globals(path)
    # DeepSpeed (seconds to import, a banner on stdout) only for a file that names its classes, or
    # one that could not be scanned
    ds = names is None or any(n in CHECKPOINT_DATA_CLASS_NAMES for n in names)
    try:
        with torch.serialization.safe_globals([*(allowed_globals() if ds else []), *extra_globals]):
            return _torch_load(path, weights_only=not trust_code, mmap=mmap)
    except pickle.UnpicklingError as e:
        if not trust_code and "weights_only" in str(e):
            raise UntrustedCheckpointError(path, _named_in(str(e))) from e
        raise _damaged(path, e) from e
    except (RuntimeError, OSError, EOFError) as e:
        raise _damaged(path, e) from e


def _torch_load(path: str, weights_only: bool, mmap: bool) -> Any:
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
            pass
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _named_in(message: str) -> list[str]:
    """The global that torch's weights-only error names (``Unsupported global: GLOBAL x.y``)."""
    marker = "GLOBAL "
    if marker not in message:
        return []
    return [message.split(marker, 1)[1].split()[0].rstrip(".,")]


def _damaged(path: str, e: BaseException) -> CheckpointReadError:
    return CheckpointReadError(
        f"{path}: not a readable checkpoint file ({type(e).__name__}: {e}); it is truncated or "
        "damaged: load another global_stepN (--tag) or rewrite it from a good copy"
    )
