#!/usr/bin/env bash
# Tokenize the SST-2 records' pretraining text into data/processed/ (Megatron .bin/.idx, GPT-2 BPE,
# EOD after each document): SST-2's training and test sentences (data/sst2-text) and the bundled
# novels. A prefix whose .idx exists is kept. Called by experiments/sst2-tapt/run.sh and
# experiments/sst2-lowdata/run.sh from the repository root, with PY the interpreter.
set -euo pipefail
PY="${PY:-${VENV:-.venv}/bin/python}"
T=(--tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-bpe/encoder.json --merge-file data/gpt2-bpe/vocab.bpe)
for input in sst2_train_sentences.jsonl.xz sst2_test_sentences.jsonl; do
  name=${input%_sentences.jsonl*}
  [[ -f data/processed/${name}_text_document.idx ]] ||
    "$PY" -m data_tools.preprocess --input data/sst2-text/$input \
      --output-prefix data/processed/$name "${T[@]}" --append-eod --workers 1
done
[[ -f data/processed/gutenberg_text_document.idx ]] ||
  "$PY" -m data_tools.preprocess --input data/gutenberg-novels/*.txt.xz \
    --output-prefix data/processed/gutenberg "${T[@]}" --append-eod --workers 2
