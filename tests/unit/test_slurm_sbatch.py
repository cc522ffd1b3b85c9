"""launch/slurm.sbatch with stand-in srun, scontrol and deepspeed on PATH: arguments kept whole,
GPUs requested, processes per node from the allocation, hostfile in the run directory, requeue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SRUN = """#!/usr/bin/env bash
# stand-in: one task per node, SLURM_NODEID set, the command run as given (options recorded, skipped)
while [[ "$1" == --* ]]; do echo "$1" >> "$CALLS/srun_options.log"; shift; done
rc=0
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then echo node-a; echo node-b; exit 0; fi
echo "$*" >> "$CALLS/scontrol.log"
"""
DEEPSPEED = """#!/usr/bin/env python3
import json, os, sys
calls = os.environ["CALLS"]
with open(os.path.join(calls, "node%s.json" % os.environ["NODE_RANK"]), "w") as f:
    json.dump({"argv": sys.argv[1:], "hostfile": open(os.environ["HOSTFILE"]).read(),
               "hostfile_path": os.environ["HOSTFILE"], "nnodes": os.environ["NNODES"]}, f)
sys.exit(int(os.environ.get("STANDIN_RC", "0")))
"""


def _run(tmp_path: Path, extra_env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    calls.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("deepspeed", DEEPSPEED)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # pretrain.sh asks the python beside the launcher for the GPU count: this one (a wrapper, so
    # that the virtual environment's packages come with it)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DEEPSPEED": str(bin_dir / "deepspeed"),
        "CALLS": str(calls),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
        **extra_env,
    }
    blend = "data.blend=0.7 /data/a_text_document 0.3 /data/b_text_document"
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), "configs/normformer-quickstart.yaml", blend,
         # 128: the quickstart's micro-batch of 8 on each of up to 16 data-parallel ranks (the launch
         # checks the layout for the allocation's processes before it starts any)
         "train.global_batch_size=128", f"output.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,  # sbatch runs in the submit dir
    )  # fmt: skip
    return proc, calls


def test_sbatch_keeps_arguments_whole_and_sizes_nodes_from_the_allocation(tmp_path):
    proc, calls = _run(tmp_path, {"SLURM_GPUS_ON_NODE": "4"})
    assert proc.returncode == 0, proc.stderr
    hostfile = tmp_path / "run" / "hostfile-42"
    for rank in (0, 1):
        call = json.loads((calls / f"node{rank}.json").read_text())
        argv = call["argv"]
        assert "data.blend=0.7 /data/a_text_document 0.3 /data/b_text_document" in argv  # one argument
        assert argv[argv.index("--num_gpus") + 1] == "4" and argv[argv.index("--node_rank") + 1] == str(rank)
        assert "--no_ssh" in argv and argv[argv.index("--master_addr") + 1] == "node-a"
        assert call["hostfile_path"] == str(hostfile) and call["nnodes"] == "2"
        assert call["hostfile"] == "node-a slots=4\nnode-b slots=4\n"
    assert not list(REPO.glob(".hostfile-*"))  # nothing written into the repository
    assert "#SBATCH --gpus-per-node=" in (REPO / "launch" / "slurm.sbatch").read_text()  # GPUs asked


def test_sbatch_typed_gpu_count_and_requeue_after_a_stopped_run(tmp_path):
    proc, calls = _run(
        tmp_path, {"SLURM_GPUS_PER_NODE": "a100:2", "STANDIN_RC": "75", "MEGAFORMER_REQUEUE": "1"}
    )
    assert proc.returncode == 75
    argv = json.loads((calls / "node0.json").read_text())["argv"]
    assert argv[argv.index("--num_gpus") + 1] == "2"
    assert (calls / "scontrol.log").read_text().strip() == "requeue 42"


def test_sbatch_bad_config_stops_before_srun(tmp_path):
    bad = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), "configs/normformer-quickstart.yaml", "train.nope=1"],
        cwd=REPO, env={**os.environ, "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "x",
                           "SLURM_JOB_ID": "1"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "error: " in bad.stderr and "train.nope" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_sbatch_gives_the_node_task_all_its_cores_and_nccl_error_handling(tmp_path):
    """srun does not pin the launcher's processes to one core, the task asks for the node's cores,
    and a failed or timed-out collective aborts the job (TORCH_NCCL_ASYNC_ERROR_HANDLING=1)."""
    proc, calls = _run(tmp_path, {"SLURM_CPUS_ON_NODE": "64"})
    assert proc.returncode == 0, proc.stderr
    options = (calls / "srun_options.log").read_text().split()
    assert "--cpu-bind=none" in options and "--cpus-per-task=64" in options, options
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert f"#   {name}=" in text  # documented in the header
    assert 'TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"' in text
