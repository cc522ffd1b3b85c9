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
