"""Hugging Face export of real tp 2 x pp 2 checkpoints, one per normalisation scheme, and held-out
sets in training (issue 13).

One process group of 4 ranks (started by ``torchrun``, as a user may) trains each scheme for 3 steps
at tensor parallel 2 x pipeline parallel 2 through the trainer (tests/support/train_schemes.py: one
start-up for all runs) and saves DeepSpeed pipeline checkpoints (layer files per TP rank). Each is
exported with ``python -m megaformer.tools.export_hf``, loaded by transformers with
``trust_remote_code=True`` offline, and compared with megaformer's own model of the same checkpoint:
logits within 1e-4 (fp32) and the same greedy continuation as ``megaformer.tools.generate``
(``generate()`` with its KV cache).

The same runs carry the held-out options: the Pre-LN run trains on ``data_tools.split``'s train output
with its held-out output as ``data.valid_prefix`` (and the whole corpus as ``data.test_prefix``), and
its validation and test losses equal ``python -m megaformer.tools.evaluate`` on those datasets; the
Post-LN run uses Megatron's ``data.split=90,8,2``.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import REPO, free_port

pytestmark = pytest.mark.slow  # runs through the launcher: outside `scripts/check.sh --fast`

transformers = pytest.importorskip("transformers")

OFF = "model.post_attn_ln=false;model.head_scale=false;model.ffn_ln=false"  # train_schemes.py splits at ;
SCHEMES = {
    "pre_ln": OFF,
    "normformer": "model.resid_scale=true;model.qkv_ln=true",
    "post_ln": f"model.norm_scheme=post_ln;{OFF}",
    "deepnorm": f"model.norm_scheme=deepnorm;{OFF}",
}
COMMON = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_len=48",
    "parallel.tp_size=2",
    "parallel.pp_size=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=3",
    "train.warmup_steps=1",
    "train.log_interval=3",
    "train.eval_interval=3",
    "train.eval_batches=1",
    "train.save_interval=3",
    "train.zero_stage=0",
    "train.deepspeed_config=",
]


SPLIT = "90,8,2"


@pytest.fixture(scope="module")
def heldout(gutenberg_prefix, tmp_path_factory) -> dict[str, str]:
    """``data_tools.split`` of the corpus: train and held-out prefixes, as a user makes them."""
    root = tmp_path_factory.mktemp("split")
    out = {"train": str(root / "train_text_document"), "valid": str(root / "heldout_text_document")}
    cmd = [
        sys.executable, "-m", "data_tools.split", "--data-prefix", gutenberg_prefix,
        "--holdout-tokens", "4000",
        "--holdout-prefix", out["valid"], "--train-prefix", out["train"],
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def scheme_runs(gutenberg_prefix, heldout, tmp_path_factory):
    root = tmp_path_factory.mktemp("schemes")
    runs = dict(SCHEMES)
    runs["pre_ln"] += (
        f";data.prefix={heldout['train']};data.valid_prefix={heldout['valid']};data.test_prefix={gutenberg_prefix}"
    )
    runs["post_ln"] += f";data.split={SPLIT}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
        f"--master_port={free_port()}", "tests/support/train_schemes.py",
        "configs/normformer-quickstart.yaml", str(root),
        *[f"{name}={spec}" for name, spec in runs.items()],
        "--", *COMMON, f"data.prefix={gutenberg_prefix}", f"data.index_cache_dir={root / 'cache'}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root, proc.stdout + proc.stderr


def _greedy_with_generate_cli(ckpt: str, prompt: str, n: int) -> str:
    """The text ``python -m megaformer.tools.generate --temperature 0`` prints after the prompt."""
    from megaformer.tools.generate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(["--checkpoint", ckpt, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n)])
            == 0
        )
    text = out.getvalue().split("\n", 2)[2]  # after the header and the '--- sample 0' line
    return text[:-1]  # print's newline


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tp2_pp2_checkpoint_exports_to_transformers(scheme, scheme_runs, tmp_path, monkeypatch):
    from megaformer.checkpoint.reshard import consolidate, resolve_tag_dir
    from megaformer.tools.export_hf import main as export_main
    from megaformer.tools.generate import generate, load_for_generation

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = str(scheme_runs[0] / scheme / "checkpoints")
    _, saved, info = consolidate(resolve_tag_dir(ckpt))
    assert (info["tp_size"], info["pp_size"], info["step"]) == (2, 2, 3)
    assert any(p.startswith("layer_") for p in os.listdir(resolve_tag_dir(ckpt)))  # pipeline files
    out = str(tmp_path / "hf")
    assert export_main(["--checkpoint", ckpt, "--output", out]) == 0

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert hf.config.norm_scheme == saved["model"]["norm_scheme"]
    model, config, _ = load_for_generation(ckpt)
    text = "It was a bright cold day in April, and the clocks were striking thirteen."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)[..., : config.vocab_size]).abs().max().item()
    assert diff < 1e-4, f"{scheme}: logits differ by {diff}"

    prompt = "It was a bright cold day"
    n = 12
    start = tok(prompt, return_tensors="pt")["input_ids"]
    if scheme == "normformer":  # the command itself once; its function for the other schemes
        ours = _greedy_with_generate_cli(ckpt, prompt, n)
    else:
        ours = prompt + tok.decode(
            generate(model, config, start[0].tolist(), max_new_tokens=n, temperature=0)[0]
        )
    gen = hf.generate(start, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=50256)
    assert gen.shape[1] == start.shape[1] + n
    assert prompt + tok.decode(gen[0, start.shape[1] :]) == ours


def test_valid_and_test_prefix_are_what_training_evaluates(scheme_runs, heldout, gutenberg_prefix):
    """data.valid_prefix (data_tools.split's held-out output, used as is): the run's validation loss is
    ``megaformer.tools.evaluate``'s on that dataset (the first eval_batches x global_batch_size = 4
    samples, TP = 1 in one process against the run's tp 2 x pp 2), and so is its test loss on
    data.test_prefix; training read every document of the train output."""
    import json

    from data_tools.indexed_dataset import IndexedDataset
    from megaformer.tools.evaluate import dataset_loss
    from megaformer.tools.generate import load_for_generation

    root, log = scheme_runs
    summary = json.loads((root / "pre_ln" / "summary.json").read_text())
    model, config, _ = load_for_generation(str(root / "pre_ln" / "checkpoints"))
    valid = dataset_loss(model, heldout["valid"], config.seq_len, max_samples=4)
    test = dataset_loss(model, gutenberg_prefix, config.seq_len, max_samples=4)
    assert abs(summary["final_valid_loss"] - valid["loss"]) < 1e-4, (summary, valid)
    assert abs(summary["final_test_loss"] - test["loss"]) < 1e-4, (summary, test)
    assert abs(valid["loss"] - test["loss"]) > 1e-3  # two different datasets, told apart
    n_train = len(IndexedDataset(heldout["train"]).document_lengths())
    n_valid = len(IndexedDataset(heldout["valid"]).document_lengths())
    assert f"train {n_train} docs" in log and f"valid {n_valid} docs" in log


def test_megatron_split_cuts_train_valid_test_ranges(scheme_runs, gutenberg_prefix):
    """data.split=90,8,2: documents cut into contiguous train / valid / test ranges as Megatron's
    get_train_valid_test_split_; the run logs those counts and reports a test loss."""
    import json

    from data_tools.indexed_dataset import IndexedDataset
    from megaformer.config.load import parse_split
    from megaformer.data.heldout import split_ranges

    root, log = scheme_runs
    n = len(IndexedDataset(gutenberg_prefix).document_lengths())
    train, valid, test = (len(r) for r in split_ranges(n, parse_split(SPLIT)))
    assert train + valid + test == n and min(train, valid, test) > 0
    assert f"train {train} docs" in log and f"valid {valid} docs" in log
    summary = json.loads((root / "post_ln" / "summary.json").read_text())
    assert summary["final_test_loss"] > 0 and summary["final_valid_loss"] != summary["final_test_loss"]


ZERO_SHOT = REPO / "tests" / "fixtures" / "zero_shot"


def test_zero_shot_command_agrees_with_lm_eval_run_directly(scheme_runs, tmp_path, monkeypatch):
    """``python -m megaformer.tools.zero_shot`` on the tp 2 x pp 2 NormFormer checkpoint (megaformer's
    own model through its lm_eval adapter) and ``lm_eval --model hf`` run directly on its export
    (transformers, trust_remote_code), on the same fixture files: the same accuracies on all five
    tasks, and per answer the same log-likelihood (within 1e-3 nats) and greedy flag."""
    import glob
    import json

    from megaformer.tools.export_hf import main as export_main
    from megaformer.tools.zero_shot import PREFIX, TASKS, MegaformerLM
    from megaformer.tools.zero_shot import main as zero_shot_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ckpt = str(scheme_runs[0] / "normformer" / "checkpoints")
    tasks = [f"--task={name}={ZERO_SHOT / name}.jsonl" for name in TASKS]
    ours_json, task_dir = tmp_path / "ours.json", tmp_path / "tasks"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["--checkpoint", ckpt, *tasks, "--task-dir", str(task_dir), "--json", str(ours_json)]
        assert zero_shot_main(args) == 0
    table = out.getvalue()
    assert "| Model | \\|θ\\| (M) | PPL | HS | PI | WG | SC | OB | Avg |" in table
    ours = json.loads(ours_json.read_text())["tasks"]

    export = str(tmp_path / "hf")
    assert export_main(["--checkpoint", ckpt, "--output", export]) == 0
    names = ",".join(PREFIX + name for name in TASKS)
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={export},trust_remote_code=True",
        "--tasks", names, "--include_path", str(task_dir), "--batch_size", "8", "--device", "cpu",
        "--output_path", str(tmp_path / "lm_eval"), "--log_samples",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results_file,) = glob.glob(str(tmp_path / "lm_eval" / "*" / "results_*.json"))
    results = json.loads(Path(results_file).read_text())
    for name in TASKS:
        direct = results["results"][PREFIX + name]
        for metric in ("acc", "acc_norm"):
            if f"{metric},none" in direct:
                assert ours[name][metric] == direct[f"{metric},none"], (name, metric, ours[name], direct)
        assert ours[name]["n"] == 6
    # Per answer: lm_eval's logged (log-likelihood, is_greedy) of each request vs megaformer's adapter.
    lm = MegaformerLM(ckpt)
    for path in glob.glob(str(tmp_path / "lm_eval" / "*" / "samples_*.jsonl")):
        for line in Path(path).read_text().splitlines():
            sample = json.loads(line)
            # Logged as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}.
            args = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
            requests = [type("Req", (), {"args": a}) for a in args]
            mine = lm.loglikelihood(requests, disable_tqdm=True)
            theirs = [(float(r[0][0]), r[0][1] in (True, "True")) for r in sample["resps"]]
            for (a, ga), (b, gb) in zip(mine, theirs, strict=True):
                assert abs(a - b) < 1e-3 and ga == gb, (path, sample["arguments"], mine, theirs)
