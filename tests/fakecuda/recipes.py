"""Every shipped recipe at its own layout: (id, config, overrides, world size, ranks to run, GPU)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAPER = [f"{size}-{kind}" for size in ("125m", "355m", "1.3b", "2.7b") for kind in ("baseline", "normformer")]
# The masked-LM recipes (synthetic masked rows: megaformer/perf/fakecuda/session.py SyntheticMaskedSamples).
PAPER += [f"mlm-125m-{kind}" for kind in ("baseline", "normformer", "normformer-resscale")]


def _paper_layouts(name: str) -> list[tuple[str, str, list[str], int, str]]:
    text = (REPO / "configs" / "paper" / f"{name}.yaml").read_text()
    a100 = int(re.search(r"# A100 layout \(this file\): world (\d+)", text)[1])
    v100 = int(re.search(r"# V100 layout: world (\d+)", text)[1])
    overrides = re.search(r"^# V100 overrides: (.*)$", text, re.MULTILINE)[1].split()
    path = f"configs/paper/{name}.yaml"
    return [
        (f"{name}-a100", path, [], a100, "a100-80gb"),
        (f"{name}-v100", path, overrides, v100, "v100-32gb"),
    ]


def recipe_cases() -> list[tuple[str, str, list[str], int, int, str]]:
    """``(id, config, overrides, world, rank, gpu)``: rank 0 of every layout, and the last pipeline
    stage's last rank where pp > 1."""
    zero3_cut = ["train.zero_stage=3", "model.num_layers=8"]
    layouts = [case for name in PAPER for case in _paper_layouts(name)]
    layouts += [
        ("1.3b-3d-v100", "configs/normformer-1.3b-3d-v100.yaml", [], 256, "v100-32gb"),
        ("2.7b-3d-a100", "configs/normformer-2.7b-3d-a100.yaml", [], 256, "a100-80gb"),
        ("350m-zero2", "configs/normformer-350m-zero2.yaml", [], 8, "a100-80gb"),
        # No shipped recipe uses ZeRO-3; its engine is checked on the 350M ZeRO-2 recipe's layout
        # (world 8, bf16, 2 accumulation steps) cut to 8 of its 24 layers: ZeRO-3's hooks run per
        # parameter: at 24 layers its case cost 36-47 s, at 8 17-19 s (2026-12-07, loaded VM).
        ("350m-zero3", "configs/normformer-350m-zero2.yaml", zero3_cut, 8, "a100-80gb"),
    ]
    cases = []
    for ident, path, overrides, world, gpu in layouts:
        cases.append((f"{ident}-rank0", path, overrides, world, 0, gpu))
        if "3d" in ident:
            cases.append((f"{ident}-rank{world - 1}", path, overrides, world, world - 1, gpu))
    return cases
