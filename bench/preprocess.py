"""Preprocessing speed: ``data_tools.preprocess`` end to end against tiktoken's raw encode, and a
model of the scaling beyond this machine.

    .venv/bin/python bench/preprocess.py [--rounds 3] [--repeat 5] [--workers 1 2]

Builds the benchmark corpus reproducibly in a temporary directory: the 21 Gutenberg novels of
``data/gutenberg-novels`` cut into documents of about 4 KB at paragraph (blank-line) boundaries,
one JSON object per document, written as one JSONL file; the big corpus is that file repeated
``--repeat`` times (as that many files, which also exercises streaming over many inputs).

Measured in ``--rounds`` rounds, each timing, at every number of processes W, first raw and then
ours, back to back:

* raw: tiktoken ``encode_ordinary`` of the same texts in W processes, texts already in memory,
  timed from a barrier until every process is done (the ceiling any pipeline on it can reach);
* ours: ``python -m data_tools.preprocess --workers W`` as a subprocess, wall time of the whole
  process (start-up, reading, JSON parsing, tokenizing, writing ``.bin``/``.idx``), the CPU
  seconds of its main process and of its workers, and the peak RSS of its largest process
  (``ru_maxrss`` of the waited-for process tree).

The ratio ours/raw (= raw seconds / our seconds, the same texts) is taken within each round, so
that both sides of a ratio saw the same load; the report gives the median of the rounds and their
spread (min-max), and the load average and the share of CPU time other processes took during
each round (from ``/proc/stat``: a quiet machine shows ~0%).

The scaling section models, from the rates measured here (:func:`scaling_model`, assumptions in
its docstring), a 64-core node and a 32-node Slurm array (``launch/preprocess.sbatch``) over 450 GB
of text: wall time, bytes read and written per second, and what limits each configuration.

Prints a table and writes ``bench/results/preprocess.json``. Noisy on a shared machine: compare
the ratios within one run, and check the rounds' ``busy_other`` share.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import lzma
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.files import atomic_write_json  # noqa: E402
from data_tools.tokenizer import build_tokenizer  # noqa: E402

BPE = REPO / "data" / "gpt2-bpe"
BOOKS = REPO / "data" / "gutenberg-novels"
DOC_BYTES = 4096  # target document size (UTF-8 bytes)


def gutenberg_documents() -> list[str]:
    """The novels cut into documents of at most ~4 KB of whole paragraphs (a longer paragraph is
    one document by itself), in file order: deterministic."""
    docs: list[str] = []
    for path in sorted(BOOKS.glob("*.txt.xz")):
        text = lzma.decompress(path.read_bytes()).decode("utf-8-sig").replace("\r\n", "\n")
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        current: list[str] = []
        size = 0
        for para in paragraphs:
            n = len(para.encode("utf-8")) + 2
            if current and size + n > DOC_BYTES:
                docs.append("\n\n".join(current))
                current, size = [], 0
            current.append(para)
            size += n
        if current:
            docs.append("\n\n".join(current))
    return docs


def _raw_worker(texts: list[str], barrier, result_queue) -> None:
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=BPE / "encoder.json", merge_file=BPE / "vocab.bpe")
    encode = tok._enc.encode_ordinary  # the library call itself, nothing of ours around it
    encode("warm up")
    barrier.wait()
    n = sum(len(encode(t)) for t in texts)
    result_queue.put(n)


def raw_encode(texts: list[str], workers: int) -> tuple[float, int]:
    """(seconds, tokens) for tiktoken to encode ``texts`` split over ``workers`` processes."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(workers + 1)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_raw_worker, args=(texts[i::workers], barrier, queue)) for i in range(workers)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    tokens = sum(queue.get() for _ in procs)
    seconds = time.perf_counter() - start
    for p in procs:
        p.join()
    return seconds, tokens


# The preprocessing process itself: main() of the CLI, then one line of JSON with its main
# process's CPU seconds (process_time counts no child) and its workers' (they were waited for).
_PREPROCESS = """
import json, resource, sys, time
from data_tools.preprocess import main
status = main(sys.argv[1:])
workers = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"status": status, "main_cpu_s": time.process_time(),
                  "workers_cpu_s": workers.ru_utime + workers.ru_stime}))
"""
# Its parent: the wall time of the whole process (interpreter start-up included) and the peak RSS
# of the largest process of the tree.
_RUN = """
import resource, subprocess, sys, time
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
dt = time.perf_counter() - t
if r.returncode:
    sys.exit(r.stderr)
print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.stdout.splitlines()[0])
print(r.stdout.splitlines()[-1])
"""


def ours(inputs: list[Path], out_prefix: Path, workers: int) -> dict:
    """Runs the preprocessing CLI in a fresh parent, so that ``ru_maxrss`` is this run's alone,
    into outputs that do not exist yet (as a first run's; replacing existing files costs a flush
    of their data on ext4, ``auto_da_alloc``)."""
    for old in out_prefix.parent.glob(f"{out_prefix.name}_text_document.*"):
        old.unlink()
    cmd = [sys.executable, "-c", _PREPROCESS, "--input", *map(str, inputs)]
    cmd += ["--output-prefix", str(out_prefix), "--tokenizer-type", "GPT2BPETokenizer"]
    cmd += ["--vocab-file", str(BPE / "encoder.json"), "--merge-file", str(BPE / "vocab.bpe")]
    cmd += ["--append-eod", "--workers", str(workers), "--log-interval", "0"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", _RUN, *cmd], capture_output=True, text=True, cwd=REPO, env=env, check=True
    )
    first, last = r.stdout.splitlines()[:2]
    seconds, maxrss_kb, line = first.split(" ", 2)
    cpu = json.loads(last)
    return {
        "seconds": float(seconds),
        "main_cpu_s": cpu["main_cpu_s"],
        "workers_cpu_s": cpu["workers_cpu_s"],
        "peak_rss_mb": int(maxrss_kb) / 1024,
        "summary": line.strip(),
    }


class CpuShare:
    """The share of this machine's CPU time that went to processes other than ours, from
    ``/proc/stat`` (all CPU time) and ``RUSAGE_CHILDREN`` + ``RUSAGE_SELF`` (ours) between
    ``start()`` and ``stop()``: about 0 on a quiet machine."""

    def start(self) -> None:
        self._t0, self._ours0 = self._all(), self._ours()

    def stop(self) -> float:
        busy = self._all() - self._t0
        ours = self._ours() - self._ours0
        return max(0.0, busy - ours) / max(busy, 1e-9) if busy > 0 else 0.0

    @staticmethod
    def _all() -> float:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return 0.0
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        import resource

        r = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(x.ru_utime + x.ru_stime for x in r)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="copies of the Gutenberg JSONL in the big corpus")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", "--trials", type=int, default=3, help="rounds of raw + ours per worker count")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "preprocess.json"))
    m = ap.add_argument_group("scaling model (see scaling_model)")
    m.add_argument("--corpus-gb", type=float, default=450.0, help="text to tokenize (GB)")
    m.add_argument("--node-cores", type=int, default=64)
    m.add_argument("--nodes", type=int, default=32, help="Slurm array tasks, one node each")
    m.add_argument("--node-read-gbps", type=float, default=2.0, help="one node's read bandwidth (GB/s)")
    m.add_argument("--node-write-gbps", type=float, default=1.0, help="one node's write bandwidth (GB/s)")
    m.add_argument("--fs-gbps", type=float, default=40.0, help="the shared filesystem's aggregate (GB/s)")
    return ap


def _spread(values: list[float]) -> dict:
    """Median, min and max of ``values`` (and the values, in round order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def _measure(args: argparse.Namespace, docs: list[str], text_mb: float, results: dict) -> None:
    """Writes the corpus to a temporary directory and times raw and ours at every worker count in
    ``args.rounds`` rounds; records into ``results`` the rates and ratios (median and spread over
    the rounds), the CPU seconds of our main process and workers, the peak RSS at 1x and at the
    big corpus, and whether every worker count wrote the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "gutenberg-00.jsonl"
        with open(one, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        big = [one]
        for k in range(1, args.repeat):
            big.append(Path(tmp) / f"gutenberg-{k:02d}.jsonl")
            os.link(one, big[-1])
        big_mb = text_mb * args.repeat
        results["corpus"]["big_mb"] = round(big_mb, 2)
        results["corpus"]["jsonl_mb"] = round(one.stat().st_size * args.repeat / 1e6, 2)
        print(
            f"corpus: {len(docs):,} documents, {text_mb:.1f} MB of text; "
            f"big corpus {args.repeat}x = {big_mb:.1f} MB"
        )
        texts = docs * args.repeat
        raw: dict[int, list] = {w: [] for w in args.workers}
        runs: dict[int, list] = {w: [] for w in args.workers}
        share = CpuShare()
        for k in range(args.rounds):
            share.start()
            load = os.getloadavg()[0]
            for w in args.workers:  # raw then ours, back to back: one ratio per round
                raw[w].append(raw_encode(texts, w))
                runs[w].append(ours(big, Path(tmp) / f"out{w}", w))
            results["rounds"].append({"load_1min": load, "busy_other": round(share.stop(), 3)})
            line = ", ".join(f"W={w}: {raw[w][-1][0] / runs[w][-1]['seconds']:.3f}" for w in args.workers)
            other = results["rounds"][-1]["busy_other"]
            print(f"round {k + 1}: ratio {line} (load {load:.2f}, other processes' CPU share {other:.0%})")
        tokens = raw[args.workers[0]][0][1]
        results["tokens"] = tokens
        for w in args.workers:
            raw_s = [r[0] for r in raw[w]]
            our_s = [r["seconds"] for r in runs[w]]
            results["raw"][w] = {
                "seconds": _spread(raw_s),
                "mb_per_s": big_mb / statistics.median(raw_s),
                "tokens_per_s": tokens / statistics.median(raw_s),
            }
            results["ours"][w] = {
                "seconds": _spread(our_s),
                "mb_per_s": big_mb / statistics.median(our_s),
                "tokens_per_s": tokens / statistics.median(our_s),
                "ratio_to_raw": _spread([r / o for r, o in zip(raw_s, our_s)]),
                "main_cpu_s": _spread([r["main_cpu_s"] for r in runs[w]]),
                "workers_cpu_s": _spread([r["workers_cpu_s"] for r in runs[w]]),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs[w]),
                "summary": runs[w][-1]["summary"],
            }
        wmax = max(args.workers)
        small = ours([one], Path(tmp) / "small", wmax)
        results["peak_rss_mb_1x"] = small["peak_rss_mb"]
        results["peak_rss_mb_big"] = results["ours"][wmax]["peak_rss_mb"]
        outputs = [(Path(tmp) / f"out{w}_text_document.bin").read_bytes() for w in args.workers]
        results["same_bytes_for_all_workers"] = all(o == outputs[0] for o in outputs)
        results["output_sha256"] = {  # to compare with other versions of the code
            ext: hashlib.sha256((Path(tmp) / f"out{wmax}_text_document.{ext}").read_bytes()).hexdigest()
            for ext in ("bin", "idx")
        }


def _model_entry(rate: float, limit: str, seconds: float, in_per_text: float, out_per_text: float) -> dict:
    """One configuration of :func:`scaling_model`: MB/s of text, the limit that set it, the bytes read
    and written per second, and the hours for the whole corpus."""
    return {
        "text_mb_s": round(rate, 1),
        "limit": limit,
        "read_mb_s": round(rate * in_per_text, 1),
        "write_mb_s": round(rate * out_per_text, 1),
        "hours_for_corpus": round(seconds / 3600, 4),
    }


def scaling_model(
    *,
    worker_mb_s: float,
    main_cpu_s_per_mb: float,
    startup_s: float,
    out_bytes_per_text_byte: float,
    in_bytes_per_text_byte: float,
    corpus_gb: float,
    node_cores: int,
    nodes: int,
    node_read_gbps: float,
    node_write_gbps: float,
    fs_gbps: float,
    decompress_mb_s: float | None = None,
) -> dict:
    """Wall time and I/O rates of tokenizing ``corpus_gb`` of text, modelled from the rates measured.

    A node runs one ``data_tools.preprocess`` with W workers (``launch/preprocess.sbatch``: one
    array task per node with ``--cpus-per-task`` = its cores, so W = cores); its rate in MB of
    text per second is the smallest of these limits:

    * compute: W x ``worker_mb_s``, one worker's rate measured here (MB of text per CPU-second of a
      worker), assumed linear: workers share only the main process, and a worker moves a few bytes
      per byte of text at ~20 MB/s. Cores are assumed as fast as these (a 64-core part's all-core
      clock is often lower than a small VM's boost clock: scale ``worker_mb_s`` for the target);
    * the main process (one core, whatever W): 1 / ``main_cpu_s_per_mb`` (:func:`main_cpu_per_mb`:
      receiving token arrays, writing, statistics; workers read uncompressed JSONL themselves);
    * decompression, for compressed inputs: ``decompress_mb_s``, since the main process decompresses
      each file as one stream (zstd decompresses about 1 GB/s per core, gzip about 0.3 GB/s);
    * reading and writing: ``node_read_gbps`` / ``in_bytes_per_text_byte`` (JSONL bytes per byte of
      text), ``node_write_gbps`` / ``out_bytes_per_text_byte`` (uint16 tokens: ~0.52 B per B);
    * the shared filesystem: ``fs_gbps`` of reads and writes together, shared by all nodes.

    The array ends with ``data_tools.merge_shards`` on one node, which copies every shard's ``.bin``
    once (read and write at the node's bandwidth; no tokenizing), modelled as its own step. The
    bandwidths are assumptions, not measurements (defaults: one client of a parallel filesystem
    reads 2 GB/s and writes 1 GB/s; the filesystem serves 40 GB/s in all, a mid-size Lustre or
    GPFS); each result names the limit that set it, so another figure changes only the
    configurations it limits.
    """
    fs_text_mb_s = fs_gbps * 1e3 / (in_bytes_per_text_byte + out_bytes_per_text_byte)

    def node_rate(workers: int, sharing: int) -> tuple[float, str]:
        limits = {
            "compute (workers)": workers * worker_mb_s,
            "main process": 1 / main_cpu_s_per_mb,
            "node read bandwidth": node_read_gbps * 1e3 / in_bytes_per_text_byte,
            "node write bandwidth": node_write_gbps * 1e3 / out_bytes_per_text_byte,
            "shared filesystem": fs_text_mb_s / sharing,
        }
        if decompress_mb_s is not None:
            limits["decompression (main process)"] = decompress_mb_s
        name = min(limits, key=limits.__getitem__)
        return limits[name], name

    entry = functools.partial(
        _model_entry, in_per_text=in_bytes_per_text_byte, out_per_text=out_bytes_per_text_byte
    )
    corpus_mb = corpus_gb * 1e3
    out: dict = {"single_node": {}}
    for w in sorted({1, 2, 4, 8, 16, 32, node_cores}):
        if w <= node_cores:
            rate, limit = node_rate(w, 1)
            out["single_node"][w] = entry(rate, limit, startup_s + corpus_mb / rate)
    rate, limit = node_rate(node_cores, nodes)
    tokenize_s = startup_s + corpus_mb / nodes / rate
    merge_s = corpus_mb * out_bytes_per_text_byte / (min(node_read_gbps, node_write_gbps) * 1e3)
    out["array"] = {
        "nodes": nodes,
        "workers_per_node": node_cores,
        **entry(rate * nodes, limit, tokenize_s + merge_s),
        "tokenize_hours": round(tokenize_s / 3600, 4),
        "merge_hours": round(merge_s / 3600, 4),
    }
    # From how many nodes the array is bound by the shared filesystem.
    out["array"]["shared_filesystem_bound_from_nodes"] = round(fs_text_mb_s / node_rate(node_cores, 1)[0], 1)
    # Where one node stops gaining from more workers: compute reaches the next limit.
    ceiling, what = node_rate(10**9, 1)
    out["single_node_saturates"] = {"from_workers": round(ceiling / worker_mb_s, 1), "by": what}
    return out


def _report(args: argparse.Namespace, results: dict) -> None:
    """Prints the table, the scaling and the model, adding the scaling and the model to ``results``."""
    print()
    print(f"{'':8} {'raw tiktoken':>22} {'data_tools.preprocess':>40} {'ours / raw':>22}")
    print(
        f"{'workers':8} {'MB/s':>10} {'Mtok/s':>11} {'MB/s':>10} {'Mtok/s':>9} {'main CPU s':>11} "
        f"{'RSS MB':>8} {'median':>8} {'min-max':>13}"
    )
    for w in args.workers:
        raw, us = results["raw"][w], results["ours"][w]
        ratio = us["ratio_to_raw"]
        print(
            f"{w:<8} {raw['mb_per_s']:>10.2f} {raw['tokens_per_s'] / 1e6:>11.2f} {us['mb_per_s']:>10.2f} "
            f"{us['tokens_per_s'] / 1e6:>9.2f} {us['main_cpu_s']['median']:>11.2f} {us['peak_rss_mb']:>8.0f} "
            f"{ratio['median']:>8.1%} {ratio['min']:>6.1%}-{ratio['max']:.1%}"
        )
    print("(median of the rounds; ratio per round = raw seconds / our seconds over the same texts)")
    if 1 in results["ours"] and 2 in results["ours"]:
        results["scaling_1_to_2"] = (
            results["ours"][1]["seconds"]["median"] / results["ours"][2]["seconds"]["median"]
        )
        results["raw_scaling_1_to_2"] = (
            results["raw"][1]["seconds"]["median"] / results["raw"][2]["seconds"]["median"]
        )
        print(
            f"scaling 1 -> 2 workers: ours {results['scaling_1_to_2']:.2f}x, "
            f"raw {results['raw_scaling_1_to_2']:.2f}x"
        )
    wmax = max(args.workers)
    print(
        f"peak RSS at 1x: {results['peak_rss_mb_1x']:.0f} MB, at {args.repeat}x: "
        f"{results['peak_rss_mb_big']:.0f} MB (workers {wmax})"
    )
    print(f"same bytes for every worker count: {results['same_bytes_for_all_workers']}")
    _report_model(args, results)


def _report_model(args: argparse.Namespace, results: dict) -> None:
    """Fits the scaling model's inputs from this run, prints the model and adds it to ``results``."""
    wmax = max(args.workers)
    # The model's inputs, from this run: one worker's rate per CPU-second and the main process's
    # CPU per MB beyond its start-up, both from the largest worker count (CPU seconds: less
    # disturbed by other jobs than wall time), and the fixed start-up of every run.
    big_mb = results["corpus"]["big_mb"]
    run = results["ours"][wmax]
    start = results["startup"]
    if wmax > 1:
        worker_mb_s = big_mb / run["workers_cpu_s"]["median"]
        results["main_cpu_s_per_mb_from_runs"] = (run["main_cpu_s"]["median"] - start["main_cpu_s"]) / big_mb
    else:  # one worker runs in the main process
        worker_mb_s = big_mb / (run["main_cpu_s"]["median"] - start["main_cpu_s"])
    main_per_mb = results["main_cpu_s_per_mb"]
    inputs = {
        "worker_mb_s": round(worker_mb_s, 2),
        "main_cpu_s_per_mb": round(main_per_mb, 5),
        "startup_s": round(start["seconds"], 3),
        "out_bytes_per_text_byte": round(results["tokens"] * 2 / (big_mb * 1e6), 4),
        "in_bytes_per_text_byte": round(results["corpus"]["jsonl_mb"] / big_mb, 4),
    }
    settings = {
        "corpus_gb": args.corpus_gb,
        "node_cores": args.node_cores,
        "nodes": args.nodes,
        "node_read_gbps": args.node_read_gbps,
        "node_write_gbps": args.node_write_gbps,
        "fs_gbps": args.fs_gbps,
    }
    model = {"inputs": inputs, "settings": settings}
    model["uncompressed_jsonl"] = scaling_model(**inputs, **settings)
    model["zstd_jsonl"] = scaling_model(**inputs, **settings, decompress_mb_s=1000.0)
    results["scaling_model"] = model
    print()
    print(
        f"scaling model ({args.corpus_gb:.0f} GB of text; one worker {worker_mb_s:.1f} MB/s, main process "
        f"{main_per_mb * 1e3:.2f} ms/MB, start-up {start['seconds']:.2f} s; node read {args.node_read_gbps} "
        f"GB/s, write {args.node_write_gbps} GB/s, shared filesystem {args.fs_gbps} GB/s):"
    )
    for kind in ("uncompressed_jsonl", "zstd_jsonl"):
        m = model[kind]
        print(f"  {kind}:")
        for w, r in m["single_node"].items():
            print(
                f"    1 node, {w:>2} workers: {r['text_mb_s']:>7.1f} MB/s of text ({r['limit']}), read "
                f"{r['read_mb_s']:.0f} MB/s, write {r['write_mb_s']:.0f} MB/s: {r['hours_for_corpus']:.2f} h"
            )
        a = m["array"]
        print(
            f"    {a['nodes']} nodes x {a['workers_per_node']} workers: {a['text_mb_s']:.0f} MB/s "
            f"({a['limit']}), read {a['read_mb_s']:.0f} MB/s, write {a['write_mb_s']:.0f} MB/s: "
            f"tokenize {a['tokenize_hours'] * 60:.1f} min + merge {a['merge_hours'] * 60:.1f} min "
            f"= {a['hours_for_corpus'] * 60:.1f} min"
        )
        sat = m["single_node_saturates"]
        print(
            f"    one node stops gaining from more workers at {sat['from_workers']:.0f} ({sat['by']}); "
            f"an array of {args.node_cores}-core nodes is bound by the shared filesystem from "
            f"{a['shared_filesystem_bound_from_nodes']:.0f} nodes"
        )


def _send_all(conn, items: list, pickler) -> None:
    for item in items:
        conn.send_bytes(pickler.dumps(item))


def main_cpu_per_mb(jsonl: Path, rounds: int = 3) -> float:
    """CPU seconds per MB of text of the main process's share of the work, measured directly: the
    units of ``jsonl`` tokenized once here, then (best of ``rounds``) each result pickled, sent
    through a pipe by a thread and received (both ends counted: an upper bound), and written with its
    statistics as ``data_tools.preprocess`` does. The difference of two whole runs' main-process
    CPU (the run's and the start-up's) says the same, but noisily."""
    import multiprocessing.connection
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    from data_tools import preprocess as pp
    from data_tools.indexed_dataset import IndexedDatasetWriter
    from data_tools.stats import StatsAccumulator

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=BPE / "encoder.json", merge_file=BPE / "vocab.bpe")
    pp._init_worker({}, True, np.dtype(np.uint16), ("text",), None, tokenizer=tok)
    encoded = [pp._encode_unit(u) for u in pp._work_units([jsonl], ["text"], False, 2)]
    text_mb = sum(e.text_bytes for e in encoded) / 1e6
    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            received, sender = multiprocessing.Pipe(duplex=False)
            writer = IndexedDatasetWriter(Path(tmp) / "m", np.uint16)
            acc, summary = StatsAccumulator(tok.eod, tok.vocab_size), pp.PreprocessSummary()
            cpu = time.process_time()  # of both threads
            feeding = threading.Thread(target=_send_all, args=(sender, encoded, ForkingPickler))
            feeding.start()
            for _ in encoded:
                pp._add_encoded(ForkingPickler.loads(received.recv_bytes()), [writer], [acc], summary)
            feeding.join()
            writer.finalize()
            best = min(best, time.process_time() - cpu)
            sender.close()
            received.close()
    return best / text_mb


def _startup() -> dict:
    """Wall and main-process CPU seconds of a run that tokenizes almost nothing (interpreter,
    imports, tokenizer build, output files): the fixed cost of every run, best of 3."""
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "one.jsonl"
        one.write_text(json.dumps({"text": "a few words"}) + "\n", encoding="utf-8")
        runs = [ours([one], Path(tmp) / "o", 2) for _ in range(3)]
    return {"seconds": min(r["seconds"] for r in runs), "main_cpu_s": min(r["main_cpu_s"] for r in runs)}


def main() -> None:
    args = _parser().parse_args()
    docs = gutenberg_documents()
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    results: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_at_start": os.getloadavg(),
        "corpus": {"documents": len(docs), "text_mb": round(text_mb, 2), "repeat": args.repeat},
        "rounds": [],
        "raw": {},
        "ours": {},
    }
    results["startup"] = _startup()
    _measure(args, docs, text_mb, results)
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "gutenberg-00.jsonl"
        one.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        results["main_cpu_s_per_mb"] = main_cpu_per_mb(one)
    _report(args, results)
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
