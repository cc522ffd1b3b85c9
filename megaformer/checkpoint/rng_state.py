"""Random-generator state in checkpoints, one file per rank, for exact resume with dropout.

DeepSpeed's checkpoint holds the model, optimizer and scheduler, and the ``client_state`` of one
rank per model-parallel group; it holds no generator state. With dropout on, a resumed run would
restart the masks from the seed and its losses would leave the uninterrupted run's at the first
step. Each rank therefore writes its own states next to DeepSpeed's files, before DeepSpeed
writes the ``latest`` tag (so a checkpoint that ``latest`` names always has them):

``{checkpoint_dir}/{tag}/rng_state/rank{global_rank:05d}.pt``: a dict with the ``layout`` that
wrote it (tp, pp, dp sizes and this rank's coordinates), the :class:`~megaformer.parallel.rng.
DropoutRNG` region states, torch's CPU state, the CUDA state of this rank's device (if on GPU),
numpy's and Python's ``random`` states, and ``dropout_device``, the device type of the dropout
generators (``"cpu"``, ``"cuda"``).

Resume on another device type (a checkpoint written on GPUs resumed on a CPU, or the reverse): a
CUDA generator's state (16 bytes of Philox seed and offset) cannot drive a CPU generator (a 5056-byte
Mersenne Twister state), nor the reverse, and no conversion keeps the masks' stream. The dropout
generators are then re-seeded, deterministically, from the run seed, the rank's coordinates, the
step and the two device types (:meth:`~megaformer.parallel.rng.DropoutRNG.reseed`): the same resume
draws the same masks every time, and the log names both types. The device-independent states
(torch's CPU generator, numpy, Python) are restored; the saved CUDA state is used only on a GPU.
Files written before ``dropout_device`` was recorded are told by the states' size.

Dropout streams belong to a (tp, pp, dp) coordinate, so they are restored only at the layout that
saved them; at another layout (``train.init_from``, or a resume on a different world size) the
masks restart from the seed, and :func:`load_rng_state` says so.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import torch

from megaformer.parallel.rng import REGIONS, DropoutRNG, state_device_type


def rng_state_path(tag_dir: str, rank: int) -> str:
    """``{tag_dir}/rng_state/rank{rank:05d}.pt``."""
    return os.path.join(tag_dir, "rng_state", f"rank{rank:05d}.pt")


def save_rng_state(
    tag_dir: str, rank: int, layout: dict[str, int], dropout_rng: DropoutRNG, device: torch.device
) -> str:
    """Write this rank's generator states under ``tag_dir``; returns the file's path.

    Written to a temporary name and renamed, so a killed save leaves no file that loads.

    Args:
        tag_dir: the checkpoint's tag directory (``.../checkpoints/global_step{N}``); created.
        rank: the global rank.
        layout: ``{"tp": .., "pp": .., "dp": .., "tp_rank": .., "pp_rank": .., "dp_rank": ..}``;
            compared on load.
        dropout_rng: the run's dropout generator states.
        device: the rank's device; its CUDA generator state is saved when it is a GPU.
    """
    path = rng_state_path(tag_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "layout": dict(layout),
        "dropout": dropout_rng.state_dict(),
        "dropout_device": dropout_rng.device.type,
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": _numpy_state_plain(np.random.get_state()),
        "python": random.getstate(),
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_rng_state(
    tag_dir: str,
    rank: int,
    layout: dict[str, int],
    dropout_rng: DropoutRNG,
    device: torch.device,
    step: int | None = None,
) -> tuple[bool, str]:
    """Restore this rank's generator states saved by :func:`save_rng_state`, if they fit.

    Args:
        step: the checkpoint's step; seeds the dropout generators when the states were saved on
            another device type (see the module docstring). None: read from ``tag_dir``'s name
            (``global_stepN``), else 0.

    Raises:
        RuntimeError: the file exists but cannot be read (truncated or damaged); names it.

    Returns:
        ``(restored, line for the log)``: restored, or why not (no file: a checkpoint of an older
        version or of another tool; another layout; another device type, the dropout generators
        then re-seeded). None is an error: only dropout masks differ from the uninterrupted run's,
        and only when dropout is on.
    """
    path = rng_state_path(tag_dir, rank)
    if not os.path.isfile(path):
        return False, f"no generator state at {path}: dropout masks restart from the seed"
    try:
        # Tensors, tuples and numbers since files carry numpy's state as a tensor; files written
        # before that hold numpy arrays, whose three reconstruction globals are allowed here.
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise RuntimeError(
            f"{path}: unreadable generator state ({type(e).__name__}: {e}); the checkpoint is damaged: "
            "resume from an earlier global_stepN, or delete this file to resume with dropout masks "
            "restarting from the seed"
        ) from e
    if state["layout"] != dict(layout):
        return False, (
            f"generator state in {path} was saved at layout {state['layout']}, this run is {dict(layout)}: "
            "dropout masks restart from the seed"
        )
    saved_type = state.get("dropout_device") or state_device_type(state["dropout"][REGIONS[0]])
    restored, line = True, f"restored generator states from {path}"
    if saved_type == dropout_rng.device.type:
        dropout_rng.load_state_dict(state["dropout"], device_type=saved_type)
    else:
        step = _step_of(tag_dir) if step is None else step
        dropout_rng.reseed(f"resumed at step {step}: {saved_type} -> {dropout_rng.device.type}")
        restored, line = (
            False,
            (
                f"generator states in {path} were saved on {saved_type}, this run's dropout runs on "
                f"{dropout_rng.device.type}: a {saved_type} generator's state cannot drive a "
                f"{dropout_rng.device.type} one, so dropout masks are re-seeded from the run seed and step "
                f"{step} (deterministic; they differ from the uninterrupted {saved_type} run's); torch's "
                "CPU, numpy's and Python's states are restored"
            ),
        )
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    np.random.set_state(_numpy_state_from(state["numpy"]))
    random.setstate(state["python"])
    return restored, line


def _step_of(tag_dir: str) -> int:
    """N of a ``.../global_stepN`` tag directory; 0 for another name."""
    name = os.path.basename(os.path.normpath(tag_dir))
    digits = name[len("global_step") :]
    return int(digits) if name.startswith("global_step") and digits.isdigit() else 0


def _numpy_state_plain(state: tuple) -> tuple:
    """numpy's legacy ``RandomState`` state (``('MT19937', uint32[624], pos, has_gauss, gauss)``)
    with the key array as an int64 tensor: the file then loads with ``weights_only=True`` and no
    numpy globals."""
    name, key, pos, has_gauss, gauss = state
    return (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))


def _numpy_state_from(saved: tuple) -> tuple:
    """The inverse of :func:`_numpy_state_plain`; a state saved as numpy arrays passes through."""
    name, key, *rest = saved
    if isinstance(key, torch.Tensor):
        key = key.numpy().astype(np.uint32)
    return (name, key, *rest)


def _numpy_globals() -> list:
    """What an older generator-state file's numpy arrays refer to (reconstruction only, no code)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
