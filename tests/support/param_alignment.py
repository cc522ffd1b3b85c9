"""Build a NormFormer LM, its optimizer and DeepSpeed engine in one process (gloo, world 1) and
print, as JSON, which parameters DeepSpeed's flat buffers left off a 16-byte boundary.

    python tests/support/param_alignment.py ZERO_STAGE ORDER [section.key=value ...]

Used by tests/distributed/test_param_alignment.py (a subprocess: DeepSpeed's process group and
accelerator choice are per process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    zero, order, *overrides = sys.argv[1:]
    from megaformer.config import load_config
    from megaformer.parallel.rng import DropoutRNG
    from megaformer.training.builders import build_layout, build_model, build_optimizer
    from megaformer.training.deepspeed_config import build_deepspeed_config
    from megaformer.training.ds_adapter import initialize

    cfg = load_config(
        str(REPO / "configs" / "paper" / "125m-normformer.yaml"),
        [f"train.zero_stage={zero}", "train.precision=bf16", "train.compile=false", *overrides],
    )
    layout = build_layout(cfg, 1)
    model = build_model(cfg, layout, DropoutRNG(cfg.train.seed, device=layout.device))
    optimizer, scheduler = build_optimizer(model, cfg, 0, param_order=order)
    engine = initialize(
        model, optimizer, scheduler, build_deepspeed_config(cfg, 1), layout.state, pipelined=False
    )
    rows = [
        {"name": n, "numel": p.numel(), "offset_mod_16": p.data_ptr() % 16}
        for n, p in model.named_parameters()
    ]
    print("RESULT " + json.dumps({"optimizer": engine.optimizer_summary(), "params": rows}), flush=True)
    os._exit(0)  # no process-group teardown at exit


if __name__ == "__main__":
    main()
