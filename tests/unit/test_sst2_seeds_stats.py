"""The sixth SST-2 record's test (experiments/sst2-seeds/seeds.py) against scipy, and its
committed table reproduced from the committed predictions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "experiments" / "sst2-seeds"


def _seeds_module():
    spec = importlib.util.spec_from_file_location("sst2_seeds", RECORD / "seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the one-way t over seeds of equal per-seed differences is undefined (scipy warns, gives nan)
@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
def test_without_seed_variance_the_test_is_scipys_one_sample_t_over_sentences():
    """Every seed of an arm predicting alike leaves only the sentence term: the t test over the
    seed-averaged per-sentence differences (df n - 1), which scipy computes independently."""
    seeds = _seeds_module()
    rng = np.random.default_rng(0)
    a1, b1 = rng.random(500) < 0.7, rng.random(500) < 0.65
    a, b = np.tile(a1, (10, 1)), np.tile(b1, (10, 1))
    b[:, 0] = ~b[:, 0]  # the per-seed differences are all equal (variance 0)
    a[:, 0] = ~a[:, 0]
    r = seeds.compare(a, b)
    ref = stats.ttest_1samp(a1.astype(float) - b1.astype(float), 0.0)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert r["df"] == pytest.approx(499, rel=1e-9)
    ci = ref.confidence_interval(0.95)
    assert r["ci95"] == pytest.approx([ci.low, ci.high], rel=1e-9)


def test_the_combined_error_is_wider_than_either_one_way_view():
    seeds = _seeds_module()
    rng = np.random.default_rng(1)
    a = rng.random((10, 800)) < 0.70
    b = rng.random((10, 800)) < 0.66
    r = seeds.compare(a, b)
    width = r["ci95"][1] - r["ci95"][0]
    assert width > r["seeds_ci95"][1] - r["seeds_ci95"][0]
    assert width > r["sentences_ci95"][1] - r["sentences_ci95"][0]
    paired = stats.ttest_rel(a.mean(axis=1), b.mean(axis=1))
    assert r["seeds_t_p"] == pytest.approx(paired.pvalue, rel=1e-12)


def test_the_committed_table_is_what_the_committed_predictions_give(tmp_path, capsys):
    """seeds.md and seeds.json of the record, recomputed from its gzipped predictions."""
    seeds = _seeds_module()
    work = tmp_path / "record"
    for model in ("pre_ln", "normformer"):
        for run in filter(Path.is_dir, (RECORD / model).glob("ft-*-s*")):
            (work / model / run.name).mkdir(parents=True)
            (work / model / run.name / "sst-2.json.gz").write_bytes((run / "sst-2.json.gz").read_bytes())
    assert seeds.main([str(work)]) == 0
    assert capsys.readouterr().out == (RECORD / "seeds.md").read_text()
    assert json.loads((work / "seeds.json").read_text()) == json.loads((RECORD / "seeds.json").read_text())
