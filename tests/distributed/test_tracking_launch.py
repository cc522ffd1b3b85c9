"""Experiment tracking (issue 13): the run's config.json records the git commit and the versions of
megaformer, torch and deepspeed, and still loads as a config; with output.wandb_project and
WANDB_MODE=offline the scalars go to a local W&B run as well. One process, started the plain way:
``python -m megaformer.train CONFIG overrides`` (no launcher)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.distributed.conftest import REPO

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_attention_heads=2",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.steps=2",
    "train.warmup_steps=1",
    "train.log_interval=1",
    "train.eval_interval=2",
    "train.eval_batches=1",
    "train.save_interval=0",
    "train.zero_stage=0",
    "train.deepspeed_config=",
]


def test_config_json_provenance_and_offline_wandb(gutenberg_prefix, tmp_path):
    pytest.importorskip("wandb")
    import deepspeed
    import torch

    import megaformer
    from megaformer.config import load_config

    run = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "megaformer.train", "configs/normformer-quickstart.yaml", *TINY,
        f"data.prefix={gutenberg_prefix}", f"output.dir={run}", "output.wandb_project=megaformer-test",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    record = json.loads((run / "config.json").read_text())
    prov = record["provenance"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert prov["git_commit"] == head and isinstance(prov["git_dirty"], bool)
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["versions"]["deepspeed"] == deepspeed.__version__
    assert prov["versions"]["megaformer"] == megaformer.__version__
    assert load_config(str(run / "config.json")).output.wandb_project == "megaformer-test"  # reloadable

    (wandb_file,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(wandb_file, "rb").read()  # noqa: SIM115  (W&B's record log: protobuf, keys verbatim)
    for key in (b"train/loss", b"train/lr", b"valid/loss", b"git_commit", b"megaformer-test"):
        assert key in data, key
    run_id = (run / "wandb_run_id").read_text().strip()
    assert wandb_file.endswith(f"run-{run_id}.wandb")


def test_wandb_project_without_wandb_is_refused_before_training(monkeypatch):
    from megaformer.config import ConfigError
    from megaformer.training.tracking import check_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_wandb("my-project")
    check_wandb("")  # off: nothing to check
