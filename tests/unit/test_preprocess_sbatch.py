"""launch/preprocess.sbatch with stand-in sbatch and srun on PATH: the array of shards and the merge
that depends on it are submitted, and run for real on a small corpus; the merged output equals one
unsharded preprocess run byte for byte; the merge does not run when a shard fails, and a
resubmission redoes only the failed shard; bad arguments stop before anything is submitted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "preprocess.sbatch"

# A stand-in for sbatch: records each submission, runs a copy of the script at once (Slurm runs a
# spooled copy, so the script cannot find the repository from its own path), each array task with
# Slurm's SLURM_ARRAY_* variables, and honours --dependency=afterok with --kill-on-invalid-dep.
SBATCH = r"""#!/usr/bin/env python3
import json, os, re, shutil, subprocess, sys
calls = os.environ["CALLS"]
argv = sys.argv[1:]
options, i = {}, 0
while i < len(argv) and argv[i].startswith("--"):
    key, _, value = argv[i][2:].partition("=")
    options[key] = value
    i += 1
script, args = argv[i], argv[i + 1:]
with open(os.path.join(calls, "sbatch.log"), "a") as f:
    f.write(json.dumps({"options": options, "args": args}) + "\n")
counter = os.path.join(calls, "next_id")
job_id = int(open(counter).read()) if os.path.exists(counter) else 100
open(counter, "w").write(str(job_id + 10))
print(job_id if "parsable" in options else f"Submitted batch job {job_id}")
sys.stdout.flush()
dep = options.get("dependency", "")
if dep:
    kind, _, after = dep.partition(":")
    assert kind == "afterok", dep
    codes = json.load(open(os.path.join(calls, f"job-{after}.json")))
    if any(codes.values()):
        assert options.get("kill-on-invalid-dep") == "yes", options
        open(os.path.join(calls, f"job-{job_id}.cancelled"), "w").write(dep)
        sys.exit(0)
spool = os.path.join(calls, f"spool-{job_id}.sh")
shutil.copy(script, spool)
env = {**os.environ, "SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_JOB_ID": str(job_id),
       "SLURM_CPUS_PER_TASK": options.get("cpus-per-task", os.environ.get("STANDIN_CPUS", "1"))}
tasks = [None]
if "array" in options:
    spec = options["array"]
    tasks = list(range(int(spec.split("-")[0]), int(spec.split("-")[1]) + 1)) if "-" in spec else [
        int(t) for t in spec.split(",")]
codes = {}
for task in tasks:
    if task is not None:
        env.update(SLURM_ARRAY_JOB_ID=str(job_id), SLURM_ARRAY_TASK_ID=str(task),
                   SLURM_ARRAY_TASK_MIN=str(min(tasks)), SLURM_ARRAY_TASK_MAX=str(max(tasks)))
        if os.environ.get("STANDIN_NO_COUNT") != "1":  # older Slurm sets only MIN and MAX
            env["SLURM_ARRAY_TASK_COUNT"] = str(len(tasks))
    with open(os.path.join(calls, f"job-{job_id}_{task}.out"), "w") as out:
        codes[str(task)] = subprocess.run(["bash", spool, *args], env=env, stdout=out, stderr=out).returncode
json.dump(codes, open(os.path.join(calls, f"job-{job_id}.json"), "w"))
"""
SRUN = """#!/usr/bin/env bash
# stand-in: one task, the command run as given (options recorded, skipped)
opts=(); while [[ "$1" == --* ]]; do opts+=("$1"); shift; done
echo "${opts[*]} :: $*" >> "$CALLS/srun.log"
exec "$@"
"""


def _corpus(directory: Path, shared_data: Path) -> Path:
    """Five real JSONL files (C4 and Dolma samples), sorted 01..05; 3 shards get 1, 2 and 2 of them."""
    directory.mkdir()
    c4 = sorted((shared_data / "c4-sample-jsonl").glob("*.json.gz"))
    dolma = sorted((shared_data / "dolma-cc-sample-jsonl").glob("*.jsonl"))
    for name, source in zip(
        ["01.json.gz", "02.json.gz", "03.jsonl", "04.json.gz", "05.jsonl"],
        [c4[0], c4[1], dolma[0], c4[2], dolma[1]],
    ):
        shutil.copyfile(source, directory / name)
    return directory


def _env(tmp_path: Path, **extra: str) -> tuple[dict, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    calls.mkdir(exist_ok=True)
    for name, text in (("sbatch", SBATCH), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the test's venv
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "STANDIN_CPUS": "2"}
    return {**env, **extra}, calls


def _submit(tmp_path: Path, env: dict, shards: int, args: list[str]) -> subprocess.CompletedProcess:
    # submitted from tmp_path, not the repository: relative paths are the submitter's
    return subprocess.run(
        ["bash", str(SCRIPT), "submit", str(shards), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _submissions(calls: Path) -> list[dict]:
    return [json.loads(line) for line in (calls / "sbatch.log").read_text().splitlines()]


def _reference(tmp_path: Path, inputs: Path, flags: list[str]) -> Path:
    """One unsharded run over the same inputs."""
    ref = tmp_path / "ref"
    ref.mkdir()
    subprocess.run(
        [sys.executable, "-m", "data_tools.preprocess", "--input", str(inputs),
         "--output-prefix", str(ref / "c4"), *flags],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return ref / "c4_text_document"


def _same_bytes(merged: Path, reference: Path) -> None:
    for suffix in (".bin", ".idx"):
        a, b = Path(f"{merged}{suffix}"), Path(f"{reference}{suffix}")
        assert a.read_bytes() == b.read_bytes(), f"{a} differs from {b}"
    stats = [json.loads(Path(f"{p}.stats.json").read_text()) for p in (merged, reference)]
    assert stats[0] == stats[1]  # the sidecars too (the merged one is the sum of the shards')


def test_array_and_merge_equal_one_unsharded_run(tmp_path, shared_data, gpt2_flags):
    inputs = _corpus(tmp_path / "inputs", shared_data)
    flags = [*gpt2_flags, "--append-eod"]
    env, calls = _env(tmp_path)
    args = ["--input", "inputs", "--output-prefix", "out/c4", *flags]
    proc = _submit(tmp_path, env, 3, args)
    assert proc.returncode == 0, proc.stderr
    array, merge = _submissions(calls)
    assert array["options"]["array"] == "0-2" and array["args"] == ["shard", *args]
    assert merge["options"]["dependency"] == "afterok:100"  # the array job's id
    assert merge["options"]["kill-on-invalid-dep"] == "yes" and merge["args"] == ["merge", "3", *args]
    assert "submitted array job 100 (3 shards) and merge job 110" in proc.stdout
    assert json.loads((calls / "job-100.json").read_text()) == {"0": 0, "1": 0, "2": 0}
    assert json.loads((calls / "job-110.json").read_text()) == {"None": 0}, (
        calls / "job-110_None.out"
    ).read_text()
    shard_calls = [
        line for line in (calls / "srun.log").read_text().splitlines() if "data_tools.preprocess" in line
    ]
    for i, line in enumerate(shard_calls):  # --workers from the task's CPUs, the shard from the task id
        assert line.endswith(f"--workers 2 --num-shards 3 --shard-index {i}"), line
    for i in range(3):
        assert (tmp_path / "out" / f"c4-{i:05d}-of-00003_text_document.idx").exists()
    _same_bytes(tmp_path / "out" / "c4_text_document", _reference(tmp_path, inputs, flags))


def test_merge_does_not_run_after_a_failed_shard_and_a_resubmission_redoes_only_it(
    tmp_path, shared_data, gpt2_flags
):
    inputs = _corpus(tmp_path / "inputs", shared_data)
    good = (inputs / "03.jsonl").read_bytes()
    (inputs / "03.jsonl").write_bytes(good + b'{"text": "cut short\n')  # shard 1 (files 02, 03) fails
    flags = [*gpt2_flags, "--append-eod"]
    env, calls = _env(tmp_path, STANDIN_NO_COUNT="1")  # the array's size from its bounds
    args = ["--input", str(inputs), "--output-prefix", str(tmp_path / "out" / "c4"), *flags]
    assert _submit(tmp_path, env, 3, args).returncode == 0
    codes = json.loads((calls / "job-100.json").read_text())
    assert codes["0"] == 0 and codes["2"] == 0 and codes["1"] == 2, codes
    assert "03.jsonl:" in (calls / "job-100_1.out").read_text()  # the shard's error names the file
    assert (calls / "job-110.cancelled").exists() and not (calls / "job-110.json").exists()
    assert not (tmp_path / "out" / "c4_text_document.idx").exists()
    assert not (tmp_path / "out" / "c4_text_document.bin").exists()

    (inputs / "03.jsonl").write_bytes(good)  # fixed: the same command again
    assert _submit(tmp_path, env, 3, args).returncode == 0
    assert json.loads((calls / "job-130.json").read_text()) == {"None": 0}  # the new merge ran
    for task in (0, 2):
        assert "already finished; skipping it" in (calls / f"job-120_{task}.out").read_text()
    assert "done:" in (calls / "job-120_1.out").read_text()
    _same_bytes(tmp_path / "out" / "c4_text_document", _reference(tmp_path, inputs, flags))


def test_bad_arguments_stop_before_anything_is_submitted(tmp_path, shared_data, gpt2_flags):
    inputs = _corpus(tmp_path / "inputs", shared_data)
    env, calls = _env(tmp_path)
    args = ["--input", str(inputs), "--output-prefix", str(tmp_path / "c4"), *gpt2_flags]
    for shards, expected in ((6, "--num-shards 6 is more than the 5 input files"), (0, "NUM_SHARDS must be")):
        proc = _submit(tmp_path, env, shards, args)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = _submit(
        tmp_path, env, 2, ["--input", str(tmp_path / "nothing*"), "--output-prefix", "x", *gpt2_flags]
    )
    assert proc.returncode == 2 and "has no input files" in proc.stderr, proc.stderr
    assert not (calls / "sbatch.log").exists()


def test_a_shard_task_refuses_an_array_that_is_not_the_shards(tmp_path, gpt2_flags):
    """--array=1-3 would leave shard 0 undone and ask for a shard 3 of 3."""
    env, calls = _env(
        tmp_path, SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_MIN="1", SLURM_ARRAY_TASK_MAX="3",
        SLURM_ARRAY_TASK_COUNT="3", SLURM_SUBMIT_DIR=str(REPO),
    )  # fmt: skip
    proc = subprocess.run(
        ["bash", str(SCRIPT), "shard", "--input", "x", "--output-prefix", "y", *gpt2_flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "not the shards 0..2" in proc.stderr and "--array=0-2" in proc.stderr
    assert not (calls / "srun.log").exists()


def test_merge_shards_refuses_unfinished_shards_naming_them(tmp_path, shared_data, gpt2_flags, capsys):
    """Run by hand (not after afterok), the merge still checks every shard: one never run and one
    whose input changed since are named, with the fix, and nothing is written."""
    from data_tools import merge_shards, preprocess

    inputs = _corpus(tmp_path / "inputs", shared_data)
    args = ["--input", str(inputs), "--output-prefix", str(tmp_path / "c4"), *gpt2_flags, "--append-eod"]
    # main() makes SIGTERM and SIGINT interrupts; pytest's own handlers come back after
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for shard in (0, 2):
            assert preprocess.main([*args, "--num-shards", "3", "--shard-index", str(shard)]) == 0
        (inputs / "05.jsonl").write_text('{"text": "changed"}\n')  # in shard 2
        assert merge_shards.main(["--num-shards", "3", *args]) == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert "2 of 3 shards of" in err and "shard 1: " in err and "shard 2: its inputs changed" in err, err
    assert "--array=1,2" in err and "PREPROCESS_NUM_SHARDS=3" in err
    assert not (tmp_path / "c4_text_document.idx").exists()
