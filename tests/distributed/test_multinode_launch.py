"""The multi-node path of launch/pretrain.sh (HOSTFILE + NODE_RANK, no ssh), as two "nodes" on one
machine: a run trains across them, and a SIGTERM to one node's launcher stops both nodes' ranks at
one step with a checkpoint (each node's supervisor, and the ranks' agreement on the stop step)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.distributed.conftest import REPO, free_port, read_scalars

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`


def _overrides(prefix: str, out, steps: int) -> list[str]:
    return [
        f"data.prefix={prefix}", "model.hidden_size=64", "model.num_layers=2",
        "model.num_attention_heads=2", "model.seq_len=64", f"train.steps={steps}", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_interval=4", "train.eval_batches=1",
        "data.valid_fraction=0.02", f"output.dir={out}",
    ]  # fmt: skip


def _two_nodes(tmp_path, overrides: list[str], logs: list | None = None) -> list[subprocess.Popen]:
    """launch/pretrain.sh once per "node" (NODE_RANK 0 and 1, one process each), each in its own
    session as on its own machine; output to ``logs`` (files) or pipes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    procs = []
    for node_rank in (0, 1):
        env = dict(os.environ, NNODES="2", NPROC_PER_NODE="1", HOSTFILE=str(hostfile))
        env.update(NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = ["bash", str(REPO / "launch" / "pretrain.sh"), "configs/normformer-quickstart.yaml", *overrides]
        out = subprocess.PIPE if logs is None else logs[node_rank]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def test_two_nodes_by_hostfile_and_node_rank(gutenberg_prefix, tmp_path):
    procs = _two_nodes(tmp_path, _overrides(gutenberg_prefix, tmp_path / "run", 4))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "world 2 on gloo" in outputs[0] and "dp 2" in outputs[0]
    loss = read_scalars(str(tmp_path / "run" / "tensorboard"))["train/loss"]
    assert sorted(loss) == [1, 2, 3, 4]


def test_sigterm_to_one_nodes_launcher_stops_both_nodes_with_a_checkpoint(gutenberg_prefix, tmp_path):
    """``kill PID`` of node 1's launcher (a preemption notice on one node): its supervisor forwards
    it to its rank, the ranks agree on the stop step, both save there and exit 75, and so do both
    nodes' launchers; no process of the run is left."""
    out = tmp_path / "run"
    paths = [tmp_path / f"node{i}.log" for i in (0, 1)]
    with open(paths[0], "w") as log0, open(paths[1], "w") as log1:
        procs = _two_nodes(tmp_path, _overrides(gutenberg_prefix, out, 1000), [log0, log1])
        try:
            deadline = time.monotonic() + 240
            while "step 1/1000" not in paths[0].read_text():  # the first step is always logged
                assert all(p.poll() is None for p in procs), paths[0].read_text()[-3000:]
                assert time.monotonic() < deadline, paths[0].read_text()[-3000:]
                time.sleep(0.2)
            procs[1].send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=180) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    texts = [p.read_text() for p in paths]
    assert codes == [75, 75], texts[0][-2000:] + texts[1][-2000:]
    assert "SIGTERM received: sending SIGTERM to 1 rank(s)" in texts[1]
    step = int(texts[0].split("stopping at step ")[1].split("/")[0])
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{step}"
    saved = sorted(p.name for p in (out / "checkpoints" / f"global_step{step}" / "rng_state").iterdir())
    assert saved == ["rank00000.pt", "rank00001.pt"]  # both nodes' ranks saved at that step
    assert all("Traceback" not in t for t in texts)
