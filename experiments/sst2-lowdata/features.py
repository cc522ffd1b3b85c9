"""What the frozen encoder's features tell a linear classifier, first token against mean pooling.

    .venv/bin/python experiments/sst2-lowdata/features.py RUN_DIR [--rows 1000] > features.md

A diagnostic beside the SST-2 low-data record (EXPERIMENTS.md), reading SST-2's *training* rows only
(the first ``--rows`` of data/glue/SST-2/train.tsv, the rows that record fine-tunes on; nothing of
the dev set). For each of ``RUN_DIR/{pre_ln,normformer}/checkpoints`` and its random
initialisation (``finetune --random-init``'s weights), in evaluation mode (no dropout):

- the mean pairwise cosine similarity of the rows' pooled features ``float[N, d]``, first token
  (``<s>``) and mean over the non-padding positions: near 1, every row looks alike to the head;
- a linear probe: scikit-learn's logistic regression (L2, C = 1) on the standardised frozen
  features, accuracy over 5 stratified folds (mean and sample std): how much label information a
  head that cannot change the encoder finds there.

Writes a Markdown table to stdout; ``--json PATH`` keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from megaformer.data.glue import glue_task, read_glue_file
from megaformer.data.mlm import PAD_ID
from megaformer.tools import finetune as ft


def pooled(model: ft.SentenceClassifier, rows: list[list[int]], batch: int = 64) -> dict[str, np.ndarray]:
    """``{"first": float64[N, d], "mean": float64[N, d]}``: the encoder's final features of ``rows``."""
    out = {"first": [], "mean": []}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            tokens = ft.pad_batch(rows[start : start + batch])
            feats = model.features(tokens)  # (B, T, d)
            keep = (tokens != PAD_ID).unsqueeze(-1).to(feats.dtype)
            out["first"].append(feats[:, 0].double().numpy())
            out["mean"].append(((feats * keep).sum(1) / keep.sum(1)).double().numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def mean_cosine(x: np.ndarray) -> float:
    """Mean cosine similarity over all pairs of distinct rows of ``x`` ``[N, d]``."""
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    gram = unit @ unit.T
    n = len(x)
    return float((gram.sum() - np.trace(gram)) / (n * (n - 1)))


def probe(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """5-fold stratified accuracy of an L2 logistic regression on standardised ``x``: (mean, std)."""
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000))
    scores = cross_val_score(clf, x, y, cv=StratifiedKFold(5, shuffle=True, random_state=0))
    return float(scores.mean()), float(scores.std(ddof=1))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    task = glue_task("sst2")
    examples = read_glue_file("data/glue/SST-2/train.tsv", task, args.rows)
    encode = ft._tokenizer(ft.build_parser().parse_args([])).encode
    results, lines = (
        [],
        [
            "| model | init | cosine, first | cosine, mean | probe, first (%) | probe, mean (%) |",
            "|---|---|---:|---:|---:|---:|",
        ],
    )
    for name in ("pre_ln", "normformer"):
        full, config, info = ft.load_masked_lm(f"{args.run_dir}/{name}/checkpoints")
        rows, labels, _ = ft.encode_split(examples, encode, config.seq_len)
        y = np.asarray(labels)
        seed = int((info["run_config"].get("train") or {}).get("seed", 1234))
        for init, weights in (("pretrained", full), ("random-init", ft.initial_weights(config, seed))):
            model = ft.build_classifier(weights, config, task, ft.FinetuneConfig(), "cpu")
            feats = pooled(model, rows)
            row = {"model": name, "init": init, "step": info["step"] if init == "pretrained" else 0}
            for kind in ("first", "mean"):
                row[f"cosine_{kind}"] = mean_cosine(feats[kind])
                row[f"probe_{kind}"], row[f"probe_{kind}_std"] = probe(feats[kind], y)
            results.append(row)
            lines.append(
                f"| {name} | {init} | {row['cosine_first']:.3f} | {row['cosine_mean']:.3f} | "
                f"{100 * row['probe_first']:.1f} ± {100 * row['probe_first_std']:.1f} | "
                f"{100 * row['probe_mean']:.1f} ± {100 * row['probe_mean_std']:.1f} |"
            )
    majority = max(np.mean(y), 1 - np.mean(y))
    lines += [
        "",
        f"{len(y)} training rows; majority class {100 * majority:.1f} %. Probe: mean ± std over 5 folds.",
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": len(y), "majority": float(majority), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
