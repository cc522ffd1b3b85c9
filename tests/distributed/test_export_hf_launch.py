"""Hugging Face export of real tp 2 x pp 2 checkpoints, one per normalisation scheme (issue 13).

One process group of 4 ranks (started by ``torchrun``, as a user may) trains each scheme for 3 steps
at tensor parallel 2 x pipeline parallel 2 through the trainer (tests/support/train_schemes.py: one
start-up for all runs) and saves DeepSpeed pipeline checkpoints (layer files per TP rank). Each is
exported with ``python -m megaformer.tools.export_hf``, loaded by transformers with
``trust_remote_code=True`` offline, and compared with megaformer's own model of the same checkpoint:
logits within 1e-4 (fp32) and the same greedy continuation as ``megaformer.tools.generate``
(``generate()`` with its KV cache).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.conftest import REPO, free_port

transformers = pytest.importorskip("transformers")

OFF = "model.post_attn_ln=false,model.head_scale=false,model.ffn_ln=false"
SCHEMES = {
    "pre_ln": OFF,
    "normformer": "model.resid_scale=true,model.qkv_ln=true",
    "post_ln": f"model.norm_scheme=post_ln,{OFF}",
    "deepnorm": f"model.norm_scheme=deepnorm,{OFF}",
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


@pytest.fixture(scope="module")
def scheme_runs(gutenberg_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("schemes")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
        f"--master_port={free_port()}", "tests/support/train_schemes.py",
        "configs/normformer-quickstart.yaml", str(root),
        *[f"{name}={spec}" for name, spec in SCHEMES.items()],
        "--", *COMMON, f"data.prefix={gutenberg_prefix}", f"data.index_cache_dir={root / 'cache'}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root


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
    from megaformer.tools.export_hf import main as export_main
    from megaformer.tools.generate import generate, load_for_generation
    from megaformer.tools.reshard import consolidate, resolve_tag_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = str(scheme_runs / scheme / "checkpoints")
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
    n = 20
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
