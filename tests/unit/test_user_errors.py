"""Errors at the edges a new user meets (issue 23, item 5): each names the value and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from data_tools.errors import OutputError
from data_tools.indexed_dataset import dataset_prefix
from data_tools.preprocess import check_output_prefix
from megaformer.config import ConfigError
from megaformer.config.load import load_config

REPO = Path(__file__).resolve().parents[2]


def test_a_prefix_under_an_existing_file_is_refused_with_the_file(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "file.jsonl").write_text("{}\n")
    with pytest.raises(OutputError, match=r"file\.jsonl is a file, not a directory"):
        check_output_prefix(str(raw / "file.jsonl" / "x"))


def test_a_prefix_ending_in_a_slash_is_refused_instead_of_writing_hidden_files(tmp_path):
    out = tmp_path / "processed"
    out.mkdir()
    with pytest.raises(OutputError, match=r"names a directory.*_text_document.*--output-prefix .*/corpus"):
        check_output_prefix(f"{out}/")
    check_output_prefix(str(out / "corpus"))  # a name inside it is fine
    check_output_prefix(str(out))  # a directory's name: processed_text_document.* beside it, fine
    check_output_prefix(str(tmp_path / "new" / "dir" / "corpus"))  # directories still to be made too


def test_preprocess_command_prints_one_error_line_for_a_directory_prefix(tmp_path):
    cmd = [
        sys.executable, "-m", "data_tools.preprocess", "--input", str(REPO / "data" / "tinyshakespeare"),
        "--output-prefix", f"{tmp_path}/", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
        "--merge-file", str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "names a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_dataset_paths_are_accepted_with_their_suffix():
    assert dataset_prefix("data/x_text_document.bin") == "data/x_text_document"
    assert dataset_prefix("data/x_text_document.idx") == "data/x_text_document"
    assert dataset_prefix("data/x_text_document") == "data/x_text_document"


def test_warmup_longer_than_the_run_names_both_values():
    with pytest.raises(ConfigError, match=r"train.warmup_steps=30: must lie in \[0, train.steps=2\]"):
        load_config("configs/cpu-compare/pre_ln.yaml", ["train.steps=2"])


def test_pretrain_sh_says_a_config_error_once_before_any_worker_starts(tmp_path):
    """A typo'd key: one error line from the launch script, exit 2, and no launcher or worker
    output (before, every rank printed it among DeepSpeed's INFO lines after ~5 s)."""
    import os

    env = dict(os.environ, NPROC_PER_NODE="2")
    proc = subprocess.run(
        ["bash", "launch/pretrain.sh", "configs/normformer-quickstart.yaml", "model.hiden_size=64",
         f"output.dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("unknown key 'model.hiden_size'. Did you mean 'hidden_size'?") == 1
    assert "[pretrain.sh]" not in proc.stderr and "launch.py" not in proc.stderr and proc.stdout == ""
    assert not list(tmp_path.iterdir())


def test_split_seed_defaults_to_the_training_seed_and_refuses_below_minus_one():
    cfg = load_config("configs/normformer-quickstart.yaml", ["train.seed=4321"])
    assert cfg.data.split_seed == -1 and cfg.split_seed == 4321
    cfg = load_config("configs/normformer-quickstart.yaml", ["train.seed=4321", "data.split_seed=1234"])
    assert cfg.split_seed == 1234
    with pytest.raises(ConfigError, match=r"data.split_seed=-2: must be >= 0, or -1 to take train.seed"):
        load_config("configs/normformer-quickstart.yaml", ["data.split_seed=-2"])


def test_valid_fraction_zero_is_allowed_where_it_is_not_used_and_explained_where_it_is():
    cfg = load_config(
        "configs/normformer-quickstart.yaml",
        ["data.valid_prefix=/data/heldout_text_document", "data.valid_fraction=0"],
    )
    assert cfg.data.valid_fraction == 0.0
    with pytest.raises(ConfigError, match=r"must lie in \(0, 1\): the share .*or give data.valid_prefix"):
        load_config("configs/normformer-quickstart.yaml", ["data.valid_fraction=0"])
