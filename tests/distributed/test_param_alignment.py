"""Every parameter stays 16-byte aligned in DeepSpeed's flat buffers (bf16, ZeRO-1 and ZeRO-2).

DeepSpeed's BF16 optimizer and its ZeRO-1/2 optimizer copy each group's parameters into one flat
buffer in the group's order, with nothing between them, and make each parameter a view into it.
HeadScale's γ has ``num_heads`` elements (12 at 125M: 24 bytes in bf16), so in the model's own
order every parameter after it sat 8 bytes off a 16-byte boundary; on an H200 those GEMMs ran sm80
CUTLASS kernels instead of the Hopper ones (bench/results/gpu/2026-11-26-h200). The optimizer
lists odd-sized parameters last (``param_order="aligned"``, megaformer.model.aligned_order): here,
through DeepSpeed itself on CPU, every parameter whose size is a multiple of 16 elements is
aligned, and the model's declared order shows the misalignment it removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import free_port

pytestmark = pytest.mark.slow  # a DeepSpeed engine per case: outside `scripts/check.sh --fast`

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=3", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_len=64"]


def run_alignment(zero: int, order: str, overrides: list[str] = SMALL, cpu: bool = True) -> dict:
    """``tests/support/param_alignment.py`` in a fresh process (world 1; DeepSpeed's CPU
    accelerator unless ``cpu`` is False): the optimizer's name and each parameter's alignment."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    script = str(REPO / "tests" / "support" / "param_alignment.py")
    proc = subprocess.run(
        [sys.executable, script, str(zero), order, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.parametrize(("zero", "optimizer"), [(1, "BF16_Optimizer"), (2, "DeepSpeedZeroOptimizer")])
def test_deepspeed_flat_buffers_keep_every_parameter_aligned(zero, optimizer):
    aligned = run_alignment(zero, "aligned")
    assert aligned["optimizer"].startswith(optimizer), aligned["optimizer"]
    params = aligned["params"]
    whole = [p for p in params if p["numel"] % 16 == 0]
    assert len(whole) > 20 and all(p["offset_mod_16"] == 0 for p in whole), [
        p for p in whole if p["offset_mod_16"]
    ]
    odd = [p["name"] for p in params if p["numel"] % 16]
    assert odd and all(name.endswith("head_scale") for name in odd), odd  # γ: 4 heads, 8 bytes

    declared = run_alignment(zero, "declared")["params"]
    off = [p["name"] for p in declared if p["numel"] % 16 == 0 and p["offset_mod_16"]]
    assert len(off) >= 5, off  # what the aligned order removes: weights and biases after a γ
