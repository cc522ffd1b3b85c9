"""Do compiled and eager blocks draw the same dropout masks and give the same gradients on this device?

    python3 bench/gpu_probe.py [--device cuda] [--json]        # bash scripts/gpu_check.sh runs it

``train.compile`` compiles each decoder block with inductor; its dropout masks come from the same
generator states as eager mode's through two custom operators (``megaformer/parallel/rng_ops.py``).
``tests/unit/test_compiled_block.py`` checks that on the CPU, where inductor writes C++; this probe
checks it where the recipes run, on the GPU (Triton kernels, CUDA's Philox generator, the
attention-dropout operator of the GPU path), in three parts, each eager against compiled from the
same :class:`~megaformer.parallel.rng.DropoutRNG` seed:

* ``dropout``: ``DropoutRNG.dropout`` on a ``[4, 512, 768]`` tensor in fp32 and bf16, both regions:
  the products must be bitwise equal (same mask, same scale) and the states left equal;
* ``attention``: ``DropoutRNG.attention`` (causal, p = 0.1, ``[2, 12, 512, 64]``, the recipes' head
  dimension) in the training dtype, forward and backward: output and q, k, v gradients compared
  (bitwise expected on a GPU: the compiled operator runs eager's own call), states equal;
* ``block``: one NormFormer block of the 125M shape (d 768, 12 heads, FFN 3072, every NormFormer
  switch and ResScale on, hidden and attention dropout 0.1) in fp32 with TF32 off, two
  micro-batches of ``[2, 512, 768]``: output, input gradient and every parameter gradient within
  1e-4 of each tensor's largest magnitude (inductor fuses and reorders reductions, so these are
  close, not bitwise: 7.2e-7 on the CPU; a different mask moves a dropped element by its own size,
  far above the tolerance), and the states left equal (the same number of draws). fp32, not the
  recipes' bf16: there eager rounds after every operation and inductor once per kernel, so the two
  differ by bf16 roundings that a tolerance could not tell from a wrong mask. A negative control
  shows the comparison can fail: the eager block with another dropout seed must differ by more
  than 10× the tolerance.

On a CPU (``--device cpu``, the ``--smoke`` path of ``scripts/gpu_check.sh``) the shapes are tiny and
the dtype fp32, to check this script. Prints one ``RESULT {json}`` line (``--json``) or a summary;
exit status 0 when every part agrees, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Relative tolerances, of each tensor's largest magnitude. fp32 (the block): the CPU test's 1e-5
# (7.2e-7 measured there) with room for the GPU's reduction orders; bf16 (the attention part, which
# is expected bitwise anyway): a few units of bf16's 2^-8 rounding.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def _max_rel(got, want) -> float:
    """max |got - want| / max |want| (in fp32), 0 for equal tensors."""
    got, want = got.float(), want.float()
    scale = float(want.abs().max().clamp_min(1e-30))
    return float((got - want).abs().max()) / scale


def _states_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def probe_dropout(device, dtypes, shape) -> dict:
    """``DropoutRNG.dropout`` eager against compiled: bitwise products and equal states, per dtype."""
    import torch

    from megaformer.parallel.rng import DropoutRNG

    def draw(rng, x, y):
        return [rng.dropout(x, 0.1, "replicated"), rng.dropout(y, 0.3, "sharded")]

    out = {}
    for dtype in dtypes:
        torch._dynamo.reset()
        gen = torch.Generator(device="cpu").manual_seed(1)
        x, y = (t.to(device=device, dtype=dtype) for t in torch.randn(2, *shape, generator=gen))
        eager_rng, compiled_rng = (
            DropoutRNG(7, tp_rank=1, device=device),
            DropoutRNG(7, tp_rank=1, device=device),
        )
        eager = draw(eager_rng, x, y)
        compiled = torch.compile(draw, fullgraph=True, dynamic=False)(compiled_rng, x, y)
        bitwise = all(torch.equal(g, w) for g, w in zip(compiled, eager, strict=True))
        states = _states_equal(compiled_rng.state_dict(), eager_rng.state_dict())
        dropped = float((eager[0] == 0).float().mean())
        out[str(dtype).removeprefix("torch.")] = {
            "bitwise": bitwise,
            "states_equal": states,
            "dropped_fraction": dropped,  # ~0.1: a mask was drawn at all
            "ok": bitwise and states and 0.05 < dropped < 0.15,
        }
    return out


def probe_attention(device, dtype, shape) -> dict:
    """``DropoutRNG.attention`` (causal, p 0.1) eager against compiled: output and q, k, v gradients."""
    import torch

    from megaformer.parallel.rng import DropoutRNG

    torch._dynamo.reset()
    gen = torch.Generator(device="cpu").manual_seed(3)
    base = [t.to(device=device, dtype=dtype) for t in torch.randn(4, *shape, generator=gen)]
    grad = base.pop()

    def core(rng, q, k, v):
        return rng.attention(q, k, v, 0.1, "sharded", is_causal=True)

    results = {}
    for name, fn in (("eager", core), ("compiled", torch.compile(core, fullgraph=True, dynamic=False))):
        rng = DropoutRNG(11, device=device)
        q, k, v = (t.clone().requires_grad_() for t in base)
        y = fn(rng, q, k, v)
        y.backward(grad)
        results[name] = ([y.detach(), q.grad, k.grad, v.grad], rng.state_dict())
    (eager, eager_states), (compiled, compiled_states) = results["eager"], results["compiled"]
    max_rel = max(_max_rel(g, w) for g, w in zip(compiled, eager, strict=True))
    states = _states_equal(compiled_states, eager_states)
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(shape),
        "bitwise": all(torch.equal(g, w) for g, w in zip(compiled, eager, strict=True)),
        "max_rel_diff": max_rel,
        "states_equal": states,
        "ok": states and max_rel <= tol,
    }


def probe_block(device, dtype, model_config, batch: int, seq: int) -> dict:
    """One NormFormer block eager against compiled (``compile_blocks``), two micro-batches; and, as
    a negative control, eager against eager with another dropout seed (other masks): the comparison
    must tell those apart, by more than 10× its tolerance."""
    import torch

    from megaformer.model import compile_blocks
    from megaformer.model.normformer import NormFormerBlock
    from megaformer.parallel.rng import DropoutRNG

    torch._dynamo.reset()
    failures: list[str] = []

    def run(compiled: bool, dropout_seed: int = 5):
        rng = DropoutRNG(dropout_seed, device=device)
        block = NormFormerBlock(model_config, 0, None, seed=3, dropout_rng=rng).to(device=device, dtype=dtype)
        block.train()
        if compiled:
            compile_blocks(block, log=failures.append)
        gen = torch.Generator(device="cpu").manual_seed(0)
        tensors = []
        for _ in range(2):  # the second micro-batch draws from the states the first left
            x = torch.randn(batch, seq, model_config.hidden_size, generator=gen).to(
                device=device, dtype=dtype
            )
            x.requires_grad_()
            y = block(x)
            (y * torch.randn(y.shape, generator=gen).to(device=device, dtype=dtype)).sum().backward()
            tensors += [y.detach(), x.grad]
        names = ["output", "input grad"] * 2 + [f"grad {n}" for n, _ in block.named_parameters()]
        return names, tensors + [p.grad for p in block.parameters()], rng.state_dict()

    names, eager, eager_states = run(compiled=False)
    _, other_masks, _ = run(compiled=False, dropout_seed=6)
    _, compiled, compiled_states = run(compiled=True)
    diffs = {}
    for name, g, w in zip(names, compiled, eager, strict=True):
        diffs[name] = max(diffs.get(name, 0.0), _max_rel(g, w))
    worst = max(diffs, key=diffs.get)
    states = _states_equal(compiled_states, eager_states)
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    control = _max_rel(other_masks[0], eager[0])  # the output under other masks
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "shape": [batch, seq, model_config.hidden_size],
        "other_masks_output_max_rel_diff": control,
        "compile_failures": failures,
        "states_equal": states,
        "max_rel_diff": diffs[worst],
        "worst_tensor": worst,
        "output_max_rel_diff": diffs["output"],
        "tolerance": tol,
        "ok": not failures and states and diffs[worst] <= tol and control > 10 * tol,
    }


def run_probe(device_name: str) -> dict:
    """Every part on ``device_name`` ("cuda": the recipes' shapes, attention in bf16, the block in
    fp32; "cpu": tiny shapes, fp32)."""
    import torch

    from megaformer.config import load_config
    from megaformer.model.compile import why_not_compiled

    device = torch.device(device_name)
    t0 = time.perf_counter()
    why = why_not_compiled(device)
    if why:
        return {"device": device_name, "ok": False, "error": f"cannot compile here: {why}"}
    cfg = load_config(
        str(REPO / "configs" / "paper" / "125m-normformer.yaml"),
        ["model.resid_scale=true", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"],
    ).model
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parts compare fp32 products
        torch.backends.cudnn.allow_tf32 = False
        dtype, attn_shape, drop_shape, batch, seq = torch.bfloat16, (2, 12, 512, 64), (4, 512, 768), 2, 512
        block_dtype = torch.float32
    else:  # the script's CPU check: tiny shapes, fp32 (inductor's C++ backend)
        cfg = dataclasses.replace(cfg, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128)
        dtype, attn_shape, drop_shape, batch, seq = torch.float32, (2, 4, 16, 8), (2, 16, 32), 2, 16
        block_dtype = torch.float32
    result: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    parts = {
        "dropout": lambda: probe_dropout(device, [torch.float32, torch.bfloat16], drop_shape),
        "attention": lambda: probe_attention(device, dtype, attn_shape),
        "block": lambda: probe_block(device, block_dtype, cfg, batch, seq),
    }
    for name, part in parts.items():
        try:
            result[name] = part()
        except Exception as e:  # one part's failure is reported, the others still run
            result[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
            }
    dropout_ok = (
        all(v.get("ok") for v in result["dropout"].values()) if "error" not in result["dropout"] else False
    )
    result["ok"] = dropout_ok and result["attention"]["ok"] and result["block"]["ok"]
    result["wall_s"] = time.perf_counter() - t0
    return result


def summary(result: dict) -> str:
    """One line per part: what was compared and whether it agreed (parts missing from ``result``,
    e.g. a probe stopped by its time limit, are left out)."""
    verdict = "compiled = eager" if result.get("ok") else "NOT SHOWN EQUAL"
    lines = [f"probe on {result.get('device', '?')}: {verdict}"]
    if "error" in result:
        lines.append(f"  error: {result['error']}")
    for dtype, r in (result.get("dropout") or {}).items():
        if dtype == "error" or not isinstance(r, dict):
            lines.append(f"  dropout: error {r}")
            continue
        lines.append(
            f"  dropout {dtype}: bitwise {r['bitwise']}, states equal {r['states_equal']}, "
            f"dropped {r['dropped_fraction']:.3f}"
        )
    for part in ("attention", "block"):
        r = result.get(part)
        if not r:
            continue
        if "error" in r:
            lines.append(f"  {part}: error {r['error']}")
            continue
        extra = (
            f", worst {r['worst_tensor']}; other masks: {r['other_masks_output_max_rel_diff']:.2e}"
            if part == "block"
            else f", bitwise {r['bitwise']}"
        )
        lines.append(
            f"  {part} {r['dtype']} {r['shape']}: max rel diff {r['max_rel_diff']:.2e}{extra}, "
            f"states equal {r['states_equal']}, {'ok' if r['ok'] else 'NOT OK'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--json", action="store_true", help="print one RESULT {json} line")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run_probe(device)
    print(summary(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
