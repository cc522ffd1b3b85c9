"""CheckpointManager.save when a write fails (a full disk): the cause is named, the partial directory
goes (a single process: nobody else writes into it), `latest` stays."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megaformer.checkpoint import manager as ck
from megaformer.checkpoint.integrity import CheckpointError
from megaformer.config import load_config


class FullDiskEngine:
    """Writes part of its file, then fails as torch.save does on a full disk."""

    def save(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        os.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
        with open(os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"\0" * 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . basic_ios::clear: iostream error")


def test_a_failed_write_removes_the_directory_and_keeps_latest(tmp_path, monkeypatch):
    cfg = load_config("configs/normformer-quickstart.yaml", [f"output.dir={tmp_path}"])
    (tmp_path / "checkpoints" / "global_step4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step4")
    monkeypatch.setattr(ck, "save_rng_state", lambda *a, **k: None)
    layout = SimpleNamespace(rank=0, world_size=1, is_main=True, rng_layout=dict, device=torch.device("cpu"))
    saver = ck.CheckpointManager(cfg, layout)
    saver.attach(FullDiskEngine(), dropout_rng=None)
    with pytest.raises(CheckpointError) as err:
        saver.save(8)
    msg = str(err.value)
    assert f"rank 0: saving {tmp_path / 'checkpoints' / 'global_step8'} failed: RuntimeError:" in msg
    assert "iostream error" in msg and "4,096 bytes written under" in msg and "bytes free" in msg
    assert "'latest' still names global_step4; the partial directory was removed" in msg
    assert not (tmp_path / "checkpoints" / "global_step8").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step4"


def test_a_full_disk_is_named_although_torch_hides_the_errno(tmp_path, monkeypatch):
    """torch.save's error carries no errno: a probe write into the directory asks the file system."""
    import errno

    from megaformer.checkpoint import storage

    cfg = load_config("configs/normformer-quickstart.yaml", [f"output.dir={tmp_path}"])
    monkeypatch.setattr(ck, "save_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(storage, "probe", lambda directory: OSError(errno.ENOSPC, "No space left on device"))
    layout = SimpleNamespace(rank=0, world_size=1, is_main=True, rng_layout=dict, device=torch.device("cpu"))
    with pytest.raises(CheckpointError) as err:
        saver = ck.CheckpointManager(cfg, layout)
        saver.attach(FullDiskEngine(), dropout_rng=None)
        saver.save(4)
    msg = str(err.value)
    assert "global_step4 failed: no space left on device (4,096 bytes written under" in msg
    assert "No checkpoint was completed ('latest' absent)" in msg


def test_the_saved_parameter_order_is_read_from_the_manifest(tmp_path):
    """A resume builds its optimizer in the order its checkpoint's optimizer state follows: the
    manifest's ``optimizer_param_order``, ``declared`` for a checkpoint written before the key."""
    from megaformer.checkpoint.integrity import write_manifest

    tag = tmp_path / "global_step4"
    tag.mkdir()
    write_manifest(str(tag), {}, 4, {"model": {}})
    assert ck.saved_param_order(str(tag)) == "declared"  # an older checkpoint: its own order kept
    write_manifest(str(tag), {}, 4, {"model": {}}, extra={"optimizer_param_order": "aligned"})
    assert ck.saved_param_order(str(tag)) == "aligned"
    write_manifest(str(tag), {}, 4, extra={"optimizer_param_order": "by-size"})
    with pytest.raises(CheckpointError, match=r"optimizer_param_order 'by-size'.*newer megaformer"):
        ck.saved_param_order(str(tag))
    assert ck.saved_param_order(str(tmp_path)) == "declared"  # no manifest at all


def test_aligned_order_moves_odd_sized_parameters_last_and_keeps_each_part_in_order():
    import dataclasses

    from megaformer.config.schema import ModelConfig
    from megaformer.model import NormFormerLM, aligned_order, param_groups

    config = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, seq_len=32)
    model = NormFormerLM(dataclasses.replace(config, head_scale=True))
    declared = list(model.parameters())
    ordered = aligned_order(declared)
    odd = [p for p in declared if p.numel() % 16]
    assert len(odd) == 2 and all(p.numel() == 4 for p in odd)  # HeadScale γ of each layer
    assert ordered == [p for p in declared if p.numel() % 16 == 0] + odd
    (group,) = param_groups(model, 0.1, "all", order="aligned")
    assert [id(p) for p in group["params"]] == [id(p) for p in ordered]
    with pytest.raises(ValueError, match="parameter order 'sorted'"):
        param_groups(model, 0.1, order="sorted")
