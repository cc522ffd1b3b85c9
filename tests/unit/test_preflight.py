"""The preflight: what needs files or the world size is refused before any process group starts,
with a message that names the file or key and the fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_tools.errors import DataFormatError
from data_tools.indexed_dataset import IndexedDatasetWriter
from data_tools.stats import compute_stats, stats_path, write_stats
from megaformer.config import ConfigError, load_config
from megaformer.training.ds_adapter import check_deepspeed_version
from megaformer.training.preflight import check_checkpoint, run_preflight

EOD = 50256


def _dataset(prefix, docs: list[list[int]], *, eod: int | None = EOD, sidecar: bool = True) -> str:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in docs:
            w.add_document(np.asarray(doc, dtype=np.uint16))
    if sidecar:
        write_stats(prefix, compute_stats(prefix, eod_token=eod))
    return str(prefix)


def _docs(n: int = 40, max_id: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[*rng.integers(0, max_id, size=50).tolist(), EOD] for _ in range(n)]


def _cfg(prefix: str, *extra: str):
    # Short samples and one evaluation batch, so that the 2 held-out documents of _docs() (102
    # tokens) hold an evaluation (16 samples of 5 tokens) and pass the held-out check.
    small_eval = ["model.seq_len=4", "train.eval_batches=1"]
    return load_config("configs/normformer-quickstart.yaml", [f"data.prefix={prefix}", *small_eval, *extra])


def test_a_good_dataset_passes_and_its_statistics_come_back(tmp_path):
    prefix = _dataset(tmp_path / "good", _docs())
    result = run_preflight(_cfg(prefix), world_size=2)
    assert result.dp_size == 2 and result.datasets == [(1.0, prefix)]
    assert result.stats[0].max_token_id == EOD and result.stats[0].num_documents == 40


def test_missing_prefix_names_it_and_the_command(tmp_path):
    with pytest.raises(DataFormatError, match=r"data.prefix=.*nothere.*data_tools.preprocess"):
        run_preflight(_cfg(str(tmp_path / "nothere")), world_size=1)


def test_corrupt_index_is_refused(tmp_path):
    prefix = _dataset(tmp_path / "corrupt", _docs())
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(DataFormatError, match=r"corrupt\.idx"):
        run_preflight(_cfg(prefix), world_size=1)


def test_ids_beyond_the_vocabulary_name_the_largest_id_and_the_fix(tmp_path):
    docs = _docs()
    docs[7][3] = 60000  # a vocabulary of 60k tokens, a model of 50,257
    prefix = _dataset(tmp_path / "bigvocab", docs)
    with pytest.raises(DataFormatError) as info:
        run_preflight(_cfg(prefix), world_size=1)
    message = str(info.value)
    assert "60000" in message and "model.vocab_size=50257" in message and "retokenize" in message
    assert prefix in message


def test_a_dataset_without_sidecar_is_refused_with_the_command_that_adds_it(tmp_path):
    prefix = _dataset(tmp_path / "old", _docs(), sidecar=False)
    with pytest.raises(DataFormatError) as info:
        run_preflight(_cfg(prefix), world_size=1)
    assert stats_path(prefix) in str(info.value) and "python -m data_tools.stats" in str(info.value)


def test_documents_not_ended_by_eod_are_refused(tmp_path):
    docs = _docs()
    docs[3] = docs[3][:-1]  # one document lost its EOD
    prefix = _dataset(tmp_path / "noeod", docs)
    with pytest.raises(DataFormatError, match=r"not all ended by data.eod_token=50256"):
        run_preflight(_cfg(prefix), world_size=1)
    prefix = _dataset(tmp_path / "othereod", _docs(), eod=0)
    with pytest.raises(DataFormatError, match=r"set data.eod_token=0"):
        run_preflight(_cfg(prefix), world_size=1)


def test_a_bad_blend_names_the_item(tmp_path):
    prefix = _dataset(tmp_path / "a", _docs())
    with pytest.raises(ConfigError, match=r"expected a number before prefix"):
        run_preflight(_cfg(prefix, f"data.blend=x {prefix} 0.5 {prefix}"), world_size=1)


def test_layout_and_engine_json_and_backend(tmp_path):
    prefix = _dataset(tmp_path / "a", _docs())
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible"):
        run_preflight(_cfg(prefix, "parallel.tp_size=2"), world_size=3)
    with pytest.raises(ConfigError, match=r"/nonexistent.json"):
        run_preflight(_cfg(prefix, "train.deepspeed_config=/nonexistent.json"), world_size=1)
    with pytest.raises(ConfigError, match=r"parallel.backend=nccl: this machine has no CUDA"):
        run_preflight(_cfg(prefix, "parallel.backend=nccl"), world_size=1)
    # Where DeepSpeed's CPU accelerator has no fp16 (most CPUs), refused here, not inside
    # deepspeed.initialize; a CPU with AVX512-FP16 / AMX (Sapphire Rapids) has it, and fp16 passes.
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        run_preflight(_cfg(prefix, "train.precision=fp16"), world_size=1)
    else:
        with pytest.raises(ConfigError, match=r"train.precision=fp16"):
            run_preflight(_cfg(prefix, "train.precision=fp16"), world_size=1)


def test_deepspeed_version_is_pinned():
    assert check_deepspeed_version().startswith("0.19.")
    with pytest.raises(ConfigError, match=r"deepspeed 0\.20\.1 is installed.*pip install"):
        check_deepspeed_version("0.20.1")


def _checkpoint(root, tag: str = "global_step5"):
    import torch

    tag_dir = root / "checkpoints" / tag
    (tag_dir / "rng_state").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(4)}}, tag_dir / "mp_rank_00_model_states.pt")
    torch.save({"x": 1}, tag_dir / "rng_state" / "rank00000.pt")
    (root / "checkpoints" / "latest").write_text(tag)
    return root / "checkpoints", tag_dir


def test_checkpoints_are_checked_before_the_run(tmp_path):
    ckpt, tag_dir = _checkpoint(tmp_path)
    assert check_checkpoint(str(ckpt), "train.init_from") == str(tag_dir)
    prefix = _dataset(tmp_path / "a", _docs())
    with pytest.raises(ConfigError, match=r"train.init_from='/nonexistent/ckpt'"):
        run_preflight(_cfg(prefix, "train.init_from=/nonexistent/ckpt"), world_size=1)
    (ckpt / "latest").write_text("global_step9")  # dangling
    with pytest.raises(ConfigError, match=r"names 'global_step9', which is not a directory"):
        check_checkpoint(str(ckpt), "train.resume")
    (ckpt / "latest").write_text("global_step5")
    state = tag_dir / "rng_state" / "rank00000.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    with pytest.raises(ConfigError, match=r"rank00000\.pt is truncated or damaged"):
        run_preflight(_cfg(prefix, f"train.resume={ckpt}"), world_size=1)
