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


# --- base: a config built on another ---------------------------------------------------------------


def test_a_config_builds_on_its_base_key_by_key(tmp_path):
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "root.yaml").write_text(
        "model:\n  hidden_size: 96\n  num_layers: 6\ntrain:\n  lr: 0.002\n"
    )
    (tmp_path / "mid.yaml").write_text("base: shapes/root.yaml\nmodel:\n  num_layers: 3\n")
    (tmp_path / "leaf.yaml").write_text("base: mid.yaml\nmodel:\n  ffn_ln: false\n")
    cfg = load_config(str(tmp_path / "leaf.yaml"), ["train.lr=0.001"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.ffn_ln) == (96, 3, False)
    assert cfg.train.lr == 0.001  # the overrides come last


def test_a_value_of_the_wrong_type_in_a_base_names_that_file(tmp_path):
    (tmp_path / "root.yaml").write_text("model:\n  num_layers: many\n")
    (tmp_path / "leaf.yaml").write_text("base: root.yaml\n")
    with pytest.raises(ConfigError, match=r"root\.yaml.*num_layers"):
        load_config(str(tmp_path / "leaf.yaml"))


def test_a_missing_or_circular_base_is_refused_with_the_chain(tmp_path):
    (tmp_path / "a.yaml").write_text("base: nothere.yaml\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: base 'nothere\.yaml': .*nothere\.yaml not found"):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "b.yaml").write_text("base: c.yaml\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(
        ConfigError, match=r"leads back to a file of the chain \(.*b\.yaml -> .*c\.yaml -> .*b\.yaml\)"
    ):
        load_config(str(tmp_path / "b.yaml"))
    (tmp_path / "d.yaml").write_text("base: [x]\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: base=\['x'\]"):
        load_config(str(tmp_path / "d.yaml"))
