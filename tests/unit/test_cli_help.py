"""Help texts users read first (issue 13): launch/pretrain.sh --help and generate --help."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_help_is_the_header_only_and_says_how_deepspeed_is_found():
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "pretrain.sh"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    text = proc.stdout
    assert text.startswith("Launch megaformer pretraining") and "set -euo" not in text
    # The order the script uses: the repo's .venv first (no virtual environment active), then PATH.
    assert (
        "the repo's .venv/bin/deepspeed when no virtual" in text
        and "else the first deepspeed on PATH" in text
    )
    assert "torchrun --nproc_per_node=N -m megaformer.train" in text
    assert "python -m megaformer.train CONFIG.yaml" in text
    # Without a config it is an error (exit 2), with the same text.
    bare = subprocess.run(["bash", str(REPO / "launch" / "pretrain.sh")], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stdout == text


def test_generate_help_shows_the_defaults(capsys):
    from megaformer.tools.generate import build_parser

    help_text = " ".join(build_parser().format_help().split())
    for default in (
        "(default: 64)",
        "(default: 0.8)",
        "(default: 50)",
        "(default: 1)",
        "(default: GPT2BPETokenizer)",
    ):
        assert default in help_text, default
