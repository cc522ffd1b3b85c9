"""Write the final CPU reproduction's configs: each scheme at the best learning rate of its sweep at
the final horizon (0.67 device-hours, linear decay to 0), one file per seed.

    .venv/bin/python experiments/cpu-final/make_configs.py

Rates come from the sweeps' ``sweep.json`` (``best``): Pre-LN, NormFormer and NormFormer + ResScale
from ``experiments/lr-sweep-horizon-2026-11-26``, Post-LN and DeepNorm from
``experiments/lr-sweep-horizon-postln-deepnorm-2026-11-26``. Three seeds for Pre-LN, NormFormer and
NormFormer + ResScale (the issue's "at least three seeds"), one for Post-LN and DeepNorm.
Refuses (exit 2, naming the file) while a sweep is unfinished.
"""

import json
import sys
from pathlib import Path

import yaml

from megaformer.config.load import load_config, to_dict

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SWEEPS = {
    "lr-sweep-horizon-2026-11-26": ("pre_ln", "normformer", "normformer_resscale"),
    "lr-sweep-horizon-postln-deepnorm-2026-11-26": ("post_ln", "deepnorm"),
}
THREE = (1234, 5678, 4321)
SEEDS = {
    "pre_ln": THREE,
    "normformer": THREE,
    "normformer_resscale": THREE,
    "post_ln": (1234,),
    "deepnorm": (1234,),
}
SCHEDULE = ["data.prefix=data/processed/gutenberg_text_document", "train.min_lr=0", "train.lr_decay=linear"]
# Every seed holds out the novel that seed 1234 held out in the sweeps (1 of the 21): the seeds then
# differ in initialisation and sample order only, and their validation losses are of one text.
SPLIT = "data.split_seed=1234"


def best_rates() -> dict[str, float]:
    rates = {}
    for sweep, schemes in SWEEPS.items():
        path = ROOT / sweep / "finished" / "sweep.json"
        if not path.is_file():
            sys.exit(
                f"error: {path} is missing: finish that sweep first (EXPERIMENTS.md says how to resume it)"
            )
        best = json.loads(path.read_text())["best"]
        rates |= {s: best[s]["lr"] for s in schemes}
    return rates


def main() -> None:
    rates = best_rates()
    (HERE / "configs").mkdir(exist_ok=True)
    for scheme, seeds in SEEDS.items():
        lr = rates[scheme]
        for seed in seeds:
            base = f"configs/cpu-compare/{scheme}.yaml"
            cfg = to_dict(load_config(base, [*SCHEDULE, SPLIT, f"train.lr={lr:g}", f"train.seed={seed}"]))
            path = HERE / "configs" / f"{scheme}_s{seed}.yaml"
            header = (
                f"# {base} at its sweep's best lr {lr:g}, seed {seed}, linear decay to 0, the held-out "
                "novel of seed 1234 (make_configs.py)\n"
            )
            path.write_text(header + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
            load_config(str(path))  # what was written loads
            print(path)


if __name__ == "__main__":
    main()
