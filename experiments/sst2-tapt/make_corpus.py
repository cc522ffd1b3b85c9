"""Unlabelled in-domain text for masked-LM pretraining: the sentences of GLUE SST-2's training split.

    .venv/bin/python experiments/sst2-tapt/make_corpus.py FULL_TRAIN_TSV DEV_TSV TEST_TSV OUT_DIR

GLUE's SST-2 ``train.tsv`` holds 67,349 phrases of the Stanford Sentiment Treebank's training
sentences, each full sentence among them and most phrases a substring of another. The corpus is its
*maximal* phrases (those contained in no other phrase: the training sentences), labels dropped, one
JSON document ``{"text": ...}`` per phrase, in the file's order; rows equal to a dev sentence are
refused (none are expected: GLUE's dev set comes from SST's separate dev split). Nothing of the dev
set enters the corpus. The test split's 1,821 sentences (GLUE ships them without labels) go to a
second file, the pretraining's validation text. Task-adaptive pretraining on the task's own
unlabelled text: Gururangan et al. 2020 ("Don't Stop Pretraining", Sec. 4); an LM pretrained on
in-domain text for sentiment classification: Dai & Le 2015.

Exit status: 0 written; 2 a missing or malformed input (named with its line) or a dev sentence
found in the corpus; nothing is written then.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sys
from pathlib import Path


def _fail(message: str) -> None:
    """Say what is wrong and exit 2, before anything is written."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_tsv(path: Path) -> list[str]:
    """The ``sentence`` column of a GLUE SST-2 file (header ``sentence\\tlabel`` or, for the test
    split, ``index\\tsentence``), stripped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t") if lines else []
    if "sentence" not in header:
        _fail(f"{path}: line 1 has no 'sentence' column (GLUE SST-2's header)")
    col = header.index("sentence")
    out = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            _fail(
                f"{path}: line {number} has {len(fields)} tab-separated fields, the header {len(header)}; "
                "is the file cut short or not GLUE's?"
            )
        out.append(fields[col].strip())
    return out


def write_jsonl(out: Path, texts: list[str]) -> None:
    """One ``{"text": ...}`` per line, written to a temporary name and renamed; xz-compressed where
    ``out`` ends in ``.xz`` (data_tools.preprocess reads it as it is)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    data = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
    tmp.write_bytes(lzma.compress(data, preset=9) if out.suffix == ".xz" else data)
    tmp.replace(out)


def maximal(phrases: list[str]) -> list[str]:
    """The distinct phrases contained in no other, in first-seen order (longest first search)."""
    distinct = list(dict.fromkeys(phrases))
    kept: list[str] = []
    joined = ""
    for phrase in sorted(distinct, key=len, reverse=True):
        # Space-padded so that a phrase must match whole words of a kept one.
        if f" {phrase} " not in joined:
            kept.append(phrase)
            joined += f"\n {phrase} \n"
    keep = set(kept)
    return [p for p in distinct if p in keep]


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    train, dev, test, out_dir = (Path(a) for a in argv)
    for p in (train, dev, test):
        if not p.is_file():
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    phrases = read_tsv(train)
    sentences = maximal(phrases)
    dev_set = set(read_tsv(dev))
    leaked = [s for s in sentences if s in dev_set]
    if leaked:
        print(f"error: {len(leaked)} corpus sentences are dev sentences, e.g. {leaked[0]!r}", file=sys.stderr)
        return 2
    test_sentences = read_tsv(test)  # every input read before anything is written
    out = out_dir / "sst2_train_sentences.jsonl.xz"  # xz: the repository's largest text, 805 KB raw
    write_jsonl(out, sentences)
    write_jsonl(out_dir / "sst2_test_sentences.jsonl", test_sentences)
    digest = hashlib.sha256(train.read_bytes()).hexdigest()
    words = sum(len(s.split()) for s in sentences)
    print(f"{out}: {len(sentences):,} sentences ({words:,} words) of {len(phrases):,} phrases")
    print(f"input sha256 {digest}")
    print(f"{out_dir / 'sst2_test_sentences.jsonl'}: {len(test_sentences):,} test sentences")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
