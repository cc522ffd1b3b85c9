#!/usr/bin/env bash
# SST-2 after in-domain pretraining (issue 37 item 5): the corpus, the two masked LMs at equal
# compute, then each fine-tuned on SST-2 beside its random-initialisation control. EXPERIMENTS.md
# "SST-2 after task-adaptive pretraining" has the record. Run from the repository root:
#   bash experiments/sst2-tapt/run.sh FULL_GLUE_SST2_TRAIN_TSV GLUE_SST2_TEST_TSV
# (GLUE's SST-2 train.tsv and test.tsv; origin and hashes in data/sst2-text/SOURCE.md; not read
# where data/sst2-text/ already holds the corpus, as it does in the repository.)
# Environment: OUT (runs/sst2-tapt), BUDGET (device-hours per model, 0.5) and PRETRAIN_SET (more
# --set overrides for both pretraining runs, space-separated). The 2026-12-02 masked-head record:
#   OUT=runs/sst2-masked-head BUDGET=1.0 PRETRAIN_SET=model.mlm_head_positions=masked \
#     bash experiments/sst2-tapt/run.sh
set -euo pipefail
PY="${VENV:-.venv}/bin/python"
OUT="${OUT:-runs/sst2-tapt}"
BUDGET="${BUDGET:-0.5}"
SETS=(--set budget.overrun=1000)
for kv in ${PRETRAIN_SET:-}; do SETS+=(--set "$kv"); done
LRS=(1e-4 3e-4 1e-3)
if [[ ! -f data/sst2-text/sst2_train_sentences.jsonl.xz ]]; then
  "$PY" experiments/sst2-tapt/make_corpus.py "${1:?GLUE SST-2 train.tsv}" data/glue/SST-2/dev.tsv "${2:?test.tsv}" data/sst2-text
fi
PY="$PY" bash experiments/sst2-tapt/preprocess.sh
echo "[sst2-tapt] pretraining $(date -u +%T)"
"$PY" -m megaformer.experiments.compare experiments/sst2-tapt/{pre_ln,normformer}.yaml \
  --budget-device-hours "$BUDGET" --output-dir "$OUT" "${SETS[@]}"
for m in pre_ln normformer; do
  echo "[sst2-tapt] fine-tuning $m $(date -u +%T)"
  "$PY" -m megaformer.tools.finetune --checkpoint "$OUT/$m/checkpoints" --task sst2 --data data/glue \
    --epochs 3 --batch-size 32 --lr "${LRS[@]}" --no-save-best
  "$PY" -m megaformer.tools.finetune --checkpoint "$OUT/$m/checkpoints" --task sst2 --data data/glue \
    --epochs 3 --batch-size 32 --lr "${LRS[@]}" --no-save-best --random-init
done
"$PY" -m megaformer.tools.finetune --table "$OUT"/{pre_ln,normformer}/finetune{,-random-init} \
  > "$OUT/sst2-table3.md"
echo "[sst2-tapt] done $(date -u +%T)"
