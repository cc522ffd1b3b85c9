"""Fingerprint short training runs, to show that a refactor changes no number.

Trains four 20-step runs on the bundled corpus as ``torchrun`` would start them (data parallel 2;
tensor parallel 2 with sequence parallelism and ZeRO-1; tensor 2 × pipeline 2; the masked LM at data
parallel 2) and writes, per run, a SHA-256 of its TensorBoard scalars (every tag that does not measure
time or memory: the losses, learning rates, gradient norms, loss scale, token counts) and of every
tensor of its final checkpoint (weights, optimizer states, generator states but NumPy's), plus the final
training and validation losses in clear.

    python scripts/fingerprint_runs.py --json before.json        # at the old commit
    python scripts/fingerprint_runs.py --json after.json         # at the new one
    python scripts/fingerprint_runs.py --compare before.json after.json

``--compare`` exits 1 and names the run and the part (scalars, tensors) that differ. Training on CPU
is bit-deterministic for a fixed layout and seed, so equal hashes are the expected result of a change
that only moves code. Needs ``data/processed/gutenberg_text_document`` (the quickstart builds it) or
``--data-prefix``. About a minute per run on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=5",
    "train.steps=20",
    "train.log_interval=1",
    "train.eval_interval=10",
    "train.eval_batches=2",
    "train.save_interval=20",
    "data.valid_fraction=0.02",
]
RUNS = {  # name: (config, processes, overrides)
    "dp2": ("configs/normformer-quickstart.yaml", 2, ["model.resid_scale=true", "train.zero_stage=1"]),
    "tp2_sp": (
        "configs/normformer-quickstart.yaml",
        2,
        ["parallel.tp_size=2", "parallel.sequence_parallel=true", "train.zero_stage=1"],
    ),
    "tp2_pp2": (
        "configs/normformer-quickstart.yaml",
        4,
        [
            "parallel.tp_size=2",
            "parallel.pp_size=2",
            "train.zero_stage=0",
            "train.activation_checkpointing=true",
        ],
    ),
    "mlm_dp2": ("configs/mlm-quickstart.yaml", 2, []),
}
# Scalars that measure the machine, not the arithmetic: they differ between any two runs.
TIMED = ("time", "tokens_per", "throughput", "mfu", "tflop", "memory", "mem", "seconds", "device_h")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(name: str, data_prefix: str, out: Path) -> None:
    """Run ``RUNS[name]`` into ``out`` under torchrun.

    Raises:
        RuntimeError: the run failed (its return code and the tail of its output).
    """
    config, nproc, extra = RUNS[name]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", "-m", "megaformer.train", config,
        *SMALL, *extra, f"data.prefix={data_prefix}", f"output.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{tail}")


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The untimed scalars of the event files under ``tb_dir``: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if any(word in tag.lower() for word in TIMED):
                continue
            found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return found


def _tensors(obj: object, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _tensors(obj[key], f"{path}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _tensors(item, f"{path}/{i}", out)


def checkpoint_hashes(ckpt_dir: Path) -> dict[str, str]:
    """SHA-256 of every tensor (dtype, shape, bytes) of the checkpoint's ``.pt`` files, keyed by
    ``file/key/...``. Non-tensor entries (paths, versions, times) are left out."""
    hashes = {}
    for pt in sorted(ckpt_dir.rglob("*.pt")):
        found: list[tuple[str, torch.Tensor]] = []
        _tensors(torch.load(pt, map_location="cpu", weights_only=False), pt.name, found)
        for path, t in found:
            if "/numpy/" in path:
                # NumPy's process-global generator: saved for completeness, never seeded nor drawn
                # from by training, so it differs between any two runs (measured: the only tensor that did)
                continue
            digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            hashes[path] = digest.hexdigest()
    return hashes


def fingerprint(name: str, data_prefix: str) -> dict:
    """Train run ``name`` in a temporary folder and return its fingerprint (hashes and final losses)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        train(name, data_prefix, out)
        found = scalars(out / "tensorboard")
        blob = json.dumps({k: [[s, v.hex()] for s, v in found[k]] for k in sorted(found)}).encode()
        tensors = checkpoint_hashes(out / "checkpoints" / "global_step20")
        summary = json.loads((out / "summary.json").read_text())
    return {
        "scalar_tags": sorted(found),
        "scalars_sha256": hashlib.sha256(blob).hexdigest(),
        "checkpoint_sha256": hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest(),
        "checkpoint_tensors": len(tensors),
        "tensors": tensors,
        "final_train_loss": found["train/loss"][-1][1] if "train/loss" in found else None,
        "final_valid_loss": summary.get("final_valid_loss"),
    }


def compare(before: dict, after: dict) -> list[str]:
    """The differences between two fingerprint files, one line each (empty when equal)."""
    lines = []
    for name in sorted(set(before["runs"]) | set(after["runs"])):
        a, b = before["runs"].get(name), after["runs"].get(name)
        if a is None or b is None:
            lines.append(f"{name}: only in {'after' if a is None else 'before'}")
            continue
        for key in ("scalar_tags", "scalars_sha256", "checkpoint_sha256", "checkpoint_tensors"):
            if a[key] != b[key]:
                lines.append(f"{name}: {key} differs ({a[key]!r} → {b[key]!r})")
        for path in sorted(set(a["tensors"]) | set(b["tensors"])):
            if a["tensors"].get(path) != b["tensors"].get(path):
                lines.append(f"{name}: tensor {path} differs")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the fingerprints here")
    ap.add_argument("--data-prefix", default=str(REPO / "data" / "processed" / "gutenberg_text_document"))
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        lines = compare(before, after)
        print("\n".join(lines) if lines else f"bitwise equal: {', '.join(sorted(before['runs']))}")
        return 1 if lines else 0
    if not Path(args.data_prefix + ".idx").exists():
        sys.exit(f"error: {args.data_prefix}.idx not found; build it (scripts/quickstart.sh) or pass one")
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    )
    record: dict = {
        "commit": git.stdout.strip(),
        "uncommitted_changes": bool(dirty.stdout.strip()),
        "runs": {},
    }
    for name in args.runs:
        record["runs"][name] = fingerprint(name, args.data_prefix)
        r = record["runs"][name]
        print(
            f"{name:8s} scalars {r['scalars_sha256'][:16]} checkpoint {r['checkpoint_sha256'][:16]} "
            f"({r['checkpoint_tensors']} tensors) train {r['final_train_loss']} valid {r['final_valid_loss']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
