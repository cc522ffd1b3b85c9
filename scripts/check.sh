#!/usr/bin/env bash
# Every check, the same locally and in CI: install (idempotent), lint, format check, tests.
#   bash scripts/check.sh            everything (CI and the README's test command)
#   bash scripts/check.sh --fast     the inner loop: lint, format, every test not marked `slow`
#                                    (the launcher runs), a few minutes on a 2-core machine
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
echo "[check] ruff check" >&2
"$PY" -m ruff check .
echo "[check] ruff format --check" >&2
"$PY" -m ruff format --check .
echo "[check] pytest ${MARK[*]:-}" >&2
start=$SECONDS
"$PY" -m pytest -q "${MARK[@]}" "$@"
echo "[check] pytest took $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s" >&2
