"""The unigram baseline of the SST-2 pretraining records: the cross-entropy (nats per token) of
SST-2's test sentences under the token frequencies of its training sentences (add-0.5 smoothing over
GPT-2's 50,257 ids, EOD excluded), beside the same on the training sentences themselves. A masked LM
whose masked-token loss is not below it has learned nothing from context. Run from the repository
root after experiments/sst2-tapt/run.sh has tokenized the text; writes unigram.json beside this file.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
from data_tools.indexed_dataset import IndexedDataset

EOD, VOCAB = 50256, 50257


def tokens(prefix: str) -> np.ndarray:
    """Every token of the dataset at ``prefix`` but EOD, int64[n]."""
    ds = IndexedDataset(prefix)
    out = np.concatenate([np.asarray(ds.get(i), dtype=np.int64) for i in range(ds.num_documents)])
    return out[out != EOD]


def main() -> None:
    train = tokens("data/processed/sst2_train_text_document")
    test = tokens("data/processed/sst2_test_text_document")
    counts = np.bincount(train, minlength=VOCAB).astype(np.float64) + 0.5
    logp = np.log(counts / counts.sum())
    result = {
        "train_tokens": int(train.size),
        "test_tokens": int(test.size),
        "smoothing": "add-0.5 over 50,257 ids",
        "unigram_cross_entropy_test_nats": float(-logp[test].mean()),
        "unigram_cross_entropy_train_nats": float(-logp[train].mean()),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unigram.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
