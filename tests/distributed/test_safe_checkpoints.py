"""A checkpoint that carries code is refused by every tool that reads weights, before it runs.

The attack of issue 25: a copy of a real checkpoint (the shared 12-step, 2-process run) whose
``mp_rank_00_model_states.pt`` holds one more object, whose unpickling calls ``os.system("touch
MARKER")``, with the manifest rewritten to match. ``generate``, ``export_hf``, ``evaluate``,
``reshard``, ``zero_shot`` and ``train.init_from`` each refuse it (exit 2, the file and the type
named, no traceback) and the marker never appears; the trust flag gives the old behaviour, logged.
An export directory whose Python files were edited is scored by ``zero_shot --hf-model`` with
megaformer's own classes: the edited code does not run.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest

from tests.distributed.conftest import LIFECYCLE_TINY, REPO, run_pretrain, run_ranks
from tests.support.malicious_checkpoint import plant_payload

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

CONFIG = "configs/normformer-quickstart.yaml"
ZERO_SHOT = REPO / "tests" / "fixtures" / "zero_shot"


@pytest.fixture
def planted(lifecycle_reference, tmp_path):
    """(checkpoints dir, the planted file, the marker) of a copy of the shared run."""
    ckpt = tmp_path / "run" / "checkpoints"
    shutil.copytree(lifecycle_reference / "checkpoints", ckpt)
    marker = tmp_path / "PWNED"
    path = plant_payload(ckpt / "global_step12", marker)
    return ckpt, path, marker


def _tool_args(tool: str, ckpt, tmp_path, gutenberg_prefix) -> list[str]:
    return {
        "generate": ["--checkpoint", str(ckpt), "--max-new-tokens", "2"],
        "export_hf": ["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")],
        "evaluate": ["--checkpoint", str(ckpt), "--data-prefix", gutenberg_prefix, "--max-samples", "2"],
        "reshard": ["--input", str(ckpt), "--output", str(tmp_path / "out"), "--tp", "2"],
        "zero_shot": ["--checkpoint", str(ckpt), f"--task=piqa={ZERO_SHOT / 'piqa.jsonl'}", "--limit", "2"],
    }[tool]


def _main(tool: str):
    import importlib

    return importlib.import_module(f"megaformer.tools.{tool}").main


TOOLS = ["generate", "export_hf", "evaluate", "reshard", "zero_shot"]


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tool_refuses_the_payload_before_it_runs(tool, planted, tmp_path, gutenberg_prefix, capsys):
    ckpt, path, marker = planted
    assert _main(tool)(_tool_args(tool, ckpt, tmp_path, gutenberg_prefix)) == 2
    err = capsys.readouterr().err
    assert f"{path}: refers to posix.system" in err and "--trust-checkpoint-code" in err, err
    assert "Traceback" not in err and not marker.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "out").exists()


def test_trust_flag_runs_the_old_path_and_logs_it(planted, capsys):
    from megaformer.tools import generate

    ckpt, path, marker = planted
    assert generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "2", "--trust-checkpoint-code"]) == 0
    err = capsys.readouterr().err
    assert f"WARNING: --trust-checkpoint-code: unpickling {path} in full" in err
    assert marker.exists()  # the old behaviour, which the flag exists to allow for a trusted source


def test_init_from_refuses_the_payload_before_any_process_group(planted, tmp_path, gutenberg_prefix):
    ckpt, path, marker = planted
    overrides = [
        *LIFECYCLE_TINY,
        f"data.prefix={gutenberg_prefix}",
        "train.steps=14",
        f"train.init_from={ckpt}",
        f"output.dir={tmp_path / 'new'}",
    ]
    refused = run_pretrain(CONFIG, overrides)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"{path}: refers to posix.system" in refused.stderr
    assert "train.trust_checkpoint_code=true" in refused.stderr and "Traceback" not in refused.stderr
    assert "step 13/" not in refused.stdout and not marker.exists()

    # the trusted path is the ranks' load: started by the test (run_ranks)
    trusted = run_ranks(CONFIG, [*overrides, "train.trust_checkpoint_code=true"])
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert f"WARNING: --trust-checkpoint-code: unpickling {path} in full" in trusted.stderr
    assert "step 14/14" in trusted.stdout and marker.exists()


def test_clean_checkpoint_loads_in_every_tool(lifecycle_reference, tmp_path, gutenberg_prefix, capsys):
    """The same tools on the unmodified run: exit 0, no warning (the run's files need no trust)."""
    ckpt = lifecycle_reference / "checkpoints"
    with contextlib.redirect_stdout(io.StringIO()):
        for tool in TOOLS:
            assert _main(tool)(_tool_args(tool, ckpt, tmp_path, gutenberg_prefix)) == 0, tool
    err = capsys.readouterr().err
    assert "WARNING: --trust-checkpoint-code" not in err and "refers to" not in err


def test_hf_export_runs_megaformer_code_not_the_directory_code(lifecycle_reference, tmp_path, monkeypatch):
    """``zero_shot --hf-model`` on an export whose modeling file was edited to touch a marker:
    scored with the installed classes, and the marker is absent."""
    import json

    from megaformer.tools import export_hf, zero_shot

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    export = tmp_path / "hf"
    ckpt = str(lifecycle_reference / "checkpoints")
    assert export_hf.main(["--checkpoint", ckpt, "--output", str(export)]) == 0
    marker = tmp_path / "PWNED"
    modeling = export / "modeling_megaformer.py"
    modeling.write_text(f"open({str(marker)!r}, 'w').close()\n" + modeling.read_text())
    result = tmp_path / "result.json"
    args = ["--hf-model", str(export), f"--task=piqa={ZERO_SHOT / 'piqa.jsonl'}", "--limit", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert zero_shot.main([*args, "--json", str(result)]) == 0
    assert json.loads(result.read_text())["tasks"]["piqa"]["n"] == 2
    assert not marker.exists()
