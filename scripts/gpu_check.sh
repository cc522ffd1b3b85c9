#!/usr/bin/env bash
# One command for the day a GPU is there: bench/gpu.py over the recipes that fit one GPU, with the
# planner's and the fake-CUDA dry run's predictions beside each measurement (bench/gpu_check.py),
# written as one JSON and one Markdown table; then the GPU tests (pytest -m gpu tests/gpu). The
# measurements go first, while nothing else uses the GPU; a failing test does not stop the rest.
#   bash scripts/gpu_check.sh                 on a GPU machine (record the table in BENCHMARKS.md)
#   bash scripts/gpu_check.sh --smoke         the CPU path of everything (CI): a tiny model, gloo
# Environment: VENV (default .venv; VENV=none: the current interpreter, e.g. a GPU image's torch),
# SIZES (default 125m,355m,1.3b), CASES (ZeRO/recompute pairs, e.g. 1/none,0/full; default all six),
# STEPS (default 10), OUT (default bench/results/gpu_check.json), PYTEST_ARGS (extra pytest
# arguments, e.g. "-n 6" with pytest-xdist to run the tests side by side on one GPU).
# Exit status: the first failure of the two parts (0 when both pass).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SMOKE=()
[[ "${1:-}" == "--smoke" ]] && SMOKE=(--smoke)
if [[ "${VENV:-}" == "none" ]]; then PY="${PYTHON:-python3}"; else PY="${VENV:-$ROOT/.venv}/bin/python"; fi
OUT="${OUT:-bench/results/gpu_check.json}"
[[ ${#SMOKE[@]} -gt 0 ]] && OUT="${OUT%.json}_smoke.json"
CASE_ARGS=()
[[ -n "${CASES:-}" ]] && CASE_ARGS=(--cases "$CASES")
echo "[gpu_check] bench/gpu.py with predictions beside" >&2
"$PY" bench/gpu_check.py --sizes "${SIZES:-125m,355m,1.3b}" --steps "${STEPS:-10}" --out "$OUT" \
  "${CASE_ARGS[@]}" "${SMOKE[@]}"
BENCH=$?
echo "[gpu_check] pytest -m gpu tests/gpu" >&2
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider ${PYTEST_ARGS:-}
TESTS=$?
echo "[gpu_check] bench exit $BENCH, tests exit $TESTS" >&2
if [[ $BENCH -ne 0 ]]; then exit "$BENCH"; fi
exit "$TESTS"
