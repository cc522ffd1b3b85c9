"""The multi-node path of launch/pretrain.sh (HOSTFILE + NODE_RANK, no ssh), as two "nodes" on one machine."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.distributed.conftest import REPO, free_port, read_scalars

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`


def test_two_nodes_by_hostfile_and_node_rank(gutenberg_prefix, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    overrides = [
        f"data.prefix={gutenberg_prefix}", "model.hidden_size=64", "model.num_layers=2",
        "model.num_attention_heads=2", "model.seq_len=64", "train.steps=4", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_interval=4", "train.eval_batches=1",
        "data.valid_fraction=0.02", f"output.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    procs = []
    for node_rank in (0, 1):
        env = dict(os.environ, NNODES="2", NPROC_PER_NODE="1", HOSTFILE=str(hostfile))
        env.update(NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [
                    "bash",
                    str(REPO / "launch" / "pretrain.sh"),
                    "configs/normformer-quickstart.yaml",
                    *overrides,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "world 2 on gloo" in outputs[0] and "dp 2" in outputs[0]
    loss = read_scalars(str(tmp_path / "run" / "tensorboard"))["train/loss"]
    assert sorted(loss) == [1, 2, 3, 4]
