#!/usr/bin/env bash
# Launch megaformer pretraining through the DeepSpeed launcher.
#
#   launch/pretrain.sh CONFIG.yaml [section.key=value ...]
#
# Environment (Megatron / torchrun names):
#   NNODES          nodes in the job (default 1)
#   NPROC_PER_NODE  processes per node (default: the GPU count, or 2 on a CPU-only machine)
#   HOSTFILE        DeepSpeed hostfile ("host slots=N" lines) for multi-node runs (ssh/pdsh)
#   NODE_RANK       set it to start this node's processes yourself (Slurm, no ssh): --no_ssh
#   MASTER_ADDR     rendezvous host (default 127.0.0.1)
#   MASTER_PORT     rendezvous port (default: a free port on a single node, else 29500)
#   MEGAFORMER_MODULE  the module every rank runs (default megaformer.train); compare's step-
#                   interleaved calibration runs megaformer.experiments.step_timing SPEC.json with it
#   DEEPSPEED       the launcher executable (default: the repo's .venv/bin/deepspeed when no virtual
#                   environment is active (VIRTUAL_ENV unset), else the first deepspeed on PATH)
#   MEGAFORMER_STOP_TIMEOUT_S  seconds the ranks get to save and exit after a stop signal (600)
# On a CPU-only machine the processes run on gloo with OMP_NUM_THREADS = cores / NPROC_PER_NODE.
#
# The PID this script returns is the job: SIGTERM or SIGINT (kill PID, Ctrl-C, timeout) makes every
# rank save a checkpoint and exit; the script then exits 75 (0 complete, 2 a config, data or
# checkpoint error, or an output.dir another live run holds). docs/train.md#stopping-a-run
#
# Without this script (the same trainer, one process per rank):
#   torchrun --nproc_per_node=N -m megaformer.train CONFIG.yaml [section.key=value ...]
#   python -m megaformer.train CONFIG.yaml [section.key=value ...]        (one process)
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  # The comment block above, without the shebang and without the code after it.
  sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [[ $# -lt 1 ]] && exit 2
  exit 0
fi
CONFIG="$1"
shift
if [[ ! -f "$CONFIG" ]]; then
  echo "error: config file '$CONFIG' not found; pass a YAML such as configs/normformer-quickstart.yaml" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${DEEPSPEED:-}" ]]; then
  if [[ -z "${VIRTUAL_ENV:-}" && -x "$ROOT/.venv/bin/deepspeed" ]]; then
    DEEPSPEED="$ROOT/.venv/bin/deepspeed"
  elif command -v deepspeed >/dev/null 2>&1; then
    DEEPSPEED="$(command -v deepspeed)"
  else
    echo "error: the deepspeed launcher was not found; run scripts/install.sh (or pip install -r requirements.txt)" >&2
    exit 2
  fi
fi
PYTHON="$(dirname "$DEEPSPEED")/python"
[[ -x "$PYTHON" ]] || PYTHON=python3

NNODES="${NNODES:-1}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
# Ask torch only where a GPU can be: without NVIDIA's or ROCm's device nodes (or WSL's) torch sees
# none, and importing it costs 1.5-3.5 s of every CPU launch.
GPUS=0
if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [[ -e /dev/kfd || -e /dev/dxg ]]; then
  GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
fi
if [[ "$GPUS" -gt 0 ]]; then
  NPROC_PER_NODE="${NPROC_PER_NODE:-$GPUS}"
else
  NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
  # DeepSpeed's CPU accelerator + gloo; the launcher does not size thread pools, and
  # oversubscribed OpenMP threads made a 4-process CPU run 2.2x slower (FACTS-DEEPSPEED-CPU.md).
  export DS_ACCELERATOR=cpu
  CORES="$(nproc)"
  THREADS=$(( CORES / NPROC_PER_NODE ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}"
fi
if [[ -z "${MASTER_PORT:-}" ]]; then
  if [[ "$NNODES" -eq 1 ]]; then
    MASTER_PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  else
    MASTER_PORT=29500
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# A bad key or value in the config or an override, a layout the job's processes cannot make, a
# missing or damaged dataset or an output.dir the run cannot write (on one node): said once, here,
# before the launcher starts a worker per rank (each would print it among the launcher's lines,
# ~8 s later on 2 CPU cores). Exit 2 is the check's verdict; anything else (an interpreter without megaformer's
# requirements) leaves the check to the workers.
MODULE="${MEGAFORMER_MODULE:-megaformer.train}"
if [[ "$MODULE" == megaformer.train ]]; then
  CHECK=(--check-config --world-size "$((NNODES * NPROC_PER_NODE))")
  # The files too where this node is the job's only one. On several nodes each worker's preflight
  # checks them where it runs: a dataset staged to every node's local disk need not exist here.
  if [[ "$NNODES" -eq 1 ]]; then CHECK+=(--check-files); fi
  CHECK_OUT="$("$PYTHON" -m megaformer.train "${CHECK[@]}" "$CONFIG" "$@" 2>&1)" && CHECK_RC=0 || CHECK_RC=$?
  if [[ "$CHECK_RC" -eq 2 ]]; then
    echo "$CHECK_OUT" >&2
    exit 2
  fi
fi

ARGS=(--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "$HOSTFILE" ]] || { echo "error: HOSTFILE='$HOSTFILE' not found" >&2; exit 2; }
  ARGS+=(--hostfile "$HOSTFILE" --num_nodes "$NNODES" --num_gpus "$NPROC_PER_NODE")
  if [[ -n "${NODE_RANK:-}" ]]; then
    ARGS+=(--no_ssh --node_rank "$NODE_RANK")
  fi
elif [[ "$NNODES" -gt 1 ]]; then
  echo "error: NNODES=$NNODES needs HOSTFILE (lines 'hostname slots=$NPROC_PER_NODE')" >&2
  exit 2
else
  ARGS+=(--num_gpus "$NPROC_PER_NODE")
fi

echo "[pretrain.sh] $NNODES node(s) x $NPROC_PER_NODE process(es), master $MASTER_ADDR:$MASTER_PORT, config $CONFIG $*" >&2
# The PID this script returns stays the job's: a supervisor (megaformer/training/supervisor.py)
# refuses an output.dir a live run holds (exit 2, before any worker), runs DeepSpeed's launcher in
# a process group of its own, and forwards SIGTERM / SIGINT to every rank as the run's stop signal
# (they save and exit 75; the launcher's code is this script's). docs/train.md#stopping-a-run.
RUN=()
[[ "$MODULE" == megaformer.train ]] && RUN=("$CONFIG" "$@")
exec "$PYTHON" -m megaformer.training.supervisor "${RUN[@]}" -- \
  "$DEEPSPEED" "${ARGS[@]}" --module "$MODULE" "$CONFIG" "$@"
