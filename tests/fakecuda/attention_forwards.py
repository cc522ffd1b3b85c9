"""Run in a fake-CUDA child by ``test_attention_forwards.py``: a NormFormer block with attention
dropout on the fake GPU named by argv[1], ``model.attention_backend=argv[2]``, compiled by dynamo and
AOTAutograd (``fullgraph=True``; the graphs are recorded and run as they are, since inductor has no
Triton device here), one forward and backward. Prints, as JSON, the calls in the forward and the
backward graph of every attention operator (ours and ATen's), and the eager kernel count."""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch._dynamo.backends.common import aot_autograd

from megaformer.perf.fakecuda.runtime import GPUS, check_shim_loaded, fake_mode, install_cuda_stubs

MARKS = ("attention", "scaled_dot_product")


def main() -> None:
    gpu, backend = sys.argv[1], sys.argv[2]
    check_shim_loaded()
    install_cuda_stubs(GPUS[gpu])
    # lazy: the model's modules import after the CUDA stubs, as in every fake-CUDA child
    from megaformer.config.schema import ModelConfig
    from megaformer.model.normformer import NormFormerBlock
    from megaformer.parallel.rng import DropoutRNG

    seen: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}

    def recorder(phase: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            for node in gm.graph.nodes:
                name = str(node.target)
                if node.op == "call_function" and any(m in name for m in MARKS):
                    if "fused_attention_dropout" in name:  # and the kernel it names
                        name += f" {node.args[5] if phase == 'forward' else node.args[10]}"
                    seen[phase][name] += 1
            return gm

        return compiler

    config = ModelConfig(
        vocab_size=128, hidden_size=256, num_layers=1, num_attention_heads=4, seq_len=64,
        attention_dropout=0.1, hidden_dropout=0.1, attention_backend=backend,
    )  # fmt: skip
    with fake_mode():
        rng = DropoutRNG(5, device=torch.device("cuda"))
        block = NormFormerBlock(config, layer_index=0, dropout_rng=rng).to("cuda", torch.bfloat16).train()
        x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(
            fw_compiler=recorder("forward"), bw_compiler=recorder("backward")
        ))  # fmt: skip
        compiled(x).sum().backward()
    print(json.dumps({phase: dict(c) for phase, c in seen.items()}))


if __name__ == "__main__":
    main()
