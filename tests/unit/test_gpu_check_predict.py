"""``bench/gpu_check.py`` and ``scripts/gpu_check.sh`` without a GPU: the arguments, where the output
goes (the device's ``$OUT`` is a folder), the default case list's duration against the committed H200
timings, the time budget, ``--repredict`` afterwards on the CPU machine, and the script's own paths
(interpreter, wheels, errors). The measured path itself runs under ``tests/fakecuda`` (``--smoke``)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
H200_RUN = REPO / "bench" / "results" / "gpu" / "2026-11-26-h200-2" / "measured.json"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(recipe: str, step_s: float, **extra) -> dict:
    """A measured row as bench/gpu.py writes it (ZeRO-1, no recompute, compiled blocks)."""
    micro = {"125m": 32, "355m": 16, "1.3b": 8}[recipe.split("-")[0]]
    return {
        "recipe": recipe,
        "zero": 1,
        "recompute": "none",
        "overrides": [
            "train.zero_stage=1",
            "train.recompute=none",
            "train.activation_checkpointing=false",
            "train.precision=bf16",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={4 * micro}",
        ],
        "micro_batch": micro,
        "step_s": step_s,
        "tokens_per_s": 4 * micro * 2048 / step_s,
        "mfu": 0.35,
        "peak_memory_gib": 34.0,
        "device": "NVIDIA H200",
        "compiled_blocks": 12,
        "attention": {
            "backend": "cudnn",
            "forward_calls": 96,
            "expected_forwards": 48,
            "ops": {},
            "kernels": {},
        },
        "wall_s": 40.0,
        **extra,
    }


def _stub_predict(row, gpu, smoke, sessions=None):
    return {
        "planner_peak_gib": 40.0,
        "steptime": {"step_s": row["step_s"] / 1.5, "mfu": 0.5},
        "dryrun": {"peak_gib": 33.0},
    }


# --- the arguments and the output paths ------------------------------------------------------------


def test_out_as_a_folder_gets_json_and_table_inside(tmp_path):
    gc = _gpu_check()
    folder = tmp_path / "out"  # the device's $OUT: a folder (here made by output_paths)
    assert gc.output_paths(folder) == (folder / "gpu_check.json", folder / "gpu_check.md")
    assert folder.is_dir()
    assert gc.output_paths(folder, "gpu_check_smoke")[0] == folder / "gpu_check_smoke.json"
    # the form of earlier runs: a .json path, the table beside it
    assert gc.output_paths(tmp_path / "run1.json") == (tmp_path / "run1.json", tmp_path / "run1.md")


def test_out_that_cannot_be_written_is_refused_with_the_fix(tmp_path):
    gc = _gpu_check()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="a file, not a folder"):
        gc.output_paths(tmp_path / "a_file")
    (tmp_path / "odd.json").mkdir()
    with pytest.raises(ValueError, match=r"a folder named \.json"):
        gc.output_paths(tmp_path / "odd.json")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps 0: at least 1"),
        (["--sizes", "125m,7b"], "no configs/paper/7b-normformer.yaml"),
        (["--cases", "1/sometimes"], "'1/sometimes' is not a ZeRO/recompute case"),
        (["--budget-s", "-3"], "--budget-s -3.0: the time left is used up"),
        (["--predict-only"], "--predict-only needs --gpu"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    gc = _gpu_check()
    with pytest.raises(SystemExit) as stop:
        gc.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_defaults_are_the_pairs_at_three_sizes(monkeypatch):
    gc = _gpu_check()
    from bench.gpu import _cases, parse_cases

    args = gc.parse_args([])
    assert (args.sizes, args.cases, args.steps, args.probe, args.predict) == (
        "125m,1.3b,355m",
        "1/none",
        10,
        True,
        "auto",
    )
    cases = _cases(args.sizes.split(","), False, parse_cases(args.cases), pairs=True)
    assert [Path(r).stem for r, _, _ in cases] == [
        "125m-normformer",
        "125m-baseline",
        "1.3b-normformer",
        "1.3b-baseline",
        "355m-normformer",
        "355m-baseline",
    ]
    assert {(z, c) for _, z, c in cases} == {(1, "none")}


# --- the time the default takes ---------------------------------------------------------------------


def test_committed_h200_step_times_are_the_compiled_recipe_rows():
    gc = _gpu_check()
    assert gc.H200_TIMINGS == H200_RUN
    # the longer of the two compiled 1.3B NormFormer rows (runs 4 and 6)
    assert gc.committed_step_s("1.3b-normformer") == pytest.approx(1.4026, abs=1e-3)
    # not the eager row (0.971 s) nor the attention_dropout=0 one (0.560 s)
    assert gc.committed_step_s("125m-baseline") == pytest.approx(0.7182, abs=1e-3)
    with pytest.raises(KeyError, match=r"2\.7b-normformer: no compiled step in"):
        gc.committed_step_s("2.7b-normformer")


def test_the_default_case_list_ends_inside_8_minutes_on_the_h200():
    """Each case: the fixed cost the second loan bounds (46 s: start, imports, build, compile) plus
    3 warm-up, 10 timed and 2 profiled steps at its committed H200 step; then the probe and setup."""
    gc = _gpu_check()
    from bench.gpu import _cases, parse_cases

    cases = _cases(gc.DEFAULT_SIZES.split(","), False, parse_cases(gc.DEFAULT_CASES), pairs=True)
    est = gc.estimate_s(cases, steps=10)
    rows = json.loads(H200_RUN.read_text())["rows"]
    steps_alone = sum(
        15 * max(r["step_s"] for r in rows if r["recipe"] == Path(c[0]).stem and r["compiled_blocks"])
        for c in cases
    )
    assert est["total_s"] == pytest.approx(6 * 46 + steps_alone + 60 + 20, rel=1e-6)
    assert est["total_s"] < gc.TIME_LIMIT_S == 480, est
    # the script's default budget (BUDGET_S=450) holds the estimate, so nothing is skipped when the
    # estimate is right, and stops the run inside 8 minutes when it is not
    assert est["total_s"] <= 450


def test_the_budget_skips_cases_that_would_not_fit(monkeypatch, tmp_path):
    gc = _gpu_check()
    from bench import gpu

    clock = [1000.0]
    monkeypatch.setattr(gc.time, "monotonic", lambda: clock[0])
    spawned = []

    def fake_spawn(recipe, zero, recompute, steps, smoke, extra, profile, timeout_s):
        name = Path(recipe).stem
        spawned.append((name, timeout_s))
        clock[0] += gc.estimate_case_s(name, recompute, steps)  # each case takes its estimate
        return _row(name, gc.committed_step_s(name))

    monkeypatch.setattr(gpu, "_spawn", fake_spawn)
    monkeypatch.setattr(gc, "_run_probe", lambda device, timeout: {"device": device, "ok": True})
    monkeypatch.setattr(gc, "environment", lambda: {"device": "NVIDIA H200"})
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = gc.parse_args(["--budget-s", "250", "--out", str(tmp_path)])
    assert gc.measure(args, *gc.output_paths(tmp_path)) == 1  # not every case measured
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    # 250 s less the probe's 60: 125M pair (58 + 57 s), 1.3B NormFormer (67 s); 8 s left for the rest
    assert [n for n, _ in spawned] == ["125m-normformer", "125m-baseline", "1.3b-normformer"]
    assert spawned[0][1] == pytest.approx(190)  # each case is killed when it outlives the budget
    skipped = [r for r in doc["rows"] if "skipped" in r]
    assert [r["recipe"] for r in skipped] == ["1.3b-baseline", "355m-normformer", "355m-baseline"]
    assert "the time budget" in skipped[0]["skipped"]
    assert doc["complete"] and doc["probe"]["ok"] and doc["gpu"] == "h200-141gb"
    assert [(p["size"], round(p["ratio"], 3)) for p in doc["pairs"]] == [("125m", 1.1)]
    assert "prediction" not in doc["rows"][0]  # none on the GPU machine: --repredict afterwards
    table = (tmp_path / "gpu_check.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| 1.3b-baseline |"))
    assert "| skipped: the time budget (8 s left, the case needs ~66 s) |" in line
    assert line.count("|") == table.splitlines()[0].count("|") == 17  # the header's 16 columns


# --- predictions afterwards on the CPU machine ------------------------------------------------------


def test_a_failed_step_time_prediction_is_recorded_and_the_rows_still_written(monkeypatch, tmp_path):
    """On a GPU image the step-time model's trace needs a CPU torch: its error is recorded in the row,
    the rows are still written (the H200's second run lost its table to it)."""
    # fakecuda.launch binds build_shim at import: imported here, before the patch, it keeps the real
    # one (gpu_check imports it under the patch, and the stub would outlive this test).
    from megaformer.perf import steptime
    from megaformer.perf.fakecuda import build, launch

    assert launch.build_shim is build.build_shim

    def no_trace(*args, **kwargs):
        raise RuntimeError(
            "block trace failed (exit 1):\nKey already registered with the same priority: CUDAHooks"
        )

    def no_shim():
        raise OSError("a CUDA torch has no fake-CUDA shim")

    monkeypatch.setattr(steptime, "predict", no_trace)
    monkeypatch.setattr(build, "build_shim", no_shim)
    gc = _gpu_check()
    measured = tmp_path / "gpu_check.json"
    measured.write_text(json.dumps({"gpu": "h200-141gb", "rows": [_row("125m-baseline", 0.718)]}))
    assert gc.main(["--repredict", str(measured)]) == 0
    written = json.loads((tmp_path / "gpu_check_predicted.json").read_text())["rows"][0]
    assert written["step_s"] == pytest.approx(0.718)
    error = written["prediction"]["steptime"]["error"]
    assert "block trace failed" in error and "--repredict" in error
    assert written["prediction"]["planner_peak_gib"] > 0
    table = (tmp_path / "gpu_check_predicted.md").read_text()
    assert (
        "| 125m-baseline | 1 | none | 32 | compiled | 0.718 | 365,103 | 35.0% | 34.00 "
        "| cudnn, 96 fwd for 48 |" in table
    )


def test_repredict_from_the_devices_folder_keeps_everything_and_adds_predictions(monkeypatch, tmp_path):
    gc = _gpu_check()
    monkeypatch.setattr(gc, "predict", _stub_predict)
    out = tmp_path / "device_out"  # what the device tool brings back: $OUT's files in a folder
    out.mkdir()
    rows = [
        _row("125m-normformer", 0.790),
        _row("125m-baseline", 0.718),
        {"recipe": "355m-baseline", "zero": 1, "recompute": "none", "skipped": "the time budget"},
    ]
    probe = {"device": "NVIDIA H200", "ok": True, "dropout": {}, "attention": {}, "block": {}}
    (out / "gpu_check.json").write_text(json.dumps({"gpu": "h200-141gb", "rows": rows, "probe": probe}))
    assert gc.main(["--repredict", str(out), "--out", str(tmp_path / "predicted")]) == 0
    doc = json.loads((tmp_path / "predicted" / "gpu_check_predicted.json").read_text())
    assert doc["probe"] == probe and doc["gpu"] == "h200-141gb"
    assert [p["ratio"] for p in doc["pairs"]] == [pytest.approx(0.790 / 0.718)]
    assert doc["rows"][0]["prediction"]["steptime"]["step_s"] == pytest.approx(0.790 / 1.5)
    assert "prediction" not in doc["rows"][2]  # a skipped case has nothing to predict
    table = (tmp_path / "predicted" / "gpu_check_predicted.md").read_text()
    assert "| 0.527 | 1.50× | 50.0% | 33.00 | 40.00 |" in table
    assert "| 125m | 1 | none | compiled | 0.790 | 0.718 | 1.100× |" in table


def test_repredict_reads_the_committed_h200_run(monkeypatch, tmp_path):
    """The second loan's measured.json (the format before 2026-11-28) repredicts as it is."""
    gc = _gpu_check()
    monkeypatch.setattr(gc, "predict", _stub_predict)
    assert gc.main(["--repredict", str(H200_RUN), "--out", str(tmp_path / "h200.json")]) == 0
    doc = json.loads((tmp_path / "h200.json").read_text())
    ratios = {(p["size"], p["blocks"], tuple(p["extra_overrides"])): p["ratio"] for p in doc["pairs"]}
    assert ratios[("125m", "compiled", ())] == pytest.approx(1.0995, abs=1e-3)
    assert ratios[("125m", "eager", ("train.compile=false",))] == pytest.approx(1.1133, abs=1e-3)
    assert ratios[("355m", "compiled", ())] == pytest.approx(1.1318, abs=1e-3)
    assert (tmp_path / "h200.md").exists()


def test_repredict_of_a_missing_file_names_it_and_the_fix(tmp_path, capsys):
    gc = _gpu_check()
    assert gc.main(["--repredict", str(tmp_path / "nowhere.json")]) == 2
    err = capsys.readouterr().err
    assert "nowhere.json" in err and "the gpu_check.json a GPU run wrote" in err


# --- scripts/gpu_check.sh ---------------------------------------------------------------------------


def _script(env: dict, *args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(cwd / "scripts" / "gpu_check.sh"), *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_script_refuses_an_unknown_argument():
    proc = _script({}, "--bogus")
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr


def test_script_estimate_prints_the_default_case_list():
    proc = _script({"PYTHON": sys.executable}, "--estimate")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ZeRO 1 none") == 6 and "total on one H200 (estimate)" in proc.stdout


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_script_writes_inside_the_out_folder_and_says_when_there_is_no_gpu(tmp_path):
    """The device's $OUT is a folder: the log goes inside it and nothing beside it (the script
    before 2026-11-28 wrote ${OUT}_bench.json next to the folder). Without CUDA: exit 1, the fix named."""
    out = tmp_path / "OUT"
    out.mkdir()
    proc = _script({"PYTHON": sys.executable, "OUT": str(out)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout and "--smoke" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]
    assert (out / "gpu_check.log").read_text().count("no CUDA device") == 1


def _fake_wheel(folder: Path, name: str, body: str = "") -> Path:
    """A minimal pure-Python wheel of package ``name`` (for the install path; no real DeepSpeed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.0.1-py3-none-any.whl"
    info = f"{name}-0.0.1.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", body)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


def _python_without(*modules: str) -> str:
    python = shutil.which("python3")
    if python is None:
        pytest.skip("no python3 on PATH")
    probe = subprocess.run([python, "-c", f"import {modules[0]}"], capture_output=True)
    pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0 or pip.returncode != 0:
        pytest.skip(f"python3 on PATH has {modules[0]} or no pip: the no-venv path needs one without")
    return python


def test_script_installs_the_carried_wheels_when_the_python_has_no_deepspeed(tmp_path):
    """A GPU image's python3: no venv, no DeepSpeed; the wheels in WHEELS are installed into SITE and
    put first on PYTHONPATH. (Here a stand-in wheel, and a python3 without torch, which is then named.)"""
    python = _python_without("deepspeed")
    wheels = tmp_path / "whl"
    _fake_wheel(wheels, "deepspeed", "__version__ = '0.0.1'\n")
    out = tmp_path / "OUT"
    env = {
        "VENV": "none",
        "PYTHON": python,
        "WHEELS": str(wheels),
        "SITE": str(tmp_path / "site"),
        "OUT": str(out),
    }
    proc = _script(env)
    assert "installing 1 wheels from" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "deepspeed" / "__init__.py").exists()
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        assert proc.returncode == 1 and "has no torch" in proc.stdout


def test_script_without_deepspeed_or_wheels_says_how_to_stage_them(tmp_path):
    python = _python_without("deepspeed")
    (tmp_path / "empty").mkdir()
    env = {"PYTHON": python, "WHEELS": str(tmp_path / "empty"), "OUT": str(tmp_path / "OUT")}
    proc = _script(env)
    assert proc.returncode == 2
    assert "cannot import deepspeed" in proc.stdout and "--stage-wheels" in proc.stdout  # the log's copy
    assert (tmp_path / "OUT" / "gpu_check.log").read_text().count("--stage-wheels") == 1


def test_stage_wheels_copies_what_a_gpu_image_lacks_into_an_ignored_folder(tmp_path):
    """--stage-wheels, in a scratch clone of the script: the seven wheels (not zstandard) into .whl/,
    which git then ignores (a device call sends ignored folders only when carried)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu_check.sh", repo / "scripts" / "gpu_check.sh")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    shared = tmp_path / "gpu-wheels"
    names = ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection"]
    for name in [*names, "typing_extensions", "zstandard"]:
        _fake_wheel(shared, name)
    proc = _script({"WHEELS_FROM": str(shared)}, "--stage-wheels", cwd=repo)
    assert proc.returncode == 0, proc.stderr
    staged = sorted(p.name.split("-")[0] for p in (repo / ".whl").iterdir())
    assert staged == sorted([*names, "typing_extensions"])
    assert subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", ".whl/x.whl"]).returncode == 0
    assert 'carry=[".whl"]' in proc.stdout
    (shared / "hjson-0.0.1-py3-none-any.whl").unlink()
    proc = _script({"WHEELS_FROM": str(shared)}, "--stage-wheels", cwd=repo)
    assert proc.returncode == 2 and "has no hjson-*.whl" in proc.stderr


@pytest.mark.slow
def test_the_probe_runs_on_this_cpu_and_finds_compiled_equal_to_eager():
    """bench/gpu_probe.py through gpu_check's runner, on the CPU (inductor's C++ backend; ~1 min)."""
    gc = _gpu_check()
    result = gc._run_probe("cpu", 900)
    assert result["ok"], result
    assert result["attention"]["states_equal"] and result["block"]["states_equal"]
    assert all(r["bitwise"] for r in result["dropout"].values())
    assert not result["block"]["compile_failures"]
    # the comparison can fail: other masks move the block's output far beyond the tolerance
    assert result["block"]["other_masks_output_max_rel_diff"] > 10 * result["block"]["tolerance"]


def test_a_case_that_outlives_its_time_is_killed_and_recorded():
    """bench/gpu.py's _spawn with the budget's timeout: the case's process group is killed (inductor's
    compile workers with it) and the row says why, with the time it took."""
    from bench.gpu import _spawn

    row = _spawn("configs/paper/125m-normformer.yaml", 1, "none", 2, True, timeout_s=2)
    assert row["error"].startswith("timeout: stopped after 2 s"), row
    assert 2 <= row["wall_s"] < 30 and row["recipe"] == "125m-normformer"
