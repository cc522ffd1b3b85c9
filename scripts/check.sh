#!/usr/bin/env bash
# Every check, the same locally and in CI: install (idempotent), lint, format check, tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/install.sh --dev
PY="${VENV:-$ROOT/.venv}/bin/python"
echo "[check] ruff check" >&2
"$PY" -m ruff check .
echo "[check] ruff format --check" >&2
"$PY" -m ruff format --check .
echo "[check] pytest" >&2
"$PY" -m pytest -q "$@"
