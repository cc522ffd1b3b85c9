"""data.split (Megatron's --split) parsing and ranges, and the config rules of the held-out options.
The training runs that use them are in tests/distributed/test_export_hf_launch.py."""

from __future__ import annotations

import pytest

from megaformer.config import ConfigError, load_config
from megaformer.config.load import parse_split
from megaformer.data.heldout import split_ranges

CONFIG = "configs/normformer-quickstart.yaml"


def _sizes(n: int, spec: str) -> list[int]:
    ranges = split_ranges(n, parse_split(spec))
    assert [int(r[0]) for r in ranges if len(r)] == sorted(int(r[0]) for r in ranges if len(r))  # in order
    return [len(r) for r in ranges]


def test_split_ranges_follow_megatrons_rounding():
    # Megatron's get_train_valid_test_split_: boundaries accumulate round(share * n); the excess over
    # n comes off every boundary after the first (worked by hand from its formula).
    assert _sizes(1000, "969,30,1") == [969, 30, 1]
    assert _sizes(10, "90,8,2") == [9, 1, 0]  # 0.2 documents round to none
    assert _sizes(7, "1,1,1") == [3, 2, 2]  # 2 + 2 + 2 = 6: one short, every boundary moves up
    assert _sizes(5, "1,1,1") == [1, 2, 2]  # 2 + 2 + 2 = 6: one over, every boundary moves down
    assert _sizes(100, "969/30/1") == [97, 3, 0]  # the older "/" separator
    assert _sizes(10, "8,2") == [8, 2, 0]  # missing shares are 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a,b", "not numbers"),
        ("1,-1,0", "up to three shares"),
        ("0,0,0", "up to three shares"),
        ("1,2,3,4", "up"),
    ],
)
def test_bad_split_is_refused_with_its_value(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_split(spec)
    with pytest.raises(ConfigError, match=r"data\.split"):
        load_config(CONFIG, [f"data.split={spec}"])


def test_split_does_not_combine_with_another_held_out_choice():
    with pytest.raises(ConfigError, match="does not combine with"):
        load_config(CONFIG, ["data.split=969,30,1", "data.valid_prefix=data/x_text_document"])
    with pytest.raises(ConfigError, match="train and validation shares must be > 0"):
        load_config(CONFIG, ["data.split=100,0,1"])
    cfg = load_config(CONFIG, ["data.split=969,30,1", "data.test_prefix="])
    assert cfg.data.split == "969,30,1"


def test_held_out_prefixes_are_checked_before_training_and_read_in_order(tmp_path):
    import numpy as np

    from data_tools.indexed_dataset import DataFormatError
    from megaformer.data.heldout import build_heldout_data
    from megaformer.training.preflight import run_preflight
    from tests.unit.test_preflight import _dataset, _docs

    train = _dataset(tmp_path / "train", _docs(40))
    valid = _dataset(tmp_path / "valid", _docs(10, max_id=500))
    overrides = [f"data.prefix={train}", "model.seq_len=32"]
    with pytest.raises(DataFormatError, match=r"data.valid_prefix=.*nothere.*not found"):
        run_preflight(
            load_config(CONFIG, [*overrides, f"data.valid_prefix={tmp_path / 'nothere'}"]), world_size=1
        )
    bad = _dataset(tmp_path / "bad", _docs(5), eod=None)
    with pytest.raises(DataFormatError, match=r"not all ended by data\.eod_token"):
        run_preflight(load_config(CONFIG, [*overrides, f"data.test_prefix={bad}"]), world_size=1)

    tr, va, te, info = build_heldout_data(
        pairs=[(1.0, train)], split="", valid_prefix=valid, test_prefix="", seq_len=32,
        train_samples=8, eval_samples=4, seed=1, cache_dir=None,
    )  # fmt: skip
    stream = np.concatenate(_docs(10, max_id=500))  # the validation documents, in order
    for i in range(4):  # consecutive samples share one token
        assert np.array_equal(va[i], stream[32 * i : 32 * i + 33])
    assert te is None and info["train_documents"] == 40 and info["valid_documents"] == 10
    assert len(tr) == 8


def test_held_out_runs_count_the_sample_indices_they_build_and_find(tmp_path):
    """With data.valid_prefix the log said "0 hit, 0 built" whatever happened (the counts were reset
    after the training indices were built), then "1 built" (the validation index was not counted):
    the first build counts the training and the validation index built, the second both found."""
    from megaformer.data.heldout import build_heldout_data
    from tests.unit.test_preflight import _dataset, _docs

    train = _dataset(tmp_path / "train", _docs(40))
    valid = _dataset(tmp_path / "valid", _docs(10, max_id=500))
    kwargs = dict(
        pairs=[(1.0, train)], split="", valid_prefix=valid, test_prefix="", seq_len=32,
        train_samples=8, eval_samples=4, seed=1, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    info = build_heldout_data(**kwargs)[3]
    assert (info["index_cache_hits"], info["index_cache_builds"]) == (0, 2)
    assert len(list((tmp_path / "cache").glob("*_doc_idx.npy"))) == 2  # what was built, on disk
    info = build_heldout_data(**kwargs)[3]
    assert (info["index_cache_hits"], info["index_cache_builds"]) == (2, 0)


def test_the_whole_validation_set_of_a_valid_prefix_or_a_split(tmp_path):
    """train.final_eval_batches=0 with data.valid_prefix or data.split: every sample the validation
    set holds, in order, its first ones those the regular validations read (it was refused by the
    config, after a comparison's calibration had run)."""
    import numpy as np

    from megaformer.data.gpt_dataset import WHOLE_HELDOUT
    from megaformer.data.heldout import build_heldout_data
    from tests.unit.test_preflight import _dataset, _docs

    train = _dataset(tmp_path / "train", _docs(40))
    valid = _dataset(tmp_path / "valid", _docs(10, max_id=500))
    common = dict(pairs=[(1.0, train)], test_prefix="", seq_len=32, train_samples=8, seed=1, cache_dir=None)
    _, sampled, _, info = build_heldout_data(split="", valid_prefix=valid, eval_samples=4, **common)
    _, whole, _, _ = build_heldout_data(split="", valid_prefix=valid, eval_samples=WHOLE_HELDOUT, **common)
    assert len(whole) == (info["valid_tokens"] - 1) // 32 > len(sampled) == 4
    assert all(np.array_equal(whole[i], sampled[i]) for i in range(4))
    stream = np.concatenate(_docs(10, max_id=500))
    assert np.array_equal(whole[len(whole) - 1], stream[32 * (len(whole) - 1) : 32 * len(whole) + 1])
    # data.split's validation range: the same rule
    _, split_whole, _, split_info = build_heldout_data(
        split="80,20,0", valid_prefix="", eval_samples=WHOLE_HELDOUT, **common
    )
    assert len(split_whole) == (split_info["valid_tokens"] - 1) // 32
    cfg = load_config(CONFIG, [f"data.valid_prefix={valid}", "train.final_eval_batches=0"])
    assert cfg.train.final_eval_batches == 0
