#!/usr/bin/env bash
# The main job, on a fresh clone: install, tokenize the bundled Gutenberg novels with the GPT-2 BPE,
# pretrain the quickstart NormFormer on 2 DeepSpeed processes (gloo on CPU, nccl on GPUs), then print
# where the TensorBoard logs and the checkpoint are, and the final validation loss against the
# corpus's unigram entropy. Extra arguments are config overrides, e.g. train.steps=100.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)

bash scripts/install.sh
PY="${VENV:-$ROOT/.venv}/bin/python"

PREFIX=data/processed/gutenberg
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-bpe/encoder.json --merge-file data/gpt2-bpe/vocab.bpe)
if [[ -f "${PREFIX}_text_document.idx" && -f "${PREFIX}_text_document.bin" ]]; then
  echo "[quickstart] ${PREFIX}_text_document.bin/.idx already built" >&2
  if [[ ! -f "${PREFIX}_text_document.stats.json" ]]; then
    # Built before datasets carried their statistics sidecar: add it (one scan), as the trainer asks.
    "$PY" -m data_tools.stats --data-prefix "${PREFIX}_text_document" --eod-token 50256 "${TOKENIZER[@]}"
  fi
else
  "$PY" -m data_tools.preprocess \
    --input data/gutenberg-novels/*.txt.xz \
    --output-prefix "$PREFIX" \
    "${TOKENIZER[@]}" \
    --append-eod --workers 2
fi

NPROC_PER_NODE="${NPROC_PER_NODE:-2}" bash launch/pretrain.sh configs/normformer-quickstart.yaml \
  "data.prefix=${PREFIX}_text_document" output.overwrite=true "$@"

"$PY" - "$START" "$@" <<'PYEOF'
import json, math, os, sys, time
from megaformer.config import load_config
from megaformer.tools.plot import plot_runs

cfg = load_config("configs/normformer-quickstart.yaml", [a for a in sys.argv[2:] if "=" in a])
s = json.load(open(f"{cfg.output.dir}/summary.json"))
plots = os.path.abspath(os.path.join(cfg.output.dir, "plots"))
pngs = plot_runs([cfg.output.dir], plots)  # loss, per-layer gradient norms, learned scales
print()
print("=" * 78)
print(f"quickstart finished in {time.time() - int(sys.argv[1]):.0f} s (install + tokenize + train)")
print(f"  final validation loss   {s['final_valid_loss']:.4f} nats/token (perplexity {s['final_valid_ppl']:.1f})")
print(f"  unigram entropy         {s['unigram_entropy']:.4f} nats/token (best loss without context)")
print(f"  training throughput     {s['tokens_per_s']:,.0f} tokens/s over {s['world_size']} processes")
print(f"  TensorBoard             tensorboard --logdir {s['tensorboard_dir']}")
print(f"  {f'plots ({len(pngs)} PNGs)':<24}{plots}  (python -m megaformer.tools.plot RUN_DIR ...)")
print(f"  checkpoint              {s['checkpoint_dir']}")
print(f"  sample text             .venv/bin/python -m megaformer.tools.generate --checkpoint {s['checkpoint_dir']} --prompt 'It was'")
print("=" * 78)
PYEOF
