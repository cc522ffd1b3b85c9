"""Every shipped recipe, at its own layout and full size, as one rank of its job on fake CUDA.

Each case runs the trainer's real path (builders, the recipe's DeepSpeed engine: ZeRO stage,
precision, the pipeline engine at pp > 1, TP) for two optimizer steps and one evaluation, with
the recipe's model, micro-batch and sequence length; the step has at most ``max(2, pp)``
micro-batches here instead of the recipe's 8–32, to keep the tier inside CI's time (each micro-batch
is the recipe's own; ``python -m megaformer.tools.dryrun`` runs the full count). Asserted from the
audit (:mod:`megaformer.perf.fakecuda.expectations`): every collective and p2p op got CUDA tensors
only; no host sync in forward or backward but the ones listed with their reasons; the host syncs
and copies per step each listed and within their bound; the recipe's dtypes for parameters,
gradients and optimizer state; the loss and gradient norm computed on the device; the peak of the
fake device memory below the GPU's memory.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from megaformer.config import load_config
from megaformer.perf.fakecuda.expectations import verdict
from megaformer.perf.fakecuda.launch import run_rank_of_job
from megaformer.perf.fakecuda.runtime import GPUS
from tests.fakecuda.recipes import recipe_cases

# Every recipe at full size (about 3 min on 2 cores): the full run's, outside `scripts/check.sh --fast`.
pytestmark = pytest.mark.slow

CASES = recipe_cases()


@pytest.fixture(scope="session")
def reports(warm_sessions) -> dict[str, dict]:
    """Every case's report, run two at a time (one process each; the machine has 2 cores), each a
    fork of a warm fake-CUDA interpreter (one per GPU model and thread). The largest layouts go
    first (the list ends with them), so that the two threads finish together. A later pipeline
    stage's rank takes its sends from its layout's rank-0 case, run first, instead of running a
    first-stage rank of its own (``run_rank_of_job``'s ``first_stage``)."""
    reports: dict[str, dict] = {}

    def run(case):
        ident, path, overrides, world, rank, gpu = case
        pp = load_config(path, overrides).parallel.pp_size
        head = reports.get(ident.rsplit("-rank", 1)[0] + "-rank0") if rank else None
        return ident, run_rank_of_job(
            path, overrides, world_size=world, rank=rank, gpu=gpu, max_micro_batches=max(2, pp),
            sessions=warm_sessions, first_stage=head,
        )  # fmt: skip

    first, later = [c for c in CASES[::-1] if c[4] == 0], [c for c in CASES[::-1] if c[4] != 0]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports.update(pool.map(run, first))
        reports.update(pool.map(run, later))
    return reports


@pytest.mark.parametrize(
    ("ident", "path", "overrides", "world", "rank", "gpu"), CASES, ids=[c[0] for c in CASES]
)
def test_recipe_runs_on_fake_cuda_as_the_gpu_job_would(reports, ident, path, overrides, world, rank, gpu):
    report = reports[ident]
    assert "error" not in report, f"{ident}: {report.get('error')}\n{report.get('traceback', '')[-3000:]}"
    cfg = load_config(path, overrides)
    judged = verdict(report, report["engine"]["gas"])
    assert judged["ok"], f"{ident}: " + "; ".join(judged["problems"])
    assert report["steps_done"] == 2
    # what a GPU run would be refused or slowed by: none; what stays, each named with its reason
    assert not [f for f in report["findings"] if f["kind"] in ("cpu_collective", "dynamic_shape")]
    syncs = [
        f for f in report["findings"] if f["kind"] == "host_sync" and f["phase"] in ("forward", "backward")
    ]
    # DeepSpeed's own: the pipeline engine's received shapes (first micro-batch), ZeRO-3's trace check
    assert all(f["where"].startswith("deepspeed/runtime/") for f in syncs), syncs
    assert all(row["why"] for row in judged["syncs_per_step"] + judged["copies_per_step"])
    # dtypes as the recipe states them
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[cfg.train.precision]
    assert report["dtypes"]["parameters"] == [low]
    assert report["dtypes"]["gradients"] == [low]
    assert "torch.float32" in report["dtypes"]["optimizer_state"]
    # loss and gradient norm computed, on the device
    assert report["loss"]["device"].startswith("cuda") and report["loss"]["dtype"] == "torch.float64"
    assert report["grad_norm"] is not None
    # the data-parallel gradient reduction happened in each step, at least the rank's gradients once
    # in 16 bits (ZeRO-1/2 reduce or all-reduce them over the dp group)
    for step in ("1", "2"):
        dp_bytes = sum(c["bytes"] for c in report["collectives"][step] if c["group"] == "dp")
        assert dp_bytes >= 2 * report["parameters_rank"] * 0.99, (ident, step, report["collectives"][step])
    if cfg.parallel.pp_size > 1:
        ops = {c["op"] for c in report["collectives"]["2"]}
        assert {"send", "recv_"} & ops, ops
    if cfg.parallel.tp_size > 1:
        assert any(c["group"] == "tp" for c in report["collectives"]["2"])
    # flash attention on A100 (bf16), memory-efficient attention on V100 (no flash before sm80)
    kernel = "flash" if GPUS[gpu].capability >= (8, 0) else "memory_efficient"
    assert set(report["attention_kernels"]) == {kernel}
    # the recipe fits the GPU its header names (the fake allocations' peak)
    assert report["peak_bytes"] < GPUS[gpu].memory_bytes, (ident, report["peak_by_category"])
