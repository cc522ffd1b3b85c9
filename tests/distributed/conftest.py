"""Fixtures for multi-process runs: a real-text dataset and a launcher wrapper."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import warm_ranks

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
CPU_FP16_PATH = str(REPO / "tests" / "support" / "cpu_fp16")
"""Put on PYTHONPATH to run DeepSpeed's fp16 path on CPU (its sitecustomize; test-only)."""


NOVELS = ("pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz")
"""The three bundled Gutenberg novels the multi-process tests train on (data/gutenberg-novels)."""
GPT2_TOKENIZER = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(DATA / "gpt2-bpe" / "encoder.json"),
    "--merge-file", str(DATA / "gpt2-bpe" / "vocab.bpe"),
]  # fmt: skip
SMALL_BPE = REPO / "tests" / "fixtures" / "novels-bpe500"
SMALL_VOCAB = ["model.vocab_size=500", "data.eod_token=0"]
"""The overrides that go with :func:`small_vocab_prefix`'s data: 500 entries (512 embedding rows at
TP 1, 2 and 4, so 12 padded), ``<|endoftext|>`` as id 0."""


def preprocess_novels(out: Path, tokenizer: list[str]) -> str:
    """:data:`NOVELS`, one document per paragraph block, tokenized with ``tokenizer`` (the
    preprocess flags) + EOD, as .bin/.idx at ``out``; returns the dataset prefix."""
    books = [DATA / "gutenberg-novels" / name for name in NOVELS]
    cmd = [
        sys.executable, "-m", "data_tools.preprocess",
        "--input", *map(str, books), "--output-prefix", str(out), *tokenizer,
        "--append-eod", "--text-split-blank-lines", "--skip-bad-records", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return f"{out}_text_document"


@pytest.fixture(scope="session")
def gutenberg_prefix(tmp_path_factory) -> str:
    """Three real novels, one document per paragraph block, GPT-2 BPE + EOD, as .bin/.idx."""
    return preprocess_novels(tmp_path_factory.mktemp("data") / "novels", GPT2_TOKENIZER)


@pytest.fixture(scope="session")
def small_vocab_prefix(tmp_path_factory) -> str:
    """The same three novels as :func:`gutenberg_prefix`, tokenized with the test tier's 500-entry
    byte-level BPE (:mod:`tests.support.small_bpe`; 326,560 tokens with EOD, 2,366 documents). For
    the runs whose subject is not the GPT-2 vocabulary (layouts, resume, signals, checkpoints):
    with :data:`SMALL_VOCAB` their tiny model's step is 11x shorter than at GPT-2's 50,304 output
    rows. Pass both: ``[*SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]``."""
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(SMALL_BPE)]
    return preprocess_novels(tmp_path_factory.mktemp("data_small_vocab") / "novels", tokenizer)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT of spawned process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(
    config: str, overrides: list[str], nproc: int = 2, timeout: int = 400
) -> subprocess.CompletedProcess:
    """Run launch/pretrain.sh as a user would; returns the finished process (stdout+stderr text)."""
    env = dict(os.environ)
    env["NPROC_PER_NODE"] = str(nproc)
    env.pop("MASTER_PORT", None)  # the script picks a free port
    return subprocess.run(
        ["bash", str(REPO / "launch" / "pretrain.sh"), config, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_ranks(
    config: str,
    overrides: list[str],
    nproc: int = 2,
    timeout: int = 400,
    env: dict[str, str] | None = None,
    module: str = "megaformer.train",
) -> subprocess.CompletedProcess:
    """Run ``python -m megaformer.train`` (or another rank program, ``module``, as
    ``MEGAFORMER_MODULE`` names one to ``launch/pretrain.sh``) as ``nproc`` ranks started here, by
    torchrun's contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
    in the environment): for the tests whose subject is the training (layouts, numerics,
    checkpoints), not the launcher. It skips ``launch/pretrain.sh``'s checks, the supervisor,
    DeepSpeed's runner and its per-node ``launch.py`` (four Python start-ups, about 8 s of a launch
    on 2 cores); the launcher's own behaviour keeps its tests through :func:`run_pretrain`. The
    ranks are forks of an interpreter that has imported torch, DeepSpeed and the trainer once per
    session (:mod:`tests.support.warm_ranks`: 3.5-4 s of CPU saved per rank), unless ``env`` changes
    what an interpreter reads at start-up (then, and under ``MEGAFORMER_TEST_FRESH_RANKS=1``, each
    rank is a new ``python -u -m megaformer.train``).

    Returns the finished job as a ``CompletedProcess``: ``stdout``/``stderr`` are the ranks' in rank
    order, ``returncode`` the first non-zero rank's (0 when all succeeded). A rank that fails ends
    the others 30 s later (they may wait in a collective for it), as DeepSpeed's launcher does.

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout`` seconds (every rank is killed).
    """
    import tempfile
    import time

    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "LOCAL_RANK")}
    base |= {
        "DS_ACCELERATOR": "cpu",
        # as pretrain.sh sets it (a value already in the environment wins)
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p),
        **(env or {}),
    }
    argv = [config, *overrides]
    cmd = [sys.executable, "-u", "-m", module, *argv]
    fork = warm_ranks.can_fork(base)
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as files:
        # files, not pipes: a rank blocked on a full pipe would hang the others in a collective
        paths = [os.path.join(logs, f"{r}.{k}") for r in range(nproc) for k in ("out", "err")]
        outs = [files.enter_context(open(path, "w+")) for path in paths]
        envs = [base | {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
        if fork:  # the same main(argv), in a fork of an interpreter that has done the imports
            procs = [
                warm_ranks.start_rank(argv, envs[r], str(REPO), paths[2 * r], paths[2 * r + 1], module)
                for r in range(nproc)
            ]
        else:
            procs = [
                subprocess.Popen(cmd, cwd=REPO, env=envs[r], stdout=outs[2 * r], stderr=outs[2 * r + 1])
                for r in range(nproc)
            ]
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 30):
                for p in procs:
                    p.kill()
                    p.wait()
                if now > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.1)
        texts = []
        for f in outs:
            f.seek(0)
            texts.append(f.read())
    codes = [p.returncode for p in procs]
    rc = next((c for c in codes if c != 0), 0)
    done = subprocess.CompletedProcess(cmd, rc, "".join(texts[0::2]), "".join(texts[1::2]))
    done.forked = fork  # the ranks were forks of the warm interpreter (test_warm_ranks.py)
    done.codes = codes  # every rank's exit status, in rank order (-9: killed here after another failed)
    done.ranks = list(zip(texts[0::2], texts[1::2]))  # (stdout, stderr) of each rank, in rank order
    return done


def warm_pretrain_sh(args: list[str], log_path, env: dict[str, str]) -> int:
    """Stand-in for :func:`megaformer.experiments.launcher._pretrain_sh` in the experiment tests
    whose subject is the experiment (sweep, compare), not the launcher: the same ``CONFIG
    OVERRIDES`` (or ``MEGAFORMER_MODULE``'s ``SPEC``) run by :func:`run_ranks` on
    ``NPROC_PER_NODE`` warm-forked ranks, their output into ``log_path``; returns the exit status.
    ``launch/pretrain.sh``'s own part (the config check before any worker, the supervisor, DeepSpeed's
    runner) keeps its tests: test_launcher_runs.py runs :func:`~megaformer.experiments.launcher.launch_run`
    and ``launch_module`` through it."""
    module = env.get("MEGAFORMER_MODULE", "megaformer.train")
    proc = run_ranks(args[0], list(args[1:]), nproc=int(env["NPROC_PER_NODE"]), timeout=600, module=module)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(proc.stdout + proc.stderr)
    return proc.returncode


@pytest.fixture
def warm_experiment_launches(monkeypatch):
    """The experiment commands' runs as warm-forked ranks (:func:`warm_pretrain_sh`), in this process."""
    from megaformer.experiments import launcher

    monkeypatch.setattr(launcher, "_pretrain_sh", warm_pretrain_sh)
    monkeypatch.chdir(REPO)


def read_scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    """All scalars of the TensorBoard event files under ``tb_dir``: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


LIFECYCLE_TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "model.hidden_dropout=0.1",  # dropout on: exact resume needs every rank's generator back
    "model.attention_dropout=0.1",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=100",
    "train.eval_batches=1",
    "train.save_interval=4",
    "train.steps=12",
    "data.valid_fraction=0.02",
]
"""A 12-step, 3.3M-parameter run saving every 4 steps: the run-lifecycle tests' shape."""


@pytest.fixture(scope="session")
def lifecycle_reference(gutenberg_prefix, tmp_path_factory) -> Path:
    """The uninterrupted 12-step run (keeping the last 2 checkpoints): global_step8 and 12. A
    reference, not a launcher test: its ranks are started here (:func:`run_ranks`)."""
    out = tmp_path_factory.mktemp("lifecycle_reference")
    overrides = [*LIFECYCLE_TINY, f"data.prefix={gutenberg_prefix}", "train.keep_last_checkpoints=2"]
    proc = run_ranks("configs/normformer-quickstart.yaml", [*overrides, f"output.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def lifecycle_reference_small_vocab(small_vocab_prefix, tmp_path_factory) -> Path:
    """:func:`lifecycle_reference` on :func:`small_vocab_prefix`'s data (with :data:`SMALL_VOCAB`):
    the reference of the lifecycle tests whose subject is not the GPT-2 vocabulary (resume, saves,
    damaged checkpoints), whose own runs train on the same data."""
    out = tmp_path_factory.mktemp("lifecycle_reference_small_vocab")
    data = [*SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]
    overrides = [*LIFECYCLE_TINY, *data, "train.keep_last_checkpoints=2"]
    proc = run_ranks("configs/normformer-quickstart.yaml", [*overrides, f"output.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
