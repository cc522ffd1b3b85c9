"""YAML forms users write: YAML 1.1 exponent floats and data.blend as a list (issues 12 and 13)."""

from __future__ import annotations

import pytest

from megaformer.config import ConfigError, load_config


def _load(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(str(path))


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-3 as the string '3e-3'; it used to be refused as "expected float".
    cfg = _load(tmp_path, "train:\n  lr: 3e-3\n  min_lr: 1E-5\n  adam_eps: 1e-8\n")
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.adam_eps) == (3e-3, 1e-5, 1e-8)
    assert isinstance(cfg.train.lr, float)


def test_string_that_is_not_a_number_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lr: expected float, got 'fast'"):
        _load(tmp_path, "train:\n  lr: fast\n")


@pytest.mark.parametrize(
    "blend",
    [
        "\n    - 0.7 data/a_text_document\n    - 0.3 data/b_text_document",
        "\n    - [0.7, data/a_text_document]\n    - [0.3, data/b_text_document]",
        " [0.7, data/a_text_document, 0.3, data/b_text_document]",
        " '0.7 data/a_text_document 0.3 data/b_text_document'",
    ],
)
def test_blend_as_a_list(tmp_path, blend):
    cfg = _load(tmp_path, f"data:\n  blend:{blend}\n")
    assert cfg.data.blend == "0.7 data/a_text_document 0.3 data/b_text_document"


def test_blend_list_with_a_mapping_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.blend\[0\]: expected 'weight prefix'"):
        _load(tmp_path, "data:\n  blend:\n    - {weight: 0.7, prefix: data/a}\n")
