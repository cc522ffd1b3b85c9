#!/usr/bin/env bash
# Every check, the same locally and in CI: install (idempotent), lint, format check, tests.
#   bash scripts/check.sh            everything (CI and the README's test command)
#   bash scripts/check.sh --fast     the inner loop: lint, format, every test not marked `slow`
#                                    (the launcher runs), about 7 minutes on a 2-core machine
# Further arguments go to pytest (e.g. `bash scripts/check.sh --fast tests/unit -x`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MARK=()
if [[ "${1:-}" == "--fast" ]]; then
  MARK=(-m "not slow")
  shift
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
echo "[check] ruff check" >&2
"$PY" -m ruff check .
echo "[check] ruff format --check" >&2
"$PY" -m ruff format --check .
echo "[check] pytest ${MARK[*]:-}" >&2
start=$SECONDS
"$PY" -m pytest -q "${MARK[@]}" "$@"
echo "[check] pytest took $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s" >&2
