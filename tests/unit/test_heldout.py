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
