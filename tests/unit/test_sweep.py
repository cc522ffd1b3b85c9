"""The sweep's grid order, its table (a diverged cell is never best) and its best configs."""

from __future__ import annotations

import math

from megaformer.config.load import load_config
from megaformer.experiments.sweep import cell_name, cell_overrides, results_table, schedule, write_best_config

CONFIG = "configs/cpu-compare/pre_ln.yaml"


def test_cells_are_interleaved_across_schemes():
    order = schedule(["pre_ln", "normformer"], [1e-3, 3e-3], [None], [1, 2], seed=0)
    assert len(order) == 8 and len(set(order)) == 8
    for i in range(0, 8, 2):  # each grid point runs every scheme back to back
        assert {order[i][0], order[i + 1][0]} == {"pre_ln", "normformer"}
        assert order[i][1:] == order[i + 1][1:]
    firsts = [order[i][0] for i in range(0, 8, 2)]
    assert firsts.count("pre_ln") == 2  # the scheme that goes first alternates
    assert schedule(["a", "b"], [1e-3, 3e-3], [None], [1], seed=5) == schedule(
        ["a", "b"], [1e-3, 3e-3], [None], [1], seed=5
    )


def test_cell_names_and_overrides():
    assert cell_name(3e-3, None, 1234) == "lr0.003-seed1234"
    assert cell_name(1e-3, 30, 7) == "lr0.001-wu30-seed7"
    assert cell_overrides(1e-3, 30, 7) == ["train.lr=0.001", "train.seed=7", "train.warmup_steps=30"]


def _cell(scheme, lr, seed, loss):
    return {"scheme": scheme, "lr": lr, "warmup": None, "seed": seed, "final_valid_loss": loss, "steps": 100}


def test_best_rate_is_the_lowest_mean_and_never_a_diverged_cell():
    cells = [
        _cell("a", 1e-3, 1, 5.0), _cell("a", 1e-3, 2, 5.2),
        _cell("a", 3e-3, 1, 4.8), _cell("a", 3e-3, 2, 4.9),
        _cell("a", 1e-2, 1, 4.0), _cell("a", 1e-2, 2, math.inf),  # one seed diverged
    ]  # fmt: skip
    rows, best = results_table(cells, ["a"])
    assert [r["lr"] for r in rows] == [1e-3, 3e-3, 1e-2]
    assert best["a"]["lr"] == 3e-3 and math.isclose(best["a"]["mean"], 4.85)
    assert math.isinf(rows[2]["mean"]) and rows[2]["final_valid_losses"] == [4.0, None]
    assert math.isclose(rows[0]["std"], math.sqrt(0.02))


def test_best_config_is_written_resolved_and_loads(tmp_path):
    row = {"lr": 1e-3, "warmup": 40, "mean": 4.5}
    path = tmp_path / "best" / "pre_ln.yaml"
    write_best_config(CONFIG, ["data.prefix=/data/x_text_document", "train.seed=7"], row, path)
    cfg = load_config(str(path))
    assert cfg.train.lr == 1e-3 and cfg.train.warmup_steps == 40 and cfg.train.seed == 7
    assert cfg.data.prefix == "/data/x_text_document" and cfg.model.norm_scheme == "pre_ln"
    assert path.read_text().startswith("# configs/cpu-compare/pre_ln.yaml at the sweep's best learning rate")
