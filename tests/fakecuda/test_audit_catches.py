"""The tier can fail: planted defects are reported with file:line, and the DeepSpeed crash the
config check prevents is real on the GPU path."""

from __future__ import annotations

import pytest

from megaformer.perf.fakecuda.expectations import verdict
from megaformer.perf.fakecuda.launch import run_python, run_session

SMALL = "configs/normformer-quickstart.yaml"
BF16 = ["train.precision=bf16", "train.deepspeed_config=configs/deepspeed/paper-bf16-a100.json"]


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_planted_cpu_collective_and_host_sync_in_forward_are_reported_with_file_and_line(warm_sessions):
    report = run_session(
        SMALL, BF16, world_size=2, rank=0, gpu="a100-80gb", strict_nccl=False,
        setup_modules=["tests.fakecuda.planted"], sessions=warm_sessions,
    )  # fmt: skip
    assert "error" not in report, report.get("traceback")
    cpu = [f for f in report["findings"] if f["kind"] == "cpu_collective"]
    assert cpu and all(f["where"].startswith("tests/fakecuda/planted.py:") for f in cpu), cpu
    syncs = [f for f in report["findings"] if f["kind"] == "host_sync" and f["phase"] == "forward"]
    assert syncs and {f["where"] for f in syncs} == {
        "tests/fakecuda/planted.py:16 (forward_with_a_host_sync)"
    }, syncs
    problems = verdict(report, report["engine"]["gas"])["problems"]
    assert any("NCCL takes CUDA tensors only" in p and "planted.py" in p for p in problems), problems
    assert any(p.startswith("host sync in forward at tests/fakecuda/planted.py:16") for p in problems), (
        problems
    )


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_strict_nccl_stops_at_the_planted_cpu_collective(warm_sessions):
    report = run_session(
        SMALL,
        BF16,
        world_size=2,
        rank=0,
        gpu="a100-80gb",
        setup_modules=["tests.fakecuda.planted"],
        sessions=warm_sessions,
    )
    assert "NCCL refuses a cpu tensor" in report["error"] and "tests/fakecuda/planted.py" in report["error"]


@pytest.mark.parametrize("unchecked", [False, True], ids=["checked", "unchecked"])
def test_bf16_with_fp32_accumulation_at_zero0(warm_sessions, unchecked):
    """The paper's bf16 JSON at ZeRO-0: refused with the key and the fix; with the check switched
    off, DeepSpeed 0.19 crashes on the GPU path (what the code before the check did)."""
    report = run_session(
        SMALL,
        [*BF16, "train.zero_stage=0"],
        world_size=2,
        rank=0,
        gpu="a100-80gb",
        unchecked_engine_json=unchecked,
        sessions=warm_sessions,
    )
    if unchecked:
        assert report["error"].startswith(
            "NotImplementedError: unsupported mix of model_dtype=torch.bfloat16"
        )
    else:
        assert report["error"].startswith("ConfigError:") and "grad_accum_dtype" in report["error"]
        assert "train.zero_stage=1" in report["error"]


def test_dropout_states_follow_the_device_of_the_tensors_they_serve(shim):
    """A DropoutRNG built for the CPU (the default) and used on CUDA tensors switches to CUDA
    Philox states (16 bytes) before its first draw; drawing on another device afterwards is refused."""
    code = """
import torch
from megaformer.perf.fakecuda.runtime import GPUS, fake_mode, install_cuda_stubs
from megaformer.parallel.rng import DropoutRNG, cuda_philox_state
install_cuda_stubs(GPUS["a100-80gb"])
rng = DropoutRNG(7)
assert rng.state_dict()["sharded"].numel() == 5056  # the CPU generator's state
with fake_mode():
    x = torch.ones(4, 8, device="cuda")
    with rng.fork("sharded", x.device):
        torch.nn.functional.dropout(x, 0.1)
assert rng.device.type == "cuda"
states = rng.state_dict()
assert all(s.numel() == 16 and s.dtype == torch.uint8 for s in states.values()), states
fresh = DropoutRNG(7, device="cuda").state_dict()
assert torch.equal(fresh["sharded"], cuda_philox_state(rng._seeds["sharded"]))
try:
    with rng.fork("sharded", torch.device("cpu")):
        pass
except RuntimeError as e:
    assert "move the model to its device" in str(e)
else:
    raise AssertionError("a draw on the CPU after CUDA draws was accepted")
print("OK")
"""
    proc = run_python(["-c", code], timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr[-3000:]
