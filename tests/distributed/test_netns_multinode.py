"""Two "nodes" in their own network namespaces, joined by a veth pair: NODE_RANK launches with
MASTER_ADDR on the link, so every byte between the ranks crosses a real network interface.

Needs root (or CAP_NET_ADMIN) to create namespaces: skipped with the reason where the machine does
not allow it. Behind ``MEGAFORMER_SLOW_TESTS=1`` (one 2-node run, ~15 s idle).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.distributed.conftest import REPO, free_port, read_scalars

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

NS = [f"mf{os.getpid()}a", f"mf{os.getpid()}b"]
ADDR = ["10.231.0.1", "10.231.0.2"]
IFACE = ["mfva", "mfvb"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_namespaces():
    made = _ip("netns", "add", NS[0])
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip() or made.returncode}")
    try:
        _ip("netns", "add", NS[1])
        _ip("link", "add", IFACE[0], "type", "veth", "peer", "name", IFACE[1])
        for ns, iface, addr in zip(NS, IFACE, ADDR):
            _ip("link", "set", iface, "netns", ns)
            for cmd in (
                ["addr", "add", f"{addr}/24", "dev", iface],
                ["link", "set", iface, "up"],
                ["link", "set", "lo", "up"],
            ):
                assert _ip("netns", "exec", ns, "ip", *cmd).returncode == 0, cmd
        yield
    finally:
        for ns in NS:
            _ip("netns", "del", ns)


@pytest.mark.skipif(not os.environ.get("MEGAFORMER_SLOW_TESTS"), reason="set MEGAFORMER_SLOW_TESTS=1")
def test_two_nodes_over_a_veth_link(two_namespaces, gutenberg_prefix, tmp_path):
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
        # gloo binds the interface named here (else it resolves the host name, not in the namespace)
        env.update(NODE_RANK=str(node_rank), MASTER_ADDR=ADDR[0], MASTER_PORT=port)
        env.update(GLOO_SOCKET_IFNAME=IFACE[node_rank], NCCL_SOCKET_IFNAME=IFACE[node_rank])
        cmd = ["ip", "netns", "exec", NS[node_rank], "bash", str(REPO / "launch" / "pretrain.sh")]
        procs.append(
            subprocess.Popen(
                [*cmd, "configs/normformer-quickstart.yaml", *overrides],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "world 2 on gloo" in outputs[0] and f"master {ADDR[0]}:{port}" in outputs[0]
    assert sorted(read_scalars(str(tmp_path / "run" / "tensorboard"))["train/loss"]) == [1, 2, 3, 4]
