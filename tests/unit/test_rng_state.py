"""Per-rank generator state in checkpoints: restored at the saving layout only, never half-written."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from megaformer.checkpoint.rng_state import load_rng_state, rng_state_path, save_rng_state
from megaformer.parallel.rng import DropoutRNG

CPU = torch.device("cpu")
LAYOUT = {"tp": 2, "pp": 1, "dp": 1, "tp_rank": 1, "pp_rank": 0, "dp_rank": 0}


def _draw(rng: DropoutRNG) -> torch.Tensor:
    with rng.fork("sharded"):
        return torch.rand(8)


def test_round_trip_continues_every_stream(tmp_path):
    rng = DropoutRNG(7, tp_rank=1)
    _draw(rng)
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    path = save_rng_state(str(tmp_path / "global_step5"), 1, LAYOUT, rng, CPU)
    assert path == rng_state_path(str(tmp_path / "global_step5"), 1) and os.path.isfile(path)
    assert not [p for p in os.listdir(os.path.dirname(path)) if ".tmp" in p]
    expected = (_draw(rng), torch.rand(3), np.random.rand(3), random.random())

    fresh = DropoutRNG(7, tp_rank=1)  # a restarted process: streams back at the seed
    torch.manual_seed(0)
    restored, message = load_rng_state(str(tmp_path / "global_step5"), 1, LAYOUT, fresh, CPU)
    assert restored and message.startswith("restored generator states from")
    got = (_draw(fresh), torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert np.array_equal(got[2], expected[2]) and got[3] == expected[3]


def test_damaged_file_is_a_clear_error(tmp_path):
    path = save_rng_state(str(tmp_path), 0, LAYOUT, DropoutRNG(7), CPU)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(RuntimeError, match=r"rank00000\.pt: unreadable generator state .* damaged"):
        load_rng_state(str(tmp_path), 0, LAYOUT, DropoutRNG(7), CPU)


def test_other_layout_or_missing_file_restarts_from_the_seed(tmp_path):
    rng = DropoutRNG(7, tp_rank=1)
    _draw(rng)
    save_rng_state(str(tmp_path), 1, LAYOUT, rng, CPU)
    fresh = DropoutRNG(7, tp_rank=1)
    seed_draw = _draw(DropoutRNG(7, tp_rank=1))
    restored, message = load_rng_state(str(tmp_path), 1, {**LAYOUT, "dp": 2}, fresh, CPU)
    assert not restored and "was saved at layout" in message and "restart from the seed" in message
    assert torch.equal(_draw(fresh), seed_draw)  # untouched
    restored, message = load_rng_state(str(tmp_path), 0, LAYOUT, fresh, CPU)
    assert not restored and message.startswith("no generator state at") and "rank00000.pt" in message


def test_file_needs_no_unpickling_beyond_tensors(tmp_path):
    """Tensors, tuples and numbers only: ``weights_only=True`` with no allowed globals reads it."""
    path = save_rng_state(str(tmp_path), 0, LAYOUT, DropoutRNG(7), CPU)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    torch.load(path, weights_only=True)


def test_file_written_before_the_safe_format_still_restores(tmp_path):
    """Older files carry numpy's state as a numpy array (numpy's reconstruction globals): restored."""
    np.random.seed(11)
    path = save_rng_state(str(tmp_path), 0, LAYOUT, DropoutRNG(7), CPU)
    old = torch.load(path, weights_only=True)
    old["numpy"] = np.random.get_state()  # as the code before the change wrote it
    torch.save(old, path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path)  # needs numpy's globals
    expected = np.random.rand(3)
    np.random.seed(0)
    restored, _ = load_rng_state(str(tmp_path), 0, LAYOUT, DropoutRNG(7), CPU)
    assert restored and np.array_equal(np.random.rand(3), expected)


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged-cuda", "untagged-older-file"])
def test_cuda_generator_states_resume_on_cpu_reseeded(tmp_path, tagged):
    """Issue 39: a checkpoint written on a GPU (CUDA Philox states: 16 bytes each) resumed on a CPU
    crashed at the first dropout; now the dropout generators are re-seeded from the seed and the
    step (the same masks on every such resume), said in the log, and the other streams restored."""
    from megaformer.parallel.rng import cuda_philox_state

    tag_dir = str(tmp_path / "global_step40")
    np.random.seed(11)
    path = save_rng_state(tag_dir, 1, LAYOUT, DropoutRNG(7, tp_rank=1), CPU)
    state = torch.load(path, weights_only=True)
    state["dropout"] = {r: cuda_philox_state(100 + i) for i, r in enumerate(("replicated", "sharded"))}
    state["cuda"] = cuda_philox_state(5)
    if tagged:
        state["dropout_device"] = "cuda"
    else:
        state.pop("dropout_device", None)  # written before the type was recorded: told by the size
    torch.save(state, path)
    np.random.seed(11)
    expected_numpy = np.random.rand(3)

    draws = []
    for _ in range(2):
        rng = DropoutRNG(7, tp_rank=1)
        np.random.seed(0)
        restored, message = load_rng_state(tag_dir, 1, LAYOUT, rng, CPU)
        assert not restored
        assert "saved on cuda" in message and "runs on cpu" in message and "step 40" in message
        assert "re-seeded" in message
        draws.append(_draw(rng))  # crashed before: "Expected a CPUGeneratorImplState of size 5056"
        assert np.array_equal(np.random.rand(3), expected_numpy)  # device-independent: restored
    assert torch.equal(draws[0], draws[1])  # deterministic
    assert not torch.equal(draws[0], _draw(DropoutRNG(7, tp_rank=1)))  # not the step-0 stream


def test_dropout_rng_refuses_states_of_another_device_type():
    from megaformer.parallel.rng import GeneratorDeviceError, cuda_philox_state

    rng = DropoutRNG(7)
    before = rng.state_dict()
    cuda_states = {"replicated": cuda_philox_state(1), "sharded": cuda_philox_state(2)}
    with pytest.raises(GeneratorDeviceError, match=r"cuda generator's \(16 bytes\).* serves cpu"):
        rng.load_state_dict(cuda_states)
    with pytest.raises(GeneratorDeviceError, match="serves cpu"):
        rng.load_state_dict(before, device_type="cuda")
    assert all(torch.equal(rng.state_dict()[r], before[r]) for r in before)  # nothing changed


def test_cpu_generator_states_resume_on_a_cuda_dropout_rng_reseeded(tmp_path):
    """The reverse (a CPU checkpoint resumed on GPUs), without a GPU: the dropout states become
    CUDA Philox states from the seed and step, the same on every such resume."""
    tag_dir = str(tmp_path / "global_step8")
    save_rng_state(tag_dir, 0, LAYOUT, DropoutRNG(7), CPU)
    states = []
    for _ in range(2):
        rng = DropoutRNG(7, device="cuda")  # builds Philox states; draws nothing here
        restored, message = load_rng_state(tag_dir, 0, LAYOUT, rng, CPU)
        assert not restored and "saved on cpu" in message and "runs on cuda" in message
        assert all(s.numel() == 16 for s in rng.state_dict().values())
        states.append(rng.state_dict())
    assert all(torch.equal(states[0][r], states[1][r]) for r in states[0])
    assert not torch.equal(states[0]["sharded"], DropoutRNG(7, device="cuda").state_dict()["sharded"])
