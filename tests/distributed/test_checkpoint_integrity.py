"""Damaged checkpoints end in a clear error naming the file and the newest intact global_stepN.

One 2-process run writes global_step8 and global_step12 (with manifests); each case damages a copy
and checks resume / init_from (the preflight and the ranks' sha256 check), ``reshard`` and
``generate``: an error that names the file and suggests global_step8, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megaformer.training import ckpt_integrity as integrity
from megaformer.training.preflight import check_checkpoint
from tests.distributed.conftest import LIFECYCLE_TINY, run_pretrain

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
SUGGESTION = "newest intact checkpoint beside it is {}"


@pytest.fixture(scope="module")
def run12(lifecycle_reference):
    """global_step8 and global_step12 of the shared 12-step run (retention kept two)."""
    return lifecycle_reference


def _copy(run12, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run12 / "checkpoints", dst / "checkpoints")
    return dst / "checkpoints"


def _zeros(path, offset=4096, length=4096):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * length)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _damage(ckpt, case):
    """Apply one damage of the issue's list to the checkpoint `latest` names (global_step12)."""
    tag = ckpt / "global_step12"
    if case == "zeros":
        _zeros(tag / "mp_rank_00_model_states.pt")
        return "mp_rank_00_model_states.pt"
    if case == "truncated":
        _truncate(tag / "mp_rank_00_model_states.pt")
        return "mp_rank_00_model_states.pt"
    if case == "deleted":
        os.remove(tag / "rng_state" / "rank00001.pt")
        return "rank00001.pt"
    if case == "optimizer_truncated":
        _truncate(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        return "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if case == "empty_latest":
        (ckpt / "latest").write_text("")
        return "latest"
    if case == "dangling_latest":
        (ckpt / "latest").write_text("global_step9")
        return "global_step9"
    raise AssertionError(case)


CASES = ["zeros", "truncated", "deleted", "optimizer_truncated", "empty_latest", "dangling_latest"]


def test_manifest_lists_every_file_and_latest_moves_last(run12):
    ckpt = run12 / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step12"
    # train.keep_last_checkpoints=2: global_step4 deleted, never the one `latest` names
    assert [tag for _, tag in integrity.step_dirs(str(ckpt))] == ["global_step12", "global_step8"]
    for tag in ("global_step8", "global_step12"):
        body = json.loads((ckpt / tag / "manifest.json").read_text())
        assert sorted(body["files"]) == integrity.checkpoint_files(str(ckpt / tag))
        assert "rng_state/rank00001.pt" in body["files"]
        assert integrity.verify(str(ckpt / tag)) is True


@pytest.mark.parametrize("case", CASES)
def test_damage_is_named_with_the_way_out(run12, tmp_path, case, capsys):
    """Preflight (resume / init_from), the full check, reshard, generate and export_hf: each names
    the file."""
    from megaformer.tools import export_hf, generate, reshard

    ckpt = _copy(run12, tmp_path)
    name = _damage(ckpt, case)
    # a bad `latest` leaves global_step12 whole; a damaged global_step12 leaves global_step8
    way_out = SUGGESTION.format("global_step12" if case.endswith("latest") else "global_step8")
    with pytest.raises(integrity.CheckpointError) as err:
        check_checkpoint(str(ckpt), "train.resume")  # resume=auto / init_from go through it
        integrity.verify(integrity.resolve_latest(str(ckpt)))  # the digests (the ranks share it)
    assert name in str(err.value) and way_out in str(err.value), err.value
    assert reshard.main(["--input", str(ckpt), "--output", str(tmp_path / "out"), "--tp", "1"]) == 2
    assert generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "2"]) == 2
    assert export_hf.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count(way_out) == 3 and name in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out" / "latest").exists()


def test_zeroed_block_stops_resume_and_init_from_before_the_model(run12, tmp_path, gutenberg_prefix):
    """4 KiB of zeros at the same size: zip structure and size intact, only the sha256 tells."""
    ckpt = _copy(run12, tmp_path)
    _damage(ckpt, "zeros")
    common = [*LIFECYCLE_TINY, f"data.prefix={gutenberg_prefix}"]
    resumed = run_pretrain(CONFIG, [*common, "train.resume=auto", f"output.dir={ckpt.parent}"])
    started = run_pretrain(
        CONFIG, [*common, "train.steps=16", f"train.init_from={ckpt}", f"output.dir={tmp_path / 'new'}"]
    )
    for proc in (resumed, started):
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "mp_rank_00_model_states.pt: sha256 differs" in proc.stderr
        assert SUGGESTION.format("global_step8") in proc.stderr
        assert "Traceback" not in proc.stderr and "step 13/" not in proc.stdout
