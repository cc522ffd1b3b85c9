"""lm-evaluation-harness's own command line scores a megaformer checkpoint (issue 23 item 4):
``megaformer-lm-eval --model megaformer --model_args checkpoint=...`` (lm_eval's CLI with the
``lm_eval.models`` entry points registered) in a real subprocess, on the shared 12-step run and a task
YAML with a local dataset, gives ``python -m megaformer.tools.zero_shot``'s accuracies and standard
errors at the same few-shot count. Plain ``lm_eval --model megaformer`` is run where the installed
lm_eval reads entry points itself (lm_eval 0.4.13 does not: then that test is skipped, saying so).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata as md
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO
from tests.unit.test_zero_shot_tasks import write_task

pytestmark = pytest.mark.slow  # uses the shared run of the launcher: outside `scripts/check.sh --fast`

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _lm_eval(cmd: list[str], ckpt: Path, task: Path, out: Path) -> dict:
    """Run an lm_eval command line on the checkpoint; lm_eval's results JSON."""
    cmd = [
        *cmd, "--model", "megaformer", "--model_args", f"checkpoint={ckpt}", "--tasks", str(task),
        "--num_fewshot", "1", "--batch_size", "8", "--device", "cpu", "--output_path", str(out),
    ]  # fmt: skip
    env = dict(os.environ, **OFFLINE)
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "|tiny_qa|" in proc.stdout.replace(" ", "")  # lm_eval's own table
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())


def _zero_shot(ckpt: Path, task: Path, result: Path, monkeypatch) -> dict:
    from megaformer.tools.zero_shot import main

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    args = ["--checkpoint", str(ckpt), "--tasks", str(task), "--num-fewshot", "1", "--device", "cpu"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--json", str(result)]) == 0
    return json.loads(result.read_text())["tasks"]["tiny_qa"]


def _same(direct: dict, ours: dict) -> None:
    res = direct["results"]["tiny_qa"]
    assert direct["n-shot"]["tiny_qa"] == 1 == ours["num_fewshot"]
    for metric in ("acc", "acc_norm"):
        assert ours[metric] == res[f"{metric},none"], (metric, ours, res)
        assert ours[f"{metric}_stderr"] == pytest.approx(res[f"{metric}_stderr,none"], rel=1e-12)


def test_megaformer_lm_eval_command_scores_the_checkpoint(lifecycle_reference, tmp_path, monkeypatch):
    script = Path(sys.executable).with_name("megaformer-lm-eval")
    assert script.exists(), f"{script} missing: install the project with `pip install --no-deps -e .`"
    ckpt, task = lifecycle_reference / "checkpoints", write_task(tmp_path / "task")
    direct = _lm_eval([str(script)], ckpt, task, tmp_path / "lm_eval")
    _same(direct, _zero_shot(ckpt, task, tmp_path / "ours.json", monkeypatch))


def test_plain_lm_eval_where_it_reads_entry_points(lifecycle_reference, tmp_path, monkeypatch):
    probe = subprocess.run(
        [sys.executable, "-c", "from lm_eval.api.registry import get_model; get_model('megaformer')"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0 and "no model for this name found" in probe.stderr:
        pytest.skip(
            f"lm_eval {md.version('lm_eval')} reads no 'lm_eval.models' entry points (entry-point plugins "
            "came upstream later); megaformer-lm-eval is lm_eval's command line for it here"
        )
    assert probe.returncode == 0, probe.stderr[-3000:]
    ckpt, task = lifecycle_reference / "checkpoints", write_task(tmp_path / "task")
    direct = _lm_eval([sys.executable, "-m", "lm_eval"], ckpt, task, tmp_path / "lm_eval")
    _same(direct, _zero_shot(ckpt, task, tmp_path / "ours.json", monkeypatch))


def test_plain_lm_eval_on_the_hugging_face_export(lifecycle_reference, tmp_path, monkeypatch):
    """lm_eval's own command line, unpatched, on the Hugging Face export of the same checkpoint
    (``--model hf --model_args pretrained=EXPORT,trust_remote_code=True``; docs/evaluate.md): the
    same accuracies as ``zero_shot`` on the checkpoint (issue 39 item 10)."""
    from megaformer.tools.export_hf import main as export

    ckpt, task = lifecycle_reference / "checkpoints", write_task(tmp_path / "task")
    with contextlib.redirect_stdout(io.StringIO()):
        assert export(["--checkpoint", str(ckpt), "--output", str(tmp_path / "export")]) == 0
    out = tmp_path / "lm_eval_hf"
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={tmp_path / 'export'},trust_remote_code=True,dtype=float32",
        "--tasks", str(task), "--num_fewshot", "1", "--batch_size", "8", "--device", "cpu",
        "--output_path", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ, **OFFLINE), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "|tiny_qa|" in proc.stdout.replace(" ", "")
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    direct = json.loads(Path(path).read_text())
    _same(direct, _zero_shot(ckpt, task, tmp_path / "ours.json", monkeypatch))
