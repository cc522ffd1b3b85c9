"""``bench/gpu_check.py`` on a GPU image: a prediction that needs a CPU torch must not cost the
measured rows (the H200's second run lost its table to the step-time model's fake-CUDA trace)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_step_time_prediction_is_recorded_and_the_rows_still_written(monkeypatch, tmp_path):
    # fakecuda.launch binds build_shim at import: imported here, before the patch, it keeps the real
    # one (gpu_check imports it under the patch, and the stub would outlive this test).
    from megaformer.fakecuda import build, launch
    from megaformer.tools import steptime

    assert launch.build_shim is build.build_shim

    def no_trace(*args, **kwargs):
        raise RuntimeError(
            "block trace failed (exit 1):\nKey already registered with the same priority: CUDAHooks"
        )

    def no_shim():
        raise OSError("a CUDA torch has no fake-CUDA shim")

    monkeypatch.setattr(steptime, "predict", no_trace)
    monkeypatch.setattr(build, "build_shim", no_shim)
    gpu_check = _gpu_check()
    row = {
        "recipe": "125m-baseline",
        "zero": 1,
        "recompute": "none",
        "overrides": ["train.zero_stage=1", "train.recompute=none", "train.micro_batch_size=32"],
        "micro_batch": 32,
        "step_s": 0.718,
        "tokens_per_s": 365006.5,
        "mfu": 0.359,
        "peak_memory_gib": 34.03,
    }
    out = tmp_path / "gpu_check.json"
    assert gpu_check._write([row], "h200-141gb", False, str(out)) == 0
    written = json.loads(out.read_text())["rows"][0]
    assert written["step_s"] == pytest.approx(0.718)
    error = written["prediction"]["steptime"]["error"]
    assert "block trace failed" in error and "--repredict" in error
    assert written["prediction"]["planner_peak_gib"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| 125m-baseline | 1 | none | 32 | 0.718 | - |" in table
