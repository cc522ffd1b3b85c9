"""The test tier's small byte-level BPE (``tests/fixtures/novels-bpe500``): how it was made.

    .venv/bin/python -m tests.support.small_bpe     # rewrites tests/fixtures/novels-bpe500/

A 500-entry byte-level BPE (the 256 byte symbols, ``<|endoftext|>`` as id 0, 243 merges) trained
with the ``tokenizers`` library on the three novels the multi-process tests preprocess
(``tests/distributed/conftest.py``). The runs whose subject is not the GPT-2 vocabulary (layouts,
resume, signals, checkpoints) train on it: their tiny model's output layer has 512 rows instead of
50,304, and its step on 2 CPU ranks takes 0.017 s instead of 0.19 s (d 64, 2 layers, 4 x 64 tokens
per rank; measured 2026-12-07). 500 is not a multiple of 128, so the embedding's padded rows stay
exercised (512 rows at TP 1, 2 and 4). The tests that need GPT-2's tokens (the quickstart's
end-to-end run, the Hugging Face export, lm-eval) keep the GPT-2 data.

The training is deterministic (the same file twice, checked when it was committed); the committed
file, not a fresh training, is what the tests read, so a newer ``tokenizers`` cannot change them.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "tests" / "fixtures" / "novels-bpe500"
BOOKS = ("pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz")
VOCAB_SIZE = 500
EOD = "<|endoftext|>"


def train(out: Path = FOLDER) -> Path:
    """Train the BPE on :data:`BOOKS` and write ``tokenizer.json`` and ``tokenizer_config.json``
    (its ``eos_token``, read by ``data_tools``' ``HuggingFaceTokenizer`` as the EOD) into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    for book in BOOKS:
        with lzma.open(REPO / "data" / "gutenberg-novels" / book, "rt", encoding="utf-8") as f:
            texts.append(f.read())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD}) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    print(train())
