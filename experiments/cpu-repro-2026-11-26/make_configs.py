"""Write the final runs' configs: each scheme at its learning rate from the sweep
(experiments/lr-sweep-2026-11-26), the sweep's schedule (linear decay to 0), one file per seed.

    .venv/bin/python experiments/cpu-repro-2026-11-26/make_configs.py

Learning rates: Pre-LN 3e-3 and NormFormer (+ ResScale) 9e-3 are the sweep's bracketed best rates.
Post-LN and DeepNorm learned nothing at any rate in the sweep's 260 steps, so the sweep does not
rank their rates; they keep 1e-3, the rate at which the earlier 0.67 device-hour runs left the
unigram plateau (EXPERIMENTS.md).
"""

from pathlib import Path

import yaml

from megaformer.config.load import load_config, to_dict

HERE = Path(__file__).resolve().parent
RUNS = {  # scheme: (learning rate, seeds)
    "pre_ln": (3e-3, (1234, 5678, 4321)),
    "normformer": (9e-3, (1234, 5678, 4321)),
    "normformer_resscale": (9e-3, (1234, 5678, 4321)),
    "post_ln": (1e-3, (1234,)),
    "deepnorm": (1e-3, (1234,)),
}
SWEEP = ["data.prefix=data/processed/gutenberg_text_document", "train.min_lr=0", "train.lr_decay=linear"]

for scheme, (lr, seeds) in RUNS.items():
    for seed in seeds:
        base = f"configs/cpu-compare/{scheme}.yaml"
        cfg = to_dict(load_config(base, [*SWEEP, f"train.lr={lr:g}", f"train.seed={seed}"]))
        path = HERE / "configs" / f"{scheme}_s{seed}.yaml"
        header = f"# {base} at lr {lr:g}, seed {seed}, linear decay to 0 (make_configs.py)\n"
        path.write_text(header + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        load_config(str(path))  # what was written loads
        print(path)
