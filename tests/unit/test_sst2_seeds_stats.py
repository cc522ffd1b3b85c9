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
    a, b = np.tile(a1, (10, 1)), np.tile(b1, (10, 1))  # every seed alike: per-seed variance 0
    r = seeds.compare(a, b)
    ref = stats.ttest_1samp(a1.astype(float) - b1.astype(float), 0.0)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert r["df"] == pytest.approx(499, rel=1e-9)
    ci = ref.confidence_interval(0.95)
    assert r["ci95"] == pytest.approx([ci.low, ci.high], rel=1e-9)


def test_both_variance_terms_by_hand():
    """2 seeds × 3 sentences, worked by hand from the module docstring's formula: per-seed
    differences 1/3 and 2/3 (variance 1/18, over k = 2: 1/36), seed-averaged per-sentence
    differences 1, 0, 1/2 (variance 1/4, over n = 3: 1/12); SE² = 1/36 + 1/12 = 1/9, and
    Welch-Satterthwaite df = (1/9)² / ((1/36)²/1 + (1/12)²/2) = 32/11."""
    seeds = _seeds_module()
    a = np.array([[1, 1, 0], [1, 0, 1]], bool)
    b = np.array([[0, 1, 0], [0, 0, 0]], bool)
    r = seeds.compare(a, b)
    assert r["difference"] == pytest.approx(0.5) and r["se"] == pytest.approx(1 / 3)
    assert r["df"] == pytest.approx(32 / 11)
    assert r["p"] == pytest.approx(2 * stats.t.sf(1.5, 32 / 11))  # t = 0.5 / (1/3)
    half = stats.t.ppf(0.975, 32 / 11) / 3
    assert r["ci95"] == pytest.approx([0.5 - half, 0.5 + half])
    assert r["seeds_better"] == 2 and r["seeds_sd"] == pytest.approx(np.sqrt(1 / 18))


def test_holm_steps_down_and_keeps_the_order():
    holm = _seeds_module().holm
    assert holm({"x": 0.01, "y": 0.04}) == pytest.approx({"x": 0.02, "y": 0.04})
    assert holm({"x": 0.03, "y": 0.02}) == pytest.approx({"x": 0.04, "y": 0.04})  # at least the one before
    assert holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}  # capped at 1


def test_the_combined_error_is_wider_than_either_one_way_view():
    seeds = _seeds_module()
    rng = np.random.default_rng(1)
    a = rng.random((10, 800)) < 0.70
    b = rng.random((10, 800)) < 0.66
    r = seeds.compare(a, b)
    width = r["ci95"][1] - r["ci95"][0]
    assert width > r["seeds_ci95"][1] - r["seeds_ci95"][0]
    assert width > r["sentences_ci95"][1] - r["sentences_ci95"][0]
    # the seeds-only view by hand: a one-sample t over the per-seed differences
    per_seed = a.mean(axis=1) - b.mean(axis=1)
    t = per_seed.mean() / (per_seed.std(ddof=1) / np.sqrt(10))
    assert r["seeds_t_p"] == pytest.approx(2 * stats.t.sf(abs(t), 9), rel=1e-9)


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


def test_the_committed_interaction_table_is_what_the_committed_predictions_give(capsys):
    """The post-hoc check of EXPERIMENTS.md ("Found after the result"), recomputed; and on an
    additive table (no interaction) its unbiased SE is the pre-registered one."""
    spec = importlib.util.spec_from_file_location("sst2_interaction", RECORD / "interaction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(RECORD)]) == 0
    assert capsys.readouterr().out == (RECORD / "interaction.md").read_text()
    x = np.add.outer([0.1, 0.3, 0.2], [0.0, 1.0, -1.0, 0.5])  # seeds × sentences, additive
    r = module.unbiased(x)
    assert r["interaction_share"] == pytest.approx(0.0, abs=1e-12) and r["se_ratio"] == pytest.approx(1.0)


def test_a_truncated_prediction_file_is_named_with_the_fix(tmp_path):
    path = tmp_path / "sst-2.json"
    path.write_text('{"test": {"lab')
    with pytest.raises(SystemExit, match=r"sst-2\.json: not a finished fine-tuning's .*delete it"):
        _seeds_module().correct(path)
