#!/usr/bin/env bash
# Install megaformer into a virtual environment (default ./.venv; VENV=... to change, VENV=none to use
# the current interpreter). torch goes in first, on its own: here that takes the local CPU build of
# torch==2.13.0, on a GPU cluster PyPI's CUDA build; everything after it finds torch satisfied and
# never resolves another one (which would pull gigabytes of CUDA packages).
#   scripts/install.sh          runtime requirements
#   scripts/install.sh --dev    + test and lint tools (requirements-dev.txt)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [[ "$VENV" == "none" ]]; then
  PY="${PYTHON:-python3}"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "[install] torch==$TORCH_VERSION" >&2
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
STAMP="$VENV/.megaformer-installed"
[[ "$VENV" == "none" ]] && STAMP="$ROOT/.megaformer-installed"
want="requirements.txt"
[[ "${1:-}" == "--dev" ]] && want="requirements.txt requirements-dev.txt"
sig="$(cd "$ROOT" && cat pyproject.toml $want | sha256sum | cut -c1-16) $want"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$sig" ]]; then
  exit 0  # nothing changed since the last install
fi
echo "[install] $want (+ megaformer, editable)" >&2
args=(-r "$ROOT/requirements.txt")
[[ "${1:-}" == "--dev" ]] && args+=(-r "$ROOT/requirements-dev.txt")
"${PIP[@]}" "${args[@]}" -e "$ROOT" 2> >(grep -v "^WARNING: Location" >&2)
"$PY" -c 'import torch, deepspeed; print(f"[install] torch {torch.__version__}, deepspeed {deepspeed.__version__}")' >&2
echo "$sig" > "$STAMP"
