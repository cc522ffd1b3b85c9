"""``python -m megaformer.tools.dryrun``: bad input is refused before anything is built (exit 2,
the key or flag and the fix); the engine combination DeepSpeed 0.19 crashes on is refused at
config load. (The runs themselves are in tests/fakecuda.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megaformer.config import ConfigError, load_config
from megaformer.tools.dryrun import main as dryrun_main
from megaformer.training.deepspeed_config import build_deepspeed_config, check_engine_combination
from megaformer.training.preflight import run_preflight

REPO = Path(__file__).resolve().parents[2]
PAPER_125M = "configs/paper/125m-normformer.yaml"


def dryrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megaformer.tools.dryrun", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((PAPER_125M, "--gpu", "b200"), "unknown GPU 'b200'; use one of v100-32gb"),
        (
            ("configs/normformer-2.7b-3d-a100.yaml", "--nodes", "1", "--gpus-per-node", "6"),
            "world size 6 is not divisible",
        ),
        ((PAPER_125M, "--gpus-per-node", "8", "--rank", "9"), "--rank 9 is outside the world of 8"),
        ((PAPER_125M, "--nodes", "0"), "--nodes 0 --gpus-per-node 8: both must be ≥ 1"),
        ((PAPER_125M, "train.zero_stage=0"), "data_types.grad_accum_dtype='fp32' with train.precision=bf16"),
        ((PAPER_125M, "--gpu", "v100"), "train.precision=bf16 on v100-32gb"),
        ((PAPER_125M, "train.no_such_key=1"), "no_such_key"),
    ],
    ids=[
        "unknown-gpu",
        "layout-vs-world",
        "rank-outside",
        "no-nodes",
        "bf16-zero0",
        "bf16-on-v100",
        "bad-key",
    ],
)
def test_bad_input_is_refused_before_anything_runs(args, message, capsys):
    """In this process (the command's ``main``; an argparse refusal is its ``SystemExit(2)``): 2 s
    of imports a case less than a new interpreter. The command line itself: the test below."""
    try:
        code = dryrun_main(list(args))
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    assert code == 2, said.out + said.err
    assert message in said.err, said.err


def test_the_command_line_refuses_bad_input_with_exit_2_and_no_traceback():
    proc = dryrun(PAPER_125M, "train.no_such_key=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no_such_key" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_gpu_aliases_name_the_devices():
    from megaformer.tools.dryrun import gpu_name

    assert gpu_name("H100") == "h100-80gb" and gpu_name("a100-40gb") == "a100-40gb"


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["train.zero_stage=0"], True),  # the paper JSON's fp32 accumulation without ZeRO
        (["train.zero_stage=1"], False),  # DeepSpeed's BF16 optimizer: the recipe as shipped
        (["train.zero_stage=0", "train.deepspeed_config="], False),  # bf16 accumulation
        (["train.zero_stage=0", "train.precision=fp32"], False),
        (["train.zero_stage=0", "train.precision=fp16"], True),  # fp16 model, fp32 accumulation
    ],
)
def test_fp32_gradient_accumulation_needs_a_zero_optimizer(overrides, refused):
    cfg = load_config(PAPER_125M, overrides)
    if refused:
        with pytest.raises(ConfigError, match=r"paper-bf16-a100\.json: data_types\.grad_accum_dtype='fp32'"):
            build_deepspeed_config(cfg, 8)
    else:
        build_deepspeed_config(cfg, 8)


def test_the_preflight_refuses_it_before_any_process_group():
    cfg = load_config(PAPER_125M, ["train.zero_stage=0"])
    with pytest.raises(ConfigError, match=r"Use train\.zero_stage=1"):
        run_preflight(cfg, 8)


def test_a_json_without_accumulation_dtype_is_left_alone():
    cfg = load_config(PAPER_125M, ["train.zero_stage=0"])
    check_engine_combination(cfg, {"zero_optimization": {"reduce_bucket_size": 1}})


def test_the_default_layout_is_the_recipe_headers_and_said():
    """Without --nodes / --gpus-per-node the dry run takes the layout the recipe's header names (the
    3D recipes: 32 nodes × 8; issue 39: it dry-ran one node of 8, 598 s for the 1.3B 3D recipe), and
    says so; a config without one gets 1 × 8, said as the default."""
    import argparse

    from megaformer.tools.dryrun import default_layout, header_world

    assert header_world("configs/normformer-1.3b-3d-v100.yaml") == (32, 8)
    assert header_world("configs/paper/1.3b-normformer.yaml") == (2, 8)
    assert header_world("configs/paper/125m-normformer.yaml") == (1, 8)
    assert header_world("configs/normformer-quickstart.yaml") is None
    args = argparse.Namespace(config="configs/normformer-2.7b-3d-a100.yaml", nodes=None, gpus_per_node=None)
    assert "32 node(s) × 8 GPUs (the layout its header names" in default_layout(args)
    assert (args.nodes, args.gpus_per_node) == (32, 8)
    args = argparse.Namespace(config="configs/normformer-quickstart.yaml", nodes=None, gpus_per_node=4)
    assert "no layout in its header: the default" in default_layout(args) and (
        args.nodes,
        args.gpus_per_node,
    ) == (1, 4)
    args = argparse.Namespace(config="configs/normformer-2.7b-3d-a100.yaml", nodes=2, gpus_per_node=8)
    assert default_layout(args) == "" and args.nodes == 2  # both given: nothing to say
