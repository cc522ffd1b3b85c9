#!/usr/bin/env bash
# Every check, the same locally and in CI: install (idempotent), lint, format check, tests.
#   bash scripts/check.sh            everything (CI and the README's test command)
#   bash scripts/check.sh --fast     the inner loop: lint, format, every test not marked `slow`
#                                    (the launcher runs, the whole-corpus and subprocess cases)
# Without further arguments pytest runs twice:
#   1. every tier (tests/fakecuda, tests/distributed, tests/unit, tests/gpu) on the machine's cores
#      (pytest-xdist, MEGAFORMER_TEST_WORKERS workers, default `nproc`), whole files per worker so
#      that their session and module fixtures stay with their tests. A launch spends seconds in
#      one-core start-up (the launcher's and the ranks' imports, preflight) and in waits (signals,
#      saves), so a second file beside it fills the core that it leaves idle. Files go out in the
#      order given (--no-loadscope-reorder; xdist would otherwise send the files with the most
#      tests first, which left the two longest single-test files, compare and sweep, to the end):
#      the multi-process tiers first, the unit files fill the gaps at the end;
#   2. the tests marked `serial`, one at a time: they time the machine (budgets, calibrations)
#      and would measure the other worker's load.
# Further arguments go to one pytest call instead (e.g. `bash scripts/check.sh --fast tests/unit -x`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MARK=()
FAST=""
if [[ "${1:-}" == "--fast" ]]; then
  MARK=(-m "not slow")
  FAST="not slow and "
  shift
fi
WORKERS="${MEGAFORMER_TEST_WORKERS:-$(nproc)}"
if [[ ! "$WORKERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "[check] error: MEGAFORMER_TEST_WORKERS='$WORKERS' is not a positive whole number; use e.g. 2" >&2
  exit 2
fi
bash scripts/install.sh --dev
PY="${VENV:-$ROOT/.venv}/bin/python"
# A full disk turns the launcher tests into hundreds of setup errors and hung collectives (a CI run
# that timed out at 90 min): refuse up front instead. The full suite's peak is measured in README.
NEED_GIB="${MEGAFORMER_CHECK_FREE_GIB:-8}"
if [[ ! "$NEED_GIB" =~ ^[0-9]+$ ]]; then
  echo "[check] error: MEGAFORMER_CHECK_FREE_GIB='$NEED_GIB' is not a whole number of GiB; use e.g. 8" >&2
  exit 2
fi
TMP="$("$PY" -c 'import tempfile; print(tempfile.gettempdir())')"
for dir in "$TMP" "$ROOT"; do
  free_gib=$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')
  if ((free_gib < NEED_GIB)); then
    echo "[check] error: $dir has ${free_gib} GiB free; the tests need ${NEED_GIB} GiB." >&2
    echo "[check] fix: free space there (old ${TMP}/pytest-of-$(id -un), runs/), or point TMPDIR at a" >&2
    echo "[check]      larger disk; MEGAFORMER_CHECK_FREE_GIB=N changes the threshold." >&2
    exit 2
  fi
done
# A parent that blocks or ignores the stop signals changes what every signal test sees: say so.
echo "[check] stop signals here: $("$PY" -c 'import os; from tests.support.signal_state import describe; print(describe(os.getpid()))')" >&2
echo "[check] ruff check" >&2
"$PY" -m ruff check .
echo "[check] ruff format --check" >&2
"$PY" -m ruff format --check .
start=$SECONDS
rc=0
if (($#)); then
  echo "[check] pytest ${MARK[*]:-} $*" >&2
  "$PY" -m pytest -q "${MARK[@]}" "$@" || rc=$?
else
  # Both calls run even when the first fails, so one CI run reports every failure.
  # pytest's exit 5 (nothing selected: --fast leaves no serial test) is not a failure.
  tier() { "$PY" -m pytest -q "$@" || { local code=$?; ((code == 5)) || rc=$code; }; }
  echo "[check] pytest -m '${FAST}not serial' tests/fakecuda tests/distributed tests/unit tests/gpu on $WORKERS workers" >&2
  tier -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "${FAST}not serial" \
    tests/fakecuda tests/distributed tests/unit tests/gpu
  parallel=$((SECONDS - start))
  # Only the files that mark a test `serial` are collected (collecting every tier to deselect all
  # but six tests took 11 s).
  mapfile -t SERIAL_FILES < <(grep -rlE --include='test_*.py' 'pytest\.mark\.serial' \
    tests/distributed tests/fakecuda tests/unit tests/gpu | sort)
  if ((${#SERIAL_FILES[@]})); then
    echo "[check] pytest -m '${FAST}serial' ${SERIAL_FILES[*]}, one at a time" >&2
    tier -m "${FAST}serial" "${SERIAL_FILES[@]}"
  fi
  echo "[check] the parallel pass took $((parallel / 60)) min $((parallel % 60)) s" >&2
fi
echo "[check] pytest took $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s" >&2
exit "$rc"
