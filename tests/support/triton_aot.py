"""Compile the kernels of :mod:`megaformer.model.kernels` for an H100/H200 (sm_90) without a GPU and
report ptxas's registers and spills, as JSON on stdout:

    python -m tests.support.triton_aot          # TRITON_INTERPRET must be unset (a GPU build)

Triton 3.6 compiles ahead of time for a stated target (``GPUTarget('cuda', 90, 32)``) through its
own front end, optimiser and the ptxas it ships: the same compiler a lent GPU runs, short of the
device itself. Each case is a kernel with the constants and warps the launchers use for a recipe's
row width (bf16): 125M (FFN 3,072, d 768), 355M (4,096, 1,024), 1.3B (8,192, 2,048), 2.7B (10,240,
2,560). Used by tests/unit/test_triton_kernels_sm90.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

WIDTHS = {"125m": (3072, 768), "355m": (4096, 1024), "1.3b": (8192, 2048), "2.7b": (10240, 2560)}


def _compile(fn, signature: dict, constants: dict, warps: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(
        fn=fn,
        signature={**signature, **{k: "constexpr" for k in constants}},
        constexprs={(names.index(k),): v for k, v in constants.items()},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True
        )
    report = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {
        "warps": warps,
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
    }


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for a GPU", file=sys.stderr)
        return 2
    from megaformer.model import kernels as k

    dt = "*bf16"
    fwd_sig = {
        **{a: dt for a in ("X", "W", "B", "RES", "Y")},
        **{"KEEP": "*u8", "MEAN": "*fp32", "RSTD": "*fp32"},
        **{a: "i32" for a in ("stride_x", "stride_res", "stride_y", "N")},
        **{"eps": "fp32", "scale": "fp32"},
    }
    bwd_sig = {
        **{a: dt for a in ("DY", "X", "W", "DX")},
        **{a: "*fp32" for a in ("MEAN", "RSTD", "SUMS", "DW_PART", "DB_PART")},
        "KEEP": "*u8",
        **{a: "i32" for a in ("stride_dy", "stride_x", "stride_dx", "M", "N")},
        **{"n_full": "fp32", "scale": "fp32"},
    }
    moments_sig = {"X": dt, "MEAN": "*fp32", "M2": "*fp32", "stride_x": "i32", "N": "i32"}
    sums_sig = {
        **{a: dt for a in ("DY", "X", "W")},
        **{a: "*fp32" for a in ("MEAN", "RSTD", "SUMS")},
        **{a: "i32" for a in ("stride_dy", "stride_x", "N")},
    }
    cases = []
    for size, (ffn, d) in WIDTHS.items():
        for what, n, act, post in (("ffn", ffn, k.ACT_GELU, False), ("post_attn", d, k.ACT_NONE, True)):
            block, warps = k._launch_config(n)
            fwd = {"ACT": act, "HAS_STATS": False, "HAS_RES": post, "HAS_KEEP": post, "BLOCK_N": block}
            cases.append((size, what, n, "forward", k._norm_act_fwd_kernel, fwd_sig, fwd, warps))
            block, warps = k._launch_config(n, backward=True)
            bwd = {"ACT": act, "HAS_KEEP": post, "HAS_SUMS": False, "ROWS_PER_PROGRAM": 125, "BLOCK_N": block}
            cases.append((size, what, n, "backward", k._norm_act_bwd_kernel, bwd_sig, bwd, warps))
    # the TP path's kernels, at the 1.3B FFN width split over 2 ranks
    block, warps = k._launch_config(4096)
    apply = {"ACT": k.ACT_GELU, "HAS_STATS": True, "HAS_RES": False, "HAS_KEEP": False, "BLOCK_N": block}
    cases.append(
        ("1.3b/tp2", "ffn", 4096, "forward (statistics given)", k._norm_act_fwd_kernel, fwd_sig, apply, warps)
    )
    cases.append(
        (
            "1.3b/tp2",
            "ffn",
            4096,
            "shard moments",
            k._act_moments_kernel,
            moments_sig,
            {"ACT": 1, "BLOCK_N": block},
            warps,
        )
    )
    cases.append(
        (
            "1.3b/tp2",
            "ffn",
            4096,
            "backward sums",
            k._norm_act_bwd_sums_kernel,
            sums_sig,
            {"ACT": 1, "BLOCK_N": block},
            warps,
        )
    )
    block, warps = k._launch_config(4096, backward=True)
    bwd = {"ACT": k.ACT_GELU, "HAS_KEEP": False, "HAS_SUMS": True, "ROWS_PER_PROGRAM": 125, "BLOCK_N": block}
    cases.append(
        ("1.3b/tp2", "ffn", 4096, "backward (sums given)", k._norm_act_bwd_kernel, bwd_sig, bwd, warps)
    )
    rows = []
    for size, what, n, kind, fn, sig, consts, warps in cases:
        sig = {a: t for a, t in sig.items() if a in fn.arg_names}
        rows.append(
            {"size": size, "op": what, "width": n, "kernel": kind, **_compile(fn, sig, consts, warps)}
        )
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
