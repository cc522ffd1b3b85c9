"""Sentence-level labels for GLUE's SST-2 test sentences (GLUE ships them unlabelled), for a larger
evaluation set than the 872-sentence dev set (issue 37 item 5). Run from the repository root:

    python experiments/sst2-test-labels/make_labels.py LABELLED_TEST_TSV

LABELLED_TEST_TSV: ``data/SST2/test.tsv`` of ``clairett/pytorch-sentiment-classification`` at
457ffd8 (1,821 lines ``sentence<TAB>label``, lowercased, brackets as ``lrb``/``rrb``; the labels are
SST's sentence-level binary ones, Socher et al. 2013). Each of GLUE's test sentences
(``data/sst2-text/sst2_test_sentences.jsonl``, GLUE's order and text) is matched to one line: by its
letters and digits where those agree exactly, else to the most similar line left over (difflib
ratio of the same normal forms, each line used once, ratio >= 0.85 required). Writes
``data/glue/SST-2/test_labelled.tsv`` (``sentence<TAB>label``, as ``dev.tsv``) and prints the match
counts, the lowest fuzzy ratios, and the check that matters: the same file's dev labels against
GLUE's dev labels (pass the dev file as a second argument).
"""

from __future__ import annotations

import csv
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def normal(text: str) -> str:
    """Letters and digits, lowercased; the PTB bracket words ``lrb``/``rrb`` dropped."""
    words = [w for w in text.lower().split() if w not in ("-lrb-", "-rrb-", "lrb", "rrb")]
    return re.sub(r"[^a-z0-9]", "", "".join(words))


def read_labelled(path: str) -> list[tuple[str, int]]:
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            text, label = line.rstrip("\n").rsplit("\t", 1)
            if label not in ("0", "1"):
                raise SystemExit(f"{path}:{n}: label {label!r} is not 0 or 1")
            rows.append((text, int(label)))
    return rows


def match(sentences: list[str], rows: list[tuple[str, int]]) -> tuple[list[int], list[float]]:
    """The label of each sentence, and the fuzzy ratios used (exact matches not listed)."""
    by_norm: dict[str, list[int]] = {}
    for i, (text, _) in enumerate(rows):
        by_norm.setdefault(normal(text), []).append(i)
    labels: list[int | None] = [None] * len(sentences)
    used: set[int] = set()
    for s, sentence in enumerate(sentences):
        hits = [i for i in by_norm.get(normal(sentence), []) if i not in used]
        if hits:
            used.add(hits[0])
            labels[s] = rows[hits[0]][1]
    ratios = []
    for s, sentence in enumerate(sentences):
        if labels[s] is not None:
            continue
        left = [i for i in range(len(rows)) if i not in used]
        scored = [
            (difflib.SequenceMatcher(None, normal(sentence), normal(rows[i][0])).ratio(), i) for i in left
        ]
        ratio, best = max(scored)
        if ratio < 0.85:
            raise SystemExit(f"no line matches test sentence {s + 1} ({sentence!r}); best ratio {ratio:.3f}")
        used.add(best)
        labels[s] = rows[best][1]
        ratios.append(ratio)
    return [int(x) for x in labels], ratios


def main(argv: list[str]) -> int:
    rows = read_labelled(argv[0])
    with open(ROOT / "data/sst2-text/sst2_test_sentences.jsonl", encoding="utf-8") as f:
        sentences = [json.loads(line)["text"] for line in f]
    labels, ratios = match(sentences, rows)
    out = ROOT / "data/glue/SST-2/test_labelled.tsv"
    with open(out, "w", encoding="utf-8", newline="") as f:
        f.write("sentence\tlabel\n")
        for sentence, label in zip(sentences, labels, strict=True):
            f.write(f"{sentence}\t{label}\n")
    exact = len(sentences) - len(ratios)
    print(
        f"{len(sentences)} test sentences: {exact} matched exactly, {len(ratios)} by similarity "
        f"(lowest ratios {sorted(ratios)[:5]}); {sum(labels)} positive; wrote {out}"
    )
    if len(argv) > 1:  # the same source's dev labels against GLUE's own
        dev_rows = read_labelled(argv[1])
        with open(ROOT / "data/glue/SST-2/dev.tsv", encoding="utf-8") as f:
            glue_dev = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
        dev_labels, dev_ratios = match([r[0] for r in glue_dev], dev_rows)
        agree = sum(int(r[1]) == label for r, label in zip(glue_dev, dev_labels, strict=True))
        print(
            f"dev check: {agree} of {len(glue_dev)} labels agree with GLUE's dev.tsv "
            f"({len(dev_ratios)} matched by similarity)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
