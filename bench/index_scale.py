"""Sample-index build at the paper's scale: 100M documents, ~110B tokens, seq_len 2048, one epoch.

    .venv/bin/python bench/index_scale.py [--num-docs 100000000] [--workdir /tmp/index_scale]

Writes a real ``.idx`` for ``--num-docs`` documents of log-normal lengths (mean ~1,100 tokens,
clipped to [16, 200,000]) and a sparse ``.bin`` of the matching size (``truncate``: never written,
reads return zeros), then, each in a fresh subprocess so that peak RSS (``ru_maxrss``) is its own:

* build: open the dataset (validating the index), compute every document's length, build
  doc/sample/shuffle indices for one epoch and save them to a cache directory (as a cold start-up
  or ``python -m data_tools.build_index`` does);
* load: the same call again, now a cache hit (hash the index, memory-map three ``.npy``);
* random access: samples of 2049 tokens per second from the memory maps, in shuffled order.

Prints a table and writes ``bench/results/index_scale.json``. Targets (issue 4): build <= 15 s and
<= 4 GB peak RSS at 100M documents; Megatron-LM's path measured 1.09 s at 10M documents.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.files import atomic_write_json  # noqa: E402
from data_tools.indexed_dataset import MAGIC, VERSION  # noqa: E402

SEQ_LEN = 2048
MEAN_TOKENS = 1100


def write_dataset(prefix: Path, num_docs: int, seed: int = 0) -> int:
    """Writes ``prefix.idx`` (real) and ``prefix.bin`` (sparse); returns the token count."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(MEAN_TOKENS) - sigma**2 / 2  # log-normal mean = exp(mu + sigma^2/2)
    block = 1 << 24
    total = 0
    tmp = Path(f"{prefix}.idx.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, VERSION, 8, num_docs, num_docs + 1))
        lengths_all = []
        for a in range(0, num_docs, block):
            n = min(block, num_docs - a)
            lengths = np.clip(rng.lognormal(mu, sigma, n), 16, 200_000).astype("<i4")
            f.write(lengths.tobytes())
            lengths_all.append(lengths)
        for lengths in lengths_all:
            ptr = np.cumsum(lengths, dtype=np.int64) - lengths + total
            total += int(lengths.sum(dtype=np.int64))
            f.write((ptr * 2).astype("<i8").tobytes())
        for a in range(0, num_docs + 1, block):
            f.write(np.arange(a, min(a + block, num_docs + 1), dtype="<i8").tobytes())
    os.replace(tmp, f"{prefix}.idx")
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(total * 2)  # sparse: no block of it is ever written
    return total


_CHILD = r"""
import json, resource, sys, time
import numpy as np
t0 = time.perf_counter()
from data_tools.indexed_dataset import IndexedDataset
from data_tools.sample_index import load_or_build
prefix, cache, seq_len, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t = time.perf_counter()
ds = IndexedDataset(prefix)
t_open = time.perf_counter() - t
lengths = ds.document_lengths(np.int32)
num_samples = (int(lengths.sum(dtype=np.int64)) - 1) // seq_len  # one epoch
t = time.perf_counter()
kw = {"seq_len": seq_len, "num_samples": num_samples, "seed": 1234, "cache_dir": cache}
idx = load_or_build(ds, doc_lengths=lengths, **kw)
t_index = time.perf_counter() - t
out = {"open_s": t_open, "index_s": t_index, "total_s": time.perf_counter() - t0, "cache_hit": idx.cache_hit,
       "num_samples": num_samples, "num_tokens": ds.num_tokens,
       "dtypes": [str(a.dtype) for a in (idx.doc_idx, idx.sample_idx, idx.shuffle_idx)],
       "index_mb": sum(p.stat().st_size for p in idx.paths) / 1e6}
if mode == "access":
    from megaformer.data.gpt_dataset import GPTSamples
    samples = GPTSamples(ds, idx.doc_idx, idx.sample_idx, idx.shuffle_idx, seq_len)
    order = np.random.default_rng(0).integers(0, len(samples), 20000)
    t = time.perf_counter()
    for i in order:
        x = samples[int(i)]
    assert x.shape == (seq_len + 1,)
    out["samples_per_s"] = len(order) / (time.perf_counter() - t)
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def child(prefix: Path, cache: Path, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(prefix), str(cache), str(SEQ_LEN), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if r.returncode:
        sys.exit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-docs", type=int, nargs="+", default=[10_000_000, 100_000_000])
    ap.add_argument("--workdir", default="/tmp/megaformer_index_scale")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "index_scale.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "seq_len": SEQ_LEN,
        "runs": {},
    }
    for n in args.num_docs:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        prefix = work / "scale_text_document"
        t = time.perf_counter()
        tokens = write_dataset(prefix, n)
        print(
            f"{n:,} documents, {tokens / 1e9:.1f}B tokens: "
            f"dataset written in {time.perf_counter() - t:.1f} s "
            f"(.idx {os.path.getsize(f'{prefix}.idx') / 1e9:.2f} GB, sparse .bin "
            f"{os.path.getsize(f'{prefix}.bin') / 1e9:.0f} GB apparent)"
        )
        build = child(prefix, work / "cache", "build")
        load = child(prefix, work / "cache", "access")
        assert not build["cache_hit"] and load["cache_hit"]
        results["runs"][n] = {"tokens": tokens, "build": build, "load": load}
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"{'documents':>12} {'tokens':>8} {'samples':>11} {'open s':>7} {'build s':>8} {'RSS MB':>8} "
        f"{'hit s':>7} {'RSS MB':>8} {'samples/s':>10}"
    )
    for n, r in results["runs"].items():
        b, ld = r["build"], r["load"]
        print(
            f"{n:>12,} {r['tokens'] / 1e9:>7.1f}B {b['num_samples']:>11,} {b['open_s']:>7.2f} "
            f"{b['open_s'] + b['index_s']:>8.2f} {b['peak_rss_mb']:>8.0f} "
            f"{ld['open_s'] + ld['index_s']:>7.2f} "
            f"{ld['peak_rss_mb']:>8.0f} {ld['samples_per_s']:>10,.0f}"
        )
    print(
        "build s = open (validate the .idx) + document lengths + indices + save; hit s = open + hash + mmap"
    )
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
