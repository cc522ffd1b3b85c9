#!/usr/bin/env bash
# One command for the day a GPU is there: the GPU tests, then bench/gpu.py over the recipes that fit
# one GPU with the planner's and the fake-CUDA dry run's predictions beside each measurement
# (bench/gpu_check.py), written as one JSON and one Markdown table.
#   bash scripts/gpu_check.sh                 on a GPU machine (record the table in BENCHMARKS.md)
#   bash scripts/gpu_check.sh --smoke         the CPU path of everything (CI): a tiny model, gloo
# Environment: VENV (default .venv; VENV=none: the current interpreter, e.g. a GPU image's torch),
# SIZES (default 125m,355m,1.3b), STEPS (default 10), OUT (default bench/results/gpu_check.json).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SMOKE=()
[[ "${1:-}" == "--smoke" ]] && SMOKE=(--smoke)
if [[ "${VENV:-}" == "none" ]]; then PY="${PYTHON:-python3}"; else PY="${VENV:-$ROOT/.venv}/bin/python"; fi
OUT="${OUT:-bench/results/gpu_check.json}"
[[ ${#SMOKE[@]} -gt 0 ]] && OUT="${OUT%.json}_smoke.json"
echo "[gpu_check] pytest -m gpu tests/gpu" >&2
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
echo "[gpu_check] bench/gpu.py with predictions beside" >&2
"$PY" bench/gpu_check.py --sizes "${SIZES:-125m,355m,1.3b}" --steps "${STEPS:-10}" --out "$OUT" "${SMOKE[@]}"
