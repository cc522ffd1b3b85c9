"""Config loading: strict keys, types, named validators, layout rules, DeepSpeed JSON ownership."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaformer.config import ConfigError, RunConfig, load_config, validate_layout
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.schedule import lr_at

REPO = Path(__file__).resolve().parents[2]

REQUIRED_OVERRIDES = [
    "data.prefix=/tmp/x",
    "train.steps=40",
    "train.seed=7",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-4",
    "parallel.tp_size=1",
    "parallel.pp_size=1",
    "output.dir=/tmp/run",
]


def test_required_override_names_exist_and_apply():
    cfg = load_config("configs/normformer-quickstart.yaml", REQUIRED_OVERRIDES)
    assert cfg.data.prefix == "/tmp/x"
    assert (cfg.train.steps, cfg.train.seed, cfg.train.micro_batch_size) == (40, 7, 2)
    assert cfg.train.global_batch_size == 8
    assert cfg.train.lr == pytest.approx(3e-4)  # "3e-4" is a string to YAML 1.1; we read a number
    assert cfg.output.dir == "/tmp/run"


def test_quickstart_config_is_normformer():
    cfg = load_config("configs/normformer-quickstart.yaml")
    assert cfg.model.post_attn_ln and cfg.model.head_scale and cfg.model.ffn_ln
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.lrr=1e-3"], "unknown key 'train.lrr'. Did you mean 'lr'?"),
        (["trian.lr=1e-3"], "unknown section 'trian'"),
        (["train.steps=ten"], "train.steps=ten"),
        (["model.num_attention_heads=3"], "not divisible by model.num_attention_heads=3"),
        (["train.precision=fp8"], "train.precision='fp8'"),
        (["train.zero_stage=4"], "train.zero_stage=4"),
        (
            ["train.global_batch_size=10", "train.micro_batch_size=4"],
            "not divisible by train.micro_batch_size",
        ),
        (["train.warmup_steps=500", "train.steps=100"], "train.warmup_steps=500"),
        (["model.activation=swish"], "model.activation='swish'"),
        (["parallel.tp_size=3"], "not divisible by parallel.tp_size=3"),
        # invalid pipeline layouts (issue 5): refused before any process group exists
        (["parallel.pp_size=2", "train.zero_stage=2"], "train.zero_stage=2 with parallel.pp_size=2"),
        (["parallel.pp_size=2", "train.zero_stage=3"], "supports ZeRO stage 0 or 1 only"),
        (["parallel.pp_size=5"], "parallel.pp_size=5 stages for model.num_layers=4"),
        (["parallel.pp_size=0"], "parallel.pp_size=0: must be > 0"),
        (["parallel.partition_method=type:Block"], "parallel.partition_method='type:Block'"),
        (
            ["parallel.tp_size=4", "parallel.sequence_parallel=true", "model.seq_len=130"],
            "model.seq_len=130 tokens across parallel.tp_size=4",
        ),
        (["train.steps"], "expected section.key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config("configs/normformer-quickstart.yaml", overrides)
    assert needle in str(info.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n  num_heads: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert str(path) in message and "model.num_heads" in message and "num_attention_heads" in message


def test_malformed_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n   num_layers: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value) and "line" in str(info.value)


def test_global_batch_must_divide_by_micro_times_dp():
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=12"])
    assert validate_layout(cfg, 1) == 1
    with pytest.raises(ConfigError) as info:
        validate_layout(cfg, 2)  # 12 is not a multiple of 4 × 2
    assert "train.global_batch_size=12" in str(info.value) and "4 × 2 = 8" in str(info.value)


def test_deepspeed_config_derives_batch_sizes():
    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=16", "train.zero_stage=2"])
    ds = build_deepspeed_config(cfg, dp_size=2)
    assert ds["train_batch_size"] == 16
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize(
    "body",
    [
        {"train_batch_size": 32},
        {"train_micro_batch_size_per_gpu": 4},
        {"gradient_accumulation_steps": 2},
        {"optimizer": {"type": "Adam"}},
        {"zero_optimization": {"stage": 3}},
        {"bf16": {"enabled": True}},
    ],
)
def test_deepspeed_json_may_not_repeat_yaml_keys(tmp_path, body):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(body))
    cfg = load_config(None, [f"train.deepspeed_config={path}"])
    with pytest.raises(ConfigError) as info:
        build_deepspeed_config(cfg, 1)
    assert str(path) in str(info.value) and "remove it from the JSON" in str(info.value)


def test_deepspeed_json_syntax_error_names_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {,}\n}')
    cfg = load_config(None, [f"train.deepspeed_config={path}"])
    with pytest.raises(ConfigError) as info:
        build_deepspeed_config(cfg, 1)
    assert f"{path}:2:" in str(info.value)


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = load_config(
        None, ["train.steps=110", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr=1e-4"]
    )
    t = cfg.train
    assert lr_at(0, t) == pytest.approx(1e-4)
    assert lr_at(9, t) == pytest.approx(1e-3)
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(109, t) == pytest.approx(1e-4)
    mid = lr_at(10 + 99 // 2, t)
    assert 1e-4 < mid < 1e-3
    lrs = [lr_at(s, t) for s in range(10, 110)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))  # monotone decay


def test_pipeline_layouts_that_work_load():
    cfg = load_config(
        "configs/normformer-quickstart.yaml",
        [
            "parallel.pp_size=2",
            "parallel.tp_size=2",
            "train.zero_stage=1",
            "parallel.partition_method=uniform",
        ],
    )
    assert cfg.parallel.pp_size == 2 and cfg.parallel.partition_method == "uniform"
    # world size 6 is not a multiple of tp × pp = 4
    with pytest.raises(
        ConfigError, match=r"world size 6 is not divisible by parallel\.tp_size × parallel\.pp_size = 4"
    ):
        validate_layout(cfg, 6)
    assert validate_layout(cfg, 8) == 2


@pytest.mark.parametrize(
    ("path", "world", "expect"),
    [
        ("configs/normformer-1.3b-3d-v100.yaml", 16, {"pp": 2, "tp": 2, "zero": 1, "fp16": True}),
        ("configs/normformer-2.7b-3d-a100.yaml", 32, {"pp": 4, "tp": 2, "zero": 1, "bf16": True}),
        ("configs/normformer-350m-zero2.yaml", 8, {"pp": 1, "tp": 1, "zero": 2, "bf16": True}),
    ],
)
def test_recipes_load_and_build_their_deepspeed_config(path, world, expect):
    cfg = load_config(path)
    assert (cfg.parallel.pp_size, cfg.parallel.tp_size, cfg.train.zero_stage) == (
        expect["pp"], expect["tp"], expect["zero"],
    )  # fmt: skip
    dp = validate_layout(cfg, world)
    ds = build_deepspeed_config(cfg, dp)
    assert ds["zero_optimization"]["stage"] == expect["zero"]
    assert ds["fp16"]["enabled"] == expect.get("fp16", False) and ds["bf16"]["enabled"] == expect.get(
        "bf16", False
    )
    if expect.get("fp16"):
        assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert ds["gradient_accumulation_steps"] * cfg.train.micro_batch_size * dp == cfg.train.global_batch_size


def test_loading_a_config_imports_no_torch_and_nothing_else_of_the_project():
    """Config loading is pure: it reads the YAML. Checks that need files run in the preflight."""
    code = (
        "import sys, megaformer.config as c; "
        "c.load_config('configs/normformer-quickstart.yaml', ['train.init_from=/nonexistent']); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'deepspeed', "
        "'data_tools') or (m.startswith('megaformer.') and not m.startswith('megaformer.config'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
