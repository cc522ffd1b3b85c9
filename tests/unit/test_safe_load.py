"""Weights are read without running a checkpoint's code (megaformer.checkpoint.safe_load)."""

from __future__ import annotations

import collections

import pytest
import torch

from megaformer.checkpoint.safe_load import (
    CheckpointReadError,
    UntrustedCheckpointError,
    load_weights,
    refuse_untrusted,
    unsafe_globals,
    weight_files,
)
from tests.support.malicious_checkpoint import Payload


def _module_state():
    return {
        "module": collections.OrderedDict(w=torch.randn(3, 2), b=torch.zeros(2)),
        "param_shapes": [collections.OrderedDict(w=torch.Size([3, 2]))],
        "config": {"model": {"hidden_size": 64}, "train": {"lr": 1e-3}},
        "step": 4,
        "ds_version": "0.19.8",
    }


def test_megaformer_shaped_file_loads_with_weights_only(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(_module_state(), path)
    state = load_weights(str(path))
    assert torch.equal(state["module"]["w"], torch.load(path, weights_only=True)["module"]["w"])
    assert state["config"]["train"]["lr"] == 1e-3 and unsafe_globals(str(path)) == []


def test_deepspeed_optimizer_data_classes_are_allowed(tmp_path):
    """What DeepSpeed's ZeRO-0 optimizer state puts in the module file (a loss scaler, the ZeRO
    stage enum) loads; the classes are restored, not their code run."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "mp_rank_00_model_states.pt"
    state = _module_state()
    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, True)
    state["optimizer"] = {"loss_scaler": scaler, "stage": ZeroStageEnum(0)}
    torch.save(state, path)
    loaded = load_weights(str(path))
    assert loaded["optimizer"]["loss_scaler"].cur_scale == 2.0**16
    assert loaded["optimizer"]["stage"] is ZeroStageEnum(0)


def test_payload_is_refused_with_file_and_type_and_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "mp_rank_00_model_states.pt"
    state = _module_state()
    state["extra"] = Payload(f"touch {marker}")
    torch.save(state, path)
    with pytest.raises(UntrustedCheckpointError) as err:
        load_weights(str(path))
    message = str(err.value)
    assert str(path) in message and "posix.system" in message and "--trust-checkpoint-code" in message
    assert err.value.globals == ["posix.system"] and not marker.exists()
    with pytest.raises(UntrustedCheckpointError):
        refuse_untrusted(weight_files(str(tmp_path)))
    assert not marker.exists()


def test_trust_flag_gives_the_old_behaviour_and_says_so(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    path = tmp_path / "layer_01-model_00-model_states.pt"
    torch.save({"w": torch.ones(2), "extra": Payload(f"touch {marker}")}, path)
    refuse_untrusted(weight_files(str(tmp_path)), trust_code=True)  # no scan when trusted
    state = load_weights(str(path), trust_code=True)
    assert torch.equal(state["w"], torch.ones(2)) and marker.exists()
    err = capsys.readouterr().err
    assert "WARNING: --trust-checkpoint-code" in err and str(path) in err


def test_weight_files_are_the_module_and_layer_files(tmp_path):
    for name in (
        "mp_rank_00_model_states.pt",
        "layer_03-model_01-model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "manifest.json",
    ):
        (tmp_path / name).write_bytes(b"")
    names = [p.rsplit("/", 1)[1] for p in weight_files(str(tmp_path))]
    assert names == ["layer_03-model_01-model_states.pt", "mp_rank_00_model_states.pt"]


def test_damaged_file_is_a_read_error_naming_it(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(_module_state(), path)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointReadError, match=r"mp_rank_00_model_states\.pt: not a readable checkpoint"):
        load_weights(str(path))
