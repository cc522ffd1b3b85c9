"""A session forked from a warm fake-CUDA server (:class:`~megaformer.perf.fakecuda.launch.WarmSessions`,
what the recipes' tier runs on) reports what a fresh interpreter reports, and a failing one fails
the same way."""

from __future__ import annotations

import json

import pytest

from megaformer.perf.fakecuda.launch import WarmSessions, run_session

pytestmark = (
    pytest.mark.slow
)  # three fake-CUDA sessions (~25 s on 2 cores): outside `scripts/check.sh --fast`

SMALL = "configs/normformer-quickstart.yaml"
BF16 = ["train.precision=bf16", "train.deepspeed_config=configs/deepspeed/paper-bf16-a100.json"]
TIMES = {"seconds", "returncode"}
# How the peak's bytes split into categories (and which storages were largest at it) is keyed by
# Python object ids (runtime.storage_key: id() of a storage object, which CPython reuses once one is
# freed), so the split can differ between any two processes (a clean-clone CI moved 1 MiB from
# gradients to activations between a fresh and a forked session); the peak itself, the categories'
# total and every other field may not.
SPLIT = {"peak_by_category", "peak_largest"}


def _same(report: dict) -> str:
    kept = {k: v for k, v in report.items() if k not in TIMES | SPLIT}
    kept["peak_total_by_category"] = sum(report["peak_by_category"].values())
    return json.dumps(kept, sort_keys=True, default=str)


def test_a_forked_session_reports_what_a_fresh_one_does(shim):
    args = {"world_size": 2, "rank": 0, "gpu": "a100-80gb"}
    fresh = run_session(SMALL, BF16, **args)
    with WarmSessions(shim) as warm:
        forked = [run_session(SMALL, BF16, sessions=warm, **args) for _ in range(2)]
        # a session that fails (the planted CPU collective under strict NCCL) fails alike when forked
        failed = run_session(SMALL, BF16, sessions=warm, setup_modules=["tests.fakecuda.planted"], **args)
    assert "error" not in fresh and fresh["steps_done"] == 2, fresh.get("error")
    assert _same(forked[0]) == _same(fresh) and _same(forked[1]) == _same(fresh)
    assert "NCCL refuses a cpu tensor" in failed["error"] and failed["returncode"] == 3
