"""``parallel.timeout_minutes`` reaches every process group: the world (DeepSpeed's
``init_distributed``), megaformer's tp / pp / dp / mp groups, and groups made later without a
timeout (DeepSpeed's pipeline engine makes its own that way)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megaformer.config import ConfigError, load_config

QUICK = "configs/normformer-quickstart.yaml"


def test_bad_timeouts_are_refused_at_config_load():
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=r"parallel\.timeout_minutes=.*must be > 0"):
            load_config(QUICK, [f"parallel.timeout_minutes={bad}"])


def test_every_group_gets_the_configured_timeout(monkeypatch):
    from megaformer.training.builders import build_layout

    seen: list = []
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        seen.append(kwargs.get("timeout"))
        return real_new_group(*args, **kwargs)

    import deepspeed

    inits: list = []
    real_init = deepspeed.init_distributed

    def init_distributed(*args, **kwargs):
        inits.append(kwargs.get("timeout"))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        monkeypatch.setattr(distributed_c10d, name, getattr(distributed_c10d, name))
    # init_distributed fills in what a plain start lacks; set here, monkeypatch takes them away after
    # (a later test in this process would otherwise see RANK without MASTER_PORT)
    for name, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(29000 + os.getpid() % 1000))
    cfg = load_config(QUICK, ["parallel.timeout_minutes=45", "parallel.backend=gloo"])
    try:
        build_layout(cfg, 1)
        want = datetime.timedelta(minutes=45)
        assert inits == [want]
        assert seen and all(t == want for t in seen), seen  # tp, dp, pp, mp groups
        for backend in ("gloo", "nccl"):  # later groups without a timeout: DeepSpeed's pipeline groups
            assert distributed_c10d._get_default_timeout(backend) == want
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_timeout_may_change_on_resume():
    from megaformer.checkpoint.resume_rules import MAY_CHANGE

    assert "parallel.timeout_minutes" in MAY_CHANGE
