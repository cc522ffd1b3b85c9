"""Sample-index build at the paper's scale: 100M documents, ~110B tokens, seq_len 2048, one epoch.

    .venv/bin/python bench/index_scale.py [--num-docs 10000000 100000000] [--rounds 3] [--numpy]

Writes a real ``.idx`` for ``--num-docs`` documents of log-normal lengths (mean ~1,100 tokens,
clipped to [16, 200,000]) and a sparse ``.bin`` of the matching size (``truncate``: never written,
reads return zeros), then, each in a fresh subprocess so that peak RSS (``ru_maxrss``) is its own,
``--rounds`` times:

* build: open the dataset (validating the index), compute every document's length, build
  doc/sample/shuffle indices for one epoch and save them to an empty cache directory (as a cold
  start-up or ``python -m data_tools.build_index`` does), with the compiled kernels
  (:mod:`data_tools.index_kernels`, numba) or, with ``--numpy``, also with the numpy reference;
* load: the same call again, now a cache hit (hash the index, memory-map three ``.npy``);
* random access: samples of 2049 tokens per second from the memory maps, in shuffled order.

Before the rounds one process builds a tiny index, so that numba's compiled kernels are in its
cache (the first use on a machine compiles them: its seconds are reported as ``kernels_first_use_s``
when the cache was empty). Prints the median and spread (min-max) of the rounds and writes
``bench/results/index_scale.json``. Targets (issue 24): build <= 10 s and <= 2 GB peak RSS at 100M
documents (issue 4's: 15 s, 4 GB); Megatron-LM's path measured 1.09 s at 10M documents.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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
from data_tools.sample_index import compiled_kernels, dataset_digest, load_or_build
prefix, cache, seq_len, mode, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
t = time.perf_counter()
ds = IndexedDataset(prefix)
t_open = time.perf_counter() - t
t = time.perf_counter()
lengths = ds.document_lengths(np.int32)
t_lengths = time.perf_counter() - t
num_samples = (int(lengths.sum(dtype=np.int64)) - 1) // seq_len  # one epoch
t = time.perf_counter()
if path == "compiled" and mode != "access":
    assert compiled_kernels() is not None, "numba is not usable here"
t_import = time.perf_counter() - t
t = time.perf_counter()
digest = dataset_digest(ds)
t_digest = time.perf_counter() - t
kw = {"seq_len": seq_len, "num_samples": num_samples, "seed": 1234, "cache_dir": cache}
t = time.perf_counter()
idx = load_or_build(ds, doc_lengths=lengths, digest=digest, **kw)
t_index = t_import + t_digest + time.perf_counter() - t
out = {"open_s": t_open, "lengths_s": t_lengths, "index_s": t_index, "kernels_import_s": t_import,
       "digest_s": t_digest, "build_and_save_s": t_index - t_import - t_digest,
       "build_s": t_open + t_lengths + t_index, "total_s": time.perf_counter() - t0,
       "cache_hit": idx.cache_hit, "num_samples": num_samples, "num_tokens": ds.num_tokens,
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


def child(prefix: Path, cache: Path, mode: str, path: str = "compiled") -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if path == "numpy":
        env["MEGAFORMER_INDEX_NUMPY"] = "1"  # the numpy reference (data_tools.sample_index.compiled_kernels)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(prefix), str(cache), str(SEQ_LEN), mode, path],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if r.returncode:
        sys.exit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def _warm_kernels(work: Path) -> float | None:
    """Builds a tiny index in a fresh process so that numba's kernels are compiled and cached;
    returns its seconds if it compiled them (their cache was empty), else None."""
    from data_tools import sample_index

    kernels_dir = Path(sample_index.__file__).with_name("__pycache__")
    cached = kernels_dir.is_dir() and any(p.name.startswith("index_kernels.") for p in kernels_dir.iterdir())
    prefix = work / "tiny_text_document"
    write_dataset(prefix, 5000)
    t = time.perf_counter()
    child(prefix, work / "tiny_cache", "build")
    shutil.rmtree(work / "tiny_cache", ignore_errors=True)
    return None if cached else time.perf_counter() - t


def _measure(n: int, work: Path, args: argparse.Namespace) -> dict:
    """Writes a dataset of ``n`` documents, then times ``args.rounds`` index builds and cache hits."""
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
    builds, loads = [], []
    for k in range(args.rounds):
        shutil.rmtree(work / "cache", ignore_errors=True)
        # The dataset just written (2 GB at 100M documents) is on disk before a round starts,
        # as a real one is: its dirty pages would otherwise slow the build's own writes.
        os.sync()
        load = os.getloadavg()[0]
        builds.append(child(prefix, work / "cache", "build") | {"load_1min": load})
        loads.append(child(prefix, work / "cache", "access"))
        assert not builds[-1]["cache_hit"] and loads[-1]["cache_hit"]
        b = builds[-1]
        print(
            f"  round {k + 1}: build {b['build_s']:.2f} s (open {b['open_s']:.2f} + lengths "
            f"{b['lengths_s']:.2f} + index {b['index_s']:.2f}: numba {b['kernels_import_s']:.2f}, hash "
            f"{b['digest_s']:.2f}, build and save {b['build_and_save_s']:.2f}), "
            f"{b['peak_rss_mb']:.0f} MB; cache hit "
            f"{loads[-1]['build_s']:.2f} s (load average {load:.2f})"
        )
    run = {
        "tokens": tokens,
        "num_samples": builds[0]["num_samples"],
        "build": {key: _spread([b[key] for b in builds]) for key in ("build_s", "total_s", "peak_rss_mb")},
        "load": {
            key: _spread([x[key] for x in loads]) for key in ("build_s", "peak_rss_mb", "samples_per_s")
        },
        "build_rounds": builds,
        "load_rounds": loads,
    }
    if args.numpy:
        shutil.rmtree(work / "cache", ignore_errors=True)
        os.sync()
        run["numpy_reference_build"] = child(prefix, work / "cache", "build", path="numpy")
        ref = run["numpy_reference_build"]
        print(f"  numpy reference: build {ref['build_s']:.2f} s, {ref['peak_rss_mb']:.0f} MB")
    shutil.rmtree(work, ignore_errors=True)
    return run


def _print_table(results: dict) -> None:
    """The table of every size: medians of the rounds."""
    print(
        f"{'documents':>12} {'tokens':>8} {'samples':>11} {'build s':>8} {'min-max':>12} {'RSS MB':>8} "
        f"{'hit s':>7} {'RSS MB':>8} {'samples/s':>10}"
    )
    for n, r in results["runs"].items():
        b, ld = r["build"], r["load"]
        print(
            f"{n:>12,} {r['tokens'] / 1e9:>7.1f}B {r['num_samples']:>11,} {b['build_s']['median']:>8.2f} "
            f"{b['build_s']['min']:>5.2f}-{b['build_s']['max']:<6.2f} {b['peak_rss_mb']['max']:>8.0f} "
            f"{ld['build_s']['median']:>7.2f} {ld['peak_rss_mb']['max']:>8.0f} "
            f"{ld['samples_per_s']['median']:>10,.0f}"
        )
    print(
        "median of the rounds; build s = open (validate the .idx) + document lengths + indices (hash, "
        "build, save); hit s = open + lengths + hash + mmap; RSS: the largest of the rounds"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-docs", type=int, nargs="+", default=[10_000_000, 100_000_000])
    ap.add_argument("--rounds", type=int, default=3, help="build + load rounds per size")
    ap.add_argument("--numpy", action="store_true", help="also time the numpy reference build (1 round)")
    ap.add_argument("--workdir", default="/tmp/megaformer_index_scale")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "index_scale.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_at_start": os.getloadavg(),
        "seq_len": SEQ_LEN,
        "kernels_first_use_s": _warm_kernels(work),
        "runs": {},
    }
    for n in args.num_docs:
        results["runs"][n] = _measure(n, work, args)
    print()
    _print_table(results)
    if results["kernels_first_use_s"] is not None:
        print(f"numba compiled the kernels first (empty cache): {results['kernels_first_use_s']:.1f} s, once")
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
