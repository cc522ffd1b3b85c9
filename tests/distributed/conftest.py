"""Fixtures for multi-process runs: a real-text dataset and a launcher wrapper."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
CPU_FP16_PATH = str(REPO / "tests" / "support" / "cpu_fp16")
"""Put on PYTHONPATH to run DeepSpeed's fp16 path on CPU (its sitecustomize; test-only)."""


@pytest.fixture(scope="session")
def gutenberg_prefix(tmp_path_factory) -> str:
    """Three real novels, one document per paragraph block, GPT-2 BPE + EOD, as .bin/.idx."""
    out = tmp_path_factory.mktemp("data") / "novels"
    books = [DATA / "gutenberg-novels" / name for name in ("pg42.txt.xz", "244-0.txt.xz", "pg2097.txt.xz")]
    cmd = [
        sys.executable, "-m", "data_tools.preprocess",
        "--input", *map(str, books),
        "--output-prefix", str(out),
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(DATA / "gpt2-bpe" / "encoder.json"),
        "--merge-file", str(DATA / "gpt2-bpe" / "vocab.bpe"),
        "--append-eod", "--text-split-blank-lines", "--skip-bad-records", "--workers", "2",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return f"{out}_text_document"


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
    """The uninterrupted 12-step run (keeping the last 2 checkpoints): global_step8 and 12."""
    out = tmp_path_factory.mktemp("lifecycle_reference")
    overrides = [*LIFECYCLE_TINY, f"data.prefix={gutenberg_prefix}", "train.keep_last_checkpoints=2"]
    proc = run_pretrain("configs/normformer-quickstart.yaml", [*overrides, f"output.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
