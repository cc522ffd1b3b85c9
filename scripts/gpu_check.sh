#!/usr/bin/env bash
# One command for a lent GPU: NormFormer and Pre-LN at 125M, 1.3B and 355M, compiled bf16 on one GPU
# (step time, tokens/s, MFU, peak memory, the attention kernels that ran, NormFormer / Pre-LN per
# size), then a probe that compiled and eager dropout masks and gradients agree on the device; one
# JSON and one Markdown table (bench/gpu_check.py, docs/gpus.md "On a GPU"). Ends inside 8 minutes
# by default. Predictions come afterwards, on the CPU machine: bench/gpu_check.py --repredict.
#
#   bash scripts/gpu_check.sh                  on the GPU machine (the device tool: carry .whl)
#   bash scripts/gpu_check.sh --smoke          the CPU path of everything (CI): a tiny model, gloo
#   bash scripts/gpu_check.sh --stage-wheels   on the CPU machine, before: the wheels into .whl/
#   bash scripts/gpu_check.sh --estimate       the case list and its estimated time on one H200
#
# Environment:
#   PYTHON       the interpreter (default: VENV's python if that exists, else python3: a GPU image's)
#   VENV         a virtual environment (default .venv; VENV=none: python3)
#   OUT          a folder (gets gpu_check.json/.md/.log; the device's $OUT is one) or a path ending in
#                .json (the table and log beside it); default bench/results/gpu_check.json
#   SIZES, CASES, STEPS   bench/gpu_check.py's --sizes (125m,1.3b,355m), --cases (1/none: ZeRO/
#                recompute pairs), --steps (10)
#   BUDGET_S     seconds the whole command may take (default 450; 0: no limit); cases that would not
#                fit are skipped and recorded as such
#   WHEELS       where the wheels are when the interpreter has no DeepSpeed (default .whl, then
#                ../shared/gpu-wheels); SITE: where they are installed (default /tmp/megaformer-gpu-site)
#   PROBE=0      skip the compiled-vs-eager probe (bench/gpu_probe.py; ~1 min)
#   TESTS=1      also run pytest -m gpu tests/gpu afterwards (about 2 min on an H200 with
#                PYTEST_ARGS="-n 7"; needs pytest, which a GPU image has and the quickstart's venv not)
# Exit status: the measurement's (0: every case measured and the probe agreed), else the tests'.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$SECONDS
# The wheels a GPU image lacks (../shared/gpu-wheels/README.md), zstandard left out: only
# data_tools' .zst reader needs it, and the tree a device call carries is limited to 64 MiB.
NEEDED_WHEELS=(deepspeed hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions)

die() { echo "[gpu_check] error: $*" >&2; exit 2; }

stage_wheels() {
  local from="${WHEELS_FROM:-$ROOT/../shared/gpu-wheels}" dest="$ROOT/.whl" name found
  [[ -d "$from" ]] || die "no wheel folder $from: set WHEELS_FROM to the folder of ../shared/gpu-wheels/README.md"
  mkdir -p "$dest"
  for name in "${NEEDED_WHEELS[@]}"; do
    found=("$from/$name"-*.whl)
    [[ -e "${found[0]}" ]] || die "$from has no $name-*.whl (its README lists the wheels a GPU image lacks)"
    cp "${found[@]}" "$dest/"
  done
  if ! git check-ignore -q "$dest/x.whl"; then
    mkdir -p "$(dirname "$(git rev-parse --git-path info/exclude)")"
    echo "/.whl/" >>"$(git rev-parse --git-path info/exclude)"
    echo "[gpu_check] added /.whl/ to $(git rev-parse --git-path info/exclude): git ignores it, a device call carries it"
  fi
  echo "[gpu_check] $(find "$dest" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$dest" | cut -f1), in .whl/. On the GPU machine:"
  echo "  device run: command=\"bash scripts/gpu_check.sh\", carry=[\".whl\"], timeout_s=540"
}

SMOKE=()
case "${1:-}" in
  "") ;;
  --smoke) SMOKE=(--smoke) ;;
  --stage-wheels) stage_wheels; exit 0 ;;
  --estimate) ;;
  -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
  *) die "unknown argument $1 (--smoke, --stage-wheels, --estimate or none; see --help)" ;;
esac

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ "${VENV:-}" == "none" ]]; then
  PY=python3
elif [[ -x "${VENV:-$ROOT/.venv}/bin/python" ]]; then
  PY="${VENV:-$ROOT/.venv}/bin/python"
elif [[ -n "${VENV:-}" ]]; then
  die "VENV=$VENV has no bin/python (make it with VENV=$VENV bash scripts/install.sh, or VENV=none)"
else
  PY=python3  # no .venv here (a device call does not carry it): the image's own python
fi
command -v "$PY" >/dev/null || die "no interpreter $PY (set PYTHON=...)"

ARGS=(--sizes "${SIZES:-125m,1.3b,355m}" --cases "${CASES:-1/none}" --steps "${STEPS:-10}")
[[ "${PROBE:-1}" == "0" ]] && ARGS+=(--no-probe)
if [[ "${1:-}" == "--estimate" ]]; then
  exec "$PY" bench/gpu_check.py "${ARGS[@]}" --estimate
fi

OUT="${OUT:-bench/results/gpu_check.json}"
if [[ "$OUT" == *.json ]]; then
  [[ ${#SMOKE[@]} -gt 0 ]] && OUT="${OUT%.json}_smoke.json"
  LOG="${OUT%.json}.log"
  PYTEST_LOG="${OUT%.json}_pytest.log"
  mkdir -p "$(dirname "$OUT")"
else
  mkdir -p "$OUT" || die "cannot make the folder OUT=$OUT"
  LOG="$OUT/gpu_check.log"
  [[ ${#SMOKE[@]} -gt 0 ]] && LOG="$OUT/gpu_check_smoke.log"
  PYTEST_LOG="$OUT/pytest.log"
fi
exec > >(tee "$LOG") 2>&1
echo "[gpu_check] $(date -u '+%F %T UTC'), python $PY, output $OUT"

# DeepSpeed and its needs: a GPU image has none of them; install the carried wheels without an index.
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  WHEELS="${WHEELS:-}"
  if [[ -z "$WHEELS" ]]; then
    for dir in "$ROOT/.whl" "$ROOT/../shared/gpu-wheels"; do
      compgen -G "$dir/deepspeed-*.whl" >/dev/null && WHEELS="$dir" && break
    done
  fi
  [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null \
    || die "$PY cannot import deepspeed and no wheels were found (WHEELS, .whl/, ../shared/gpu-wheels/): on the CPU machine run 'bash scripts/gpu_check.sh --stage-wheels' and name .whl in the device call's carry"
  SITE="${SITE:-${TMPDIR:-/tmp}/megaformer-gpu-site}"
  echo "[gpu_check] installing $(find "$WHEELS" -type f -name '*.whl' | wc -l) wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || die "pip could not install the wheels of $WHEELS into $SITE (see above)"
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export DEEPSPEED="$SITE/bin/deepspeed"  # the launcher launch/pretrain.sh runs (TESTS=1)
  "$PY" -c "import deepspeed" >/dev/null 2>&1 \
    || die "deepspeed still fails to import from $SITE: $("$PY" -c 'import deepspeed' 2>&1 | tail -1)"
fi

BUDGET="${BUDGET_S:-450}"
BUDGET_ARGS=()
if [[ ${#SMOKE[@]} -eq 0 && "$BUDGET" != "0" ]]; then
  LEFT=$((BUDGET - (SECONDS - START)))
  [[ $LEFT -gt 0 ]] || die "BUDGET_S=$BUDGET was used up by the setup ($((SECONDS - START)) s)"
  BUDGET_ARGS=(--budget-s "$LEFT")
fi
echo "[gpu_check] bench/gpu_check.py: NormFormer / Pre-LN pairs, then the compiled-vs-eager probe"
PYTHONUNBUFFERED=1 "$PY" bench/gpu_check.py "${ARGS[@]}" --out "$OUT" "${BUDGET_ARGS[@]}" "${SMOKE[@]}"
BENCH=$?

TESTS_RC=0
if [[ "${TESTS:-0}" == "1" ]]; then
  if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
    echo "[gpu_check] TESTS=1 but $PY has no pytest: bash scripts/install.sh --dev (or run without TESTS=1)"
    TESTS_RC=2
  else
    echo "[gpu_check] pytest -m gpu tests/gpu ${PYTEST_ARGS:-} (log: $PYTEST_LOG)"
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider ${PYTEST_ARGS:-} >"$PYTEST_LOG" 2>&1
    TESTS_RC=$?
    tail -3 "$PYTEST_LOG"
  fi
fi
TESTS_NOTE=""
[[ "${TESTS:-0}" == "1" ]] && TESTS_NOTE=", tests exit $TESTS_RC"
echo "[gpu_check] measurement exit $BENCH$TESTS_NOTE, $((SECONDS - START)) s in all"
if [[ $BENCH -ne 0 ]]; then exit "$BENCH"; fi
exit "$TESTS_RC"
