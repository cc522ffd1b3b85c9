"""Damaged checkpoints end in a clear error naming the file and the newest intact global_stepN.

One 2-process run writes global_step8 and global_step12 (with manifests); each case damages a copy
and checks resume / init_from (the preflight and the ranks' sha256 check), ``reshard`` and
``generate``: an error that names the file and suggests global_step8, never a traceback. A damaged
file a reader does not read (a ZeRO optimizer file or a generator state, for the tools that need
only the weights; a deleted generator state, for a resume) is named in a warning instead.

The run trains on the small-vocabulary novels (``small_vocab_prefix`` with ``SMALL_VOCAB``; the
subject is the checkpoint, not the GPT-2 vocabulary): ``generate`` and ``export_hf`` are given that
run's tokenizer, as a user of such a run would.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megaformer.checkpoint import integrity
from megaformer.training.preflight import check_checkpoint
from tests.distributed.conftest import LIFECYCLE_TINY, SMALL_BPE, SMALL_VOCAB, run_pretrain, run_ranks

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
SUGGESTION = "newest intact checkpoint beside it is {}"
GENERATE_TOKENIZER = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(SMALL_BPE)]
"""generate's flags for the run's tokenizer (the small BPE the data was preprocessed with)."""


@pytest.fixture(scope="module")
def run12(lifecycle_reference_small_vocab):
    """global_step8 and global_step12 of the shared 12-step run (retention kept two)."""
    return lifecycle_reference_small_vocab


@pytest.fixture(scope="module")
def export_tokenizer(tmp_path_factory) -> list[str]:
    """export_hf's --vocab-file / --merge-file for the run's tokenizer: the small BPE's
    ``tokenizer.json`` vocabulary and merges written as GPT-2's ``vocab.json`` and ``merges.txt``
    (the same byte-level BPE, in the files export_hf copies)."""
    body = json.loads((SMALL_BPE / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    out = tmp_path_factory.mktemp("novels_bpe500")
    (out / "vocab.json").write_text(json.dumps(body["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in body["merges"]]
    (out / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n", encoding="utf-8")
    return ["--vocab-file", str(out / "vocab.json"), "--merge-file", str(out / "merges.txt")]


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
    if case == "rng0_deleted":
        os.remove(tag / "rng_state" / "rank00000.pt")
        return "rank00000.pt"
    if case == "rng_truncated":
        _truncate(tag / "rng_state" / "rank00001.pt")
        return "rank00001.pt"
    if case == "optimizer_deleted":
        os.remove(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        return "zero_pp_rank_0_mp_rank_00_optim_states.pt"
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


CASES = ["zeros", "truncated", "empty_latest", "dangling_latest"]
"""Damage every reader refuses: a weights file, or the `latest` tag."""
NOT_WEIGHTS = ["deleted", "rng_truncated", "optimizer_truncated", "optimizer_deleted"]
"""Damage the tools that need only the weights warn about and work past."""
WEIGHTS_NOTE = "not needed to read the weights, ignored"


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


@pytest.mark.parametrize("case", [*CASES, "optimizer_truncated", "rng_truncated"])
def test_damage_is_named_with_the_way_out(run12, export_tokenizer, tmp_path, case, capsys):
    """Preflight (resume / init_from), the full check, reshard, generate and export_hf: each names
    the file."""
    from megaformer.tools import export_hf, generate, reshard

    ckpt = _copy(run12, tmp_path)
    name = _damage(ckpt, case)
    # a bad `latest` leaves global_step12 whole; a damaged global_step12 leaves global_step8
    way_out = SUGGESTION.format("global_step12" if case.endswith("latest") else "global_step8")
    with pytest.raises(integrity.CheckpointError) as err:
        check_checkpoint(str(ckpt), "train.resume", integrity.NEEDS_RESUME)  # resume=auto goes through it
        integrity.verify(integrity.resolve_latest(str(ckpt)))  # the digests (the ranks share it)
    assert name in str(err.value) and way_out in str(err.value), err.value
    if case in NOT_WEIGHTS:
        if case == "rng_truncated":  # a damaged generator state: the way to resume without it
            assert "or delete it to resume with that rank's dropout masks restarting" in str(err.value)
        return  # the tools read only the weights: test_tools_that_need_only_the_weights_warn
    with pytest.raises(integrity.CheckpointError):  # init_from: the weights are needed
        check_checkpoint(str(ckpt), "train.init_from", integrity.NEEDS_WEIGHTS)
        integrity.verify(integrity.resolve_latest(str(ckpt)), needs=integrity.NEEDS_WEIGHTS)
    assert reshard.main(["--input", str(ckpt), "--output", str(tmp_path / "out"), "--tp", "1"]) == 2
    assert generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "2", *GENERATE_TOKENIZER]) == 2
    assert (
        export_hf.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), *export_tokenizer]) == 2
    )
    stderr = capsys.readouterr().err
    assert stderr.count(way_out) == 3 and name in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out" / "latest").exists()


@pytest.mark.parametrize("case", NOT_WEIGHTS)
def test_tools_that_need_only_the_weights_warn_and_work(run12, export_tokenizer, tmp_path, case, capsys):
    """A truncated or deleted ZeRO optimizer file or generator state of the newest checkpoint:
    reshard, generate, export_hf and init_from's preflight read the weights (verified) and name the
    damaged file in a warning; the weights are salvaged."""
    from megaformer.tools import export_hf, generate, reshard

    ckpt = _copy(run12, tmp_path)
    name = _damage(ckpt, case)
    assert reshard.main(["--input", str(ckpt), "--output", str(tmp_path / "out"), "--tp", "2"]) == 0
    assert (tmp_path / "out" / "latest").read_text() == "global_step12"
    assert generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "2", *GENERATE_TOKENIZER]) == 0
    assert (
        export_hf.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), *export_tokenizer]) == 0
    )
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "WARNING: checkpoint" in line]
    assert len(warnings) == 3 and all(name in w and WEIGHTS_NOTE in w for w in warnings), captured.err
    assert "step 12" in captured.out and "Traceback" not in captured.err
    assert check_checkpoint(str(ckpt), "train.init_from", integrity.NEEDS_WEIGHTS).endswith("global_step12")


def test_zeroed_block_stops_resume_and_init_from_before_the_model(run12, tmp_path, small_vocab_prefix):
    """4 KiB of zeros at the same size: zip structure and size intact, only the sha256 tells."""
    ckpt = _copy(run12, tmp_path)
    _damage(ckpt, "zeros")
    common = [*LIFECYCLE_TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}"]
    resumed = run_pretrain(CONFIG, [*common, "train.resume=auto", f"output.dir={ckpt.parent}"])
    # the resume through the launcher (a user's relaunch); init_from on ranks started here: the
    # same check, in the ranks' preflight
    started = run_ranks(
        CONFIG, [*common, "train.steps=16", f"train.init_from={ckpt}", f"output.dir={tmp_path / 'new'}"]
    )
    for proc in (resumed, started):
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "mp_rank_00_model_states.pt: sha256 differs" in proc.stderr
        assert SUGGESTION.format("global_step8") in proc.stderr
        assert "Traceback" not in proc.stderr and "step 13/" not in proc.stdout


def test_init_from_past_a_truncated_optimizer_file(run12, tmp_path, small_vocab_prefix):
    """train.init_from reads only the weights: the ranks' sha256 check warns and the run starts."""
    ckpt = _copy(run12, tmp_path)
    name = _damage(ckpt, "optimizer_truncated")
    common = [*LIFECYCLE_TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.save_interval=0"]
    proc = run_ranks(  # the ranks' check, not the launcher's: started by the test
        CONFIG, [*common, "train.steps=14", f"train.init_from={ckpt}", f"output.dir={tmp_path / 'new'}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if name in line and WEIGHTS_NOTE in line]
    assert len(warned) == 1, proc.stderr[-3000:]  # said once, by rank 0
    assert "initialised weights from" in proc.stdout and "step 14/14" in proc.stdout


def test_resume_past_rank0s_deleted_generator_state(run12, tmp_path, small_vocab_prefix):
    """A deleted generator state is documented as "dropout masks restart, not an error": resumed
    from global_step8 with rank 0's file deleted, the run goes on (rank 0's masks from the seed)
    and a warning names the file."""
    ckpt = _copy(run12, tmp_path)
    (ckpt / "latest").write_text("global_step8")
    name = ckpt / "global_step8" / "rng_state" / "rank00000.pt"
    os.remove(name)
    overrides = [*LIFECYCLE_TINY, *SMALL_VOCAB, f"data.prefix={small_vocab_prefix}", "train.resume=auto"]
    proc = run_ranks(CONFIG, [*overrides, f"output.dir={ckpt.parent}"])  # the ranks' resume
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"{name}: missing" in proc.stderr and "that rank's dropout masks restart from the seed" in proc.stderr
    )
    assert f"no generator state at {name}: dropout masks restart from the seed" in proc.stdout
    assert "restored generator states on 1/2 ranks" in proc.stdout
    assert "at step 8" in proc.stdout and "step 12/12" in proc.stdout
