"""The layers of the NormFormer decoder LM (Shleifer, Weston & Ott 2021, arXiv:2110.09456) and of
its Pre-LN baseline; :mod:`megaformer.model.lm` lists them into the one model.

One decoder layer (paper Fig. 1, Sec. 2), with NormFormer's additions in capitals::

    h = x + POSTATTN_LN( HeadScaleMHA( LN1(x) ) )
    y = RESID_SCALE ∘ h + W2 · FFN_LN( act( W1 · LN2(h) + b1 ) ) + b2
    HeadScaleMHA = Concat(g_1 head_1, ..., g_n head_n) · W_O        (g_i learned, init 1)
    fairseq's code (head_scale_position='after_out_proj'): (Concat(head_i) · W_O + b_O) ∘ repeat(g, d/n)

Each capital is a switch of :class:`~megaformer.config.schema.ModelConfig`; all off is the Pre-LN GPT
baseline. ``qkv_ln`` adds the paper's Table 4 ablation "+ 3 More LN" (:class:`QKVLayerNorm`), and
``norm_scheme`` swaps the Pre-LN layer for the other schemes the paper compares against::

    post_ln   (Vaswani et al. 2017; fairseq normalize_before=False; NormFormer paper Eq. 1):
        h = LN1(x + MHA(x)),            y = LN2(h + W2 · act(W1 · h + b1) + b2)
    deepnorm  (Wang et al. 2022, "DeepNet", arXiv:2203.00555, Sec. 2.2 / Fig. 2, decoder-only):
        h = LN1(α·x + MHA(x)),          y = LN2(α·h + W2 · act(W1 · h + b1) + b2)
        α = (2N)^(1/4); W_V, W_O, W1, W2 drawn with std β·init_std, β = (8N)^(-1/4); N = num_layers

Under both, the last block's output is already a LayerNorm's, so there is no final LayerNorm (fairseq
and torchscale build their decoder's final ``layer_norm`` only when ``normalize_before``):
:class:`FinalNorm` is then an identity without parameters, kept in the layer plan so that the output
projection keeps its index (and checkpoint name) for every scheme. The embedding is the same for every
scheme (no embedding LayerNorm: fairseq's and torchscale's ``layernorm_embedding`` defaults to off).

Built from the tensor-parallel layers of :mod:`megaformer.parallel`, so the same code runs at any TP
degree and computes the same function (heads, ``g`` and the q/k/v LayerNorms' gains split across
ranks, FFN_LN and the q/k/v LayerNorms reducing their statistics across ranks, POSTATTN_LN and the
Post-LN / DeepNorm LayerNorms replicated after the row-parallel reduce).

The pieces, in model order: :class:`NormFormerEmbedding` (tokens to the first hidden state),
:class:`NormFormerBlock` (one decoder layer), :class:`FinalNorm` (the LayerNorm after the last block),
then the output projection to vocabulary-sharded logits: :func:`tied_output_logits` (the token
embedding's weight, ``tie_embeddings``) or :class:`OutputProjection` (a separate weight), and
:class:`LMLoss` (vocabulary-parallel cross-entropy of those logits).

With ``sequence_parallel`` (Korthikanti et al. 2022, arXiv:2205.05198) the residual stream, every
replicated LayerNorm, ResScale and the hidden dropout work on ``[B, T / tp, d]`` sequence slices;
the row-parallel reduces become reduce-scatters and the copies before column-parallel layers
all-gathers. The function computed is the same. Dropout draws from a
:class:`~megaformer.parallel.rng.DropoutRNG`: the same mask on every TP rank where activations are
replicated, different masks where they are sharded (attention probabilities of the local heads,
sequence slices).

Initialisation follows ``model.init``: ``legacy`` (the default: fairseq's unit-scale embedding with
GPT-2's 0.02 matrices, a mix whose initial loss is ~23 nats at the 125M shape against ln V = 10.8),
``gpt2`` (nanoGPT / HF GPT-2) or ``fairseq`` (transformer_lm, the paper's); the docstring of
``ModelConfig.init`` lists each tensor with its source. NormFormer's own parameters (HeadScale
``g`` = 1, ResScale ``λ`` = 1, LayerNorms γ = 1, β = 0) are the same under all three.

Every parameter's full tensor is drawn from a generator seeded by the base seed and a fixed name
(``embedding.token``, ``embedding.position``, ``layers.<i>.<sub-layer>``, ``output``; see
:func:`~megaformer.parallel.utils.derive_seed`), so a layer built on its own (by a pipeline stage)
equals the same layer built inside the whole model, at any TP degree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megaformer.config.load import check_model_config
from megaformer.config.schema import ModelConfig
from megaformer.data.mlm import IGNORE_INDEX, max_masked_positions
from megaformer.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayerNorm,
    VocabParallelEmbedding,
    copy_to_tp_region,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel.layers import sequence_region_param
from megaformer.parallel.mappings import gather_from_sequence_region, sum_across_tp_region
from megaformer.parallel.rng import DropoutRNG
from megaformer.parallel.utils import (
    InitSpec,
    derive_seed,
    divide,
    mark_no_weight_decay,
    mark_parallel,
    mark_replicated,
    normal_full,
    shard,
    tp_rank,
    tp_world_size,
)


def fused_kernels_available() -> bool:
    """Whether ``model.fused_kernels='auto'`` may use the Triton kernels: Triton is installed and
    this is not a fake-CUDA dry run (tensors without values; :mod:`megaformer.perf.fakecuda`)."""
    if "megaformer.perf.fakecuda.runtime" in sys.modules:
        return False
    return importlib.util.find_spec("triton") is not None


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNorm's residual weight for a decoder-only model, ``α = (2N)^(1/4)`` (Wang et al. 2022,
    arXiv:2203.00555, Fig. 2 / Table 1, "decoder-only"; torchscale ``math.pow(2.0 * layers, 0.25)``)."""
    return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNorm's init gain for W_V, W_O, W1, W2 in a decoder-only model, ``β = (8N)^(-1/4)`` (Wang et
    al. 2022, Fig. 2 / Table 1; torchscale divides those weights by ``math.pow(8.0 * layers, 0.25)``)."""
    return (8.0 * num_layers) ** -0.25


def block_inits(config: ModelConfig) -> tuple[dict[str, tuple[InitSpec, InitSpec | None]], float]:
    """The init of one block's matrices under ``config.init`` and ``config.norm_scheme``.

    Returns ``({name: (weight init, bias init or None for zeros)}, v_scale)`` for ``qkv``,
    ``out_proj``, ``fc1``, ``fc2``; ``v_scale`` multiplies the V rows of the drawn ``qkv`` weight
    and bias (DeepNorm's β on W_V; 1 otherwise). Each init is that of the FULL tensor (see
    :class:`~megaformer.parallel.utils.InitSpec`), so TP shards and pipeline stages agree.

    ``legacy`` / ``gpt2``: ``N(0, init_std²)``, W_O and W2 over ``sqrt(2N)`` under ``pre_ln``
    (GPT-2; nanoGPT ``c_proj``), β-scaled W_V, W_O, W1, W2 under ``deepnorm``, plain under
    ``post_ln``; biases 0. ``fairseq``: q, k, v ``xavier_uniform_(gain=1/sqrt(2))`` on each d × d block
    (bound ``sqrt(3 / (2d))``; the three blocks have the same shape, hence one bound for the fused
    weight) with ``nn.Linear``'s default bias ``U(±1/sqrt(d))``; W_O ``xavier_uniform_`` (bound
    ``sqrt(3/d)``), bias 0; W1, W2 and their biases ``nn.Linear``'s default ``U(±1/sqrt(fan_in))``;
    under ``deepnorm`` the V rows, W_O, W1, W2 and their biases times β (torchscale's
    ``p.data.div_((8N)^(1/4))`` over the parameters named v_proj / out_proj / fc1 / fc2).
    """
    d, ffn, n = config.hidden_size, config.ffn_size, config.num_layers
    beta = deepnorm_beta(n) if config.norm_scheme == "deepnorm" else 1.0
    if config.init == "fairseq":
        fc1 = InitSpec("uniform", beta / math.sqrt(d))  # nn.Linear's default (weight and bias), times β
        fc2 = InitSpec("uniform", beta / math.sqrt(ffn))
        inits = {
            "qkv": (InitSpec("uniform", math.sqrt(3.0 / (2 * d))), InitSpec("uniform", 1 / math.sqrt(d))),
            "out_proj": (InitSpec("uniform", beta * math.sqrt(3.0 / d)), None),
            "fc1": (fc1, fc1),
            "fc2": (fc2, fc2),
        }
        return inits, beta
    std = config.init_std
    if config.norm_scheme == "pre_ln":
        # GPT-2 (Radford et al. 2019, Sec. 2.3): scale the init of the layers that write into the
        # residual stream (W_O, W2) by 1/sqrt(2·num_layers), two per layer, so the residual
        # variance does not grow with depth.
        v_scale, fc1_std, residual_std = 1.0, std, std / math.sqrt(2 * n)
    elif config.norm_scheme == "deepnorm":
        # DeepNet (Wang et al. 2022, Fig. 2): W_V, W_O, W1, W2 scaled by β; W_Q, W_K not.
        v_scale, fc1_std, residual_std = beta, beta * std, beta * std
    else:  # post_ln: each sublayer's output is re-normalised; no depth-dependent init
        v_scale, fc1_std, residual_std = 1.0, std, std
    inits = {
        "qkv": (InitSpec("normal", std), None),
        "out_proj": (InitSpec("normal", residual_std), None),
        "fc1": (InitSpec("normal", fc1_std), None),
        "fc2": (InitSpec("normal", residual_std), None),
    }
    return inits, v_scale


class ReplicatedLayerNorm(nn.LayerNorm):
    """LayerNorm over the (unsharded) hidden dimension, its parameters replicated on every TP rank.

    Under sequence parallelism the input is this rank's slice of the sequence and the gain / shift
    gradients are summed across the TP group (see
    :func:`~megaformer.parallel.layers.sequence_region_param`). Parameters are tagged replicated and
    no-decay. Shapes: ``[..., size]`` -> same.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(size, eps=eps)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            mark_no_weight_decay(mark_replicated(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sequence_region_param(self.weight, self.tp_group, self.sequence_parallel)
        bias = sequence_region_param(self.bias, self.tp_group, self.sequence_parallel)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class QKVLayerNorm(nn.Module):
    """The paper's "+ 3 More LN" (Table 4, Sec. 5): LayerNorm on the query, the key and the value
    features, three independent LayerNorms, each over its full ``hidden_size`` features.

    Why the full width, not per head: the paper says only "applying LN to the query, key and value
    features" and no released fairseq / metaseq code has the option, so we follow the shape of the
    paper's other additions in its fairseq code base: a LayerNorm over the whole output of a
    projection (POSTATTN_LN over W_O's d outputs, FFN_LN over W1's whole intermediate), i.e. over
    fairseq's ``q_proj(x)`` / ``k_proj(x)`` / ``v_proj(x)`` (``[T, B, d]``) before its split into
    heads. (A per-head LayerNorm over ``head_dim``, the later QK-norm of Dehghani et al. 2023, is a
    different function.)

    Under tensor parallelism each rank holds the q, k, v features of its own heads, so, as for
    FFN_LN (:func:`~megaformer.parallel.layers.sharded_layer_norm`), the per-token statistics of
    each of q, k and v (fp32) are reduced across the TP group (forward and backward): the function
    is the same at every TP degree. The variance is
    computed in two passes (the mean first, then the mean of squared deviations, each summed across
    the group), never as ``E[x²] − E[x]²``, which loses every digit in fp32 when the mean is large
    against the spread. Without a TP group ``F.layer_norm`` does it in one fused kernel.

    Parameters: ``weight`` (init 1) and ``bias`` (init 0), ``float32[3·d / tp]``, laid out like the
    fused ``qkv`` projection's rows and bias (``[heads, 3, head_dim]``: per head its q, k, v gains),
    hence sharded along dim 0 with the heads (``partition_dim=0``, as ``qkv.bias``), no weight decay.

    Shapes: ``qkv: float[B, T, 3·d / tp]`` (the fused projection's output, rows ordered
    ``[local heads, 3, head_dim]``) -> same shape and dtype.

    Raises:
        ValueError: heads not dividing by the TP size.
    """

    def __init__(
        self, num_heads: int, head_dim: int, eps: float, *, tp_group: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_heads_per_partition = divide(num_heads, tp_world_size(tp_group))
        self.head_dim = head_dim
        self.hidden_size = num_heads * head_dim  # each of q, k, v is normalised over this many features
        self.eps = eps
        local = self.num_heads_per_partition * 3 * head_dim
        self.weight = nn.Parameter(torch.ones(local))
        self.bias = nn.Parameter(torch.zeros(local))
        for p in (self.weight, self.bias):
            mark_no_weight_decay(mark_parallel(p, partition_dim=0))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        nh, hs = self.num_heads_per_partition, self.head_dim
        weight, bias = self.weight.float().view(nh, 3, hs), self.bias.float().view(nh, 3, hs)
        x = qkv.float().unflatten(-1, (nh, 3, hs))  # (B, T, nh, 3, hs)
        if tp_world_size(self.tp_group) == 1:
            # One fused kernel over each of q, k, v: (B, T, 3, nh·hs), normalised, back to the layout.
            by_feature = x.transpose(-3, -2).flatten(-2)  # (B, T, 3, d)
            normed = F.layer_norm(by_feature, (self.hidden_size,), eps=self.eps)
            y = normed.unflatten(-1, (nh, hs)).transpose(-3, -2) * weight + bias  # (B, T, nh, 3, hs)
            return y.flatten(-3).to(qkv.dtype)
        # Two passes, each summed over the TP group (all heads of q, k and v): mean, then variance.
        mean = sum_across_tp_region(x.sum(dim=(-3, -1)), self.tp_group) / self.hidden_size  # (B, T, 3)
        centred = x - mean.unsqueeze(-2).unsqueeze(-1)  # (B, T, nh, 3, hs)
        var = sum_across_tp_region((centred * centred).sum(dim=(-3, -1)), self.tp_group) / self.hidden_size
        inv = torch.rsqrt(var + self.eps).unsqueeze(-2).unsqueeze(-1)  # (B, T, 1, 3, 1)
        return (centred * inv * weight + bias).flatten(-3).to(qkv.dtype)  # (B, T, nh·3·hs)

    def extra_repr(self) -> str:
        return f"3 x {self.hidden_size}, heads_per_partition={self.num_heads_per_partition}, eps={self.eps}"


def _dropout(x: torch.Tensor, p: float, training: bool, rng: DropoutRNG, region: str) -> torch.Tensor:
    """``F.dropout`` drawing its mask from ``rng``'s ``region`` (no fork when it is a no-op)."""
    if not training or p == 0.0:
        return x
    return rng.dropout(x, p, region)


def sinusoidal_positions(num_positions: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal position table (Vaswani et al. 2017, Sec. 3.5), ``float32[num_positions, dim]``.

    Laid out as ``[sin(p·ω_0) … sin(p·ω_{k-1}) | cos(p·ω_0) … cos(p·ω_{k-1})]`` with
    ``ω_i = 10000^(-i/(k-1))``, ``k = dim // 2``, as fairseq's ``SinusoidalPositionalEmbedding`` (the
    NormFormer paper's code base); an odd ``dim`` gets a zero last column.
    """
    half = dim // 2
    step = math.log(10000.0) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)  # (half,)
    angles = torch.arange(num_positions, dtype=torch.float32).unsqueeze(1) * freqs  # (P, half)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # (P, 2·half)
    if dim % 2 == 1:
        table = F.pad(table, (0, 1))  # (P, dim)
    return table


class NormFormerEmbedding(nn.Module):
    """Tokens to the first hidden state: vocab-parallel token embedding, times sqrt(d) when
    ``scale_embedding`` (fairseq, the paper's code base), plus positions, then dropout
    ``embedding_dropout`` (fairseq's ``dropout_module`` on the embedding; 0 by default) drawn from
    ``dropout_rng``. Init per ``model.init``: token table ``N(0, token_embedding_std²)`` (d^-0.5 for
    legacy / fairseq, init_std for gpt2), learned positions ``N(0, init_std²)`` (legacy, gpt2) or
    ``N(0, 1/d)`` (fairseq).

    Shapes: ``tokens: LongTensor[B, T]`` (``T <= seq_len``) -> ``float32[B, T, d]``, replicated; with
    ``sequence_parallel``, ``[B, T / tp, d]``, this rank's slice of the sequence. The token table is
    ``token.weight``, ``float32[V_pad / tp, d]`` (read again by :func:`tied_output_logits`).

    Under ``model.objective`` mlm it also holds RoBERTa's LM head, ``lm_head``
    (:class:`MaskedLMHead`, used by :func:`masked_lm_logits`, not by :meth:`forward`): the head's
    decoder is this table, so the two are one module of the layer plan (one tied entry).

    The config's rules are checked once, by :func:`megaformer.model.model_layers` (the model's
    plan), not again here.

    Raises:
        ValueError: (forward) more than ``seq_len`` tokens, or, with sequence parallelism, a length
            not divisible by the TP size.
    """

    # Parameters (relative names) whose dim 0 is the padded vocabulary.
    VOCAB_PARAMS = ("token.weight",)

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
        dropout_rng: DropoutRNG | None = None,
    ):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        self.dropout_rng = dropout_rng or DropoutRNG(seed, tp_rank=tp_rank(tp_group))
        d = config.hidden_size
        self.token = VocabParallelEmbedding(
            config.padded_vocab_size(tp_world_size(tp_group)),
            d,
            tp_group=tp_group,
            init_std=config.token_embedding_std,
            seed=derive_seed(seed, "embedding.token"),
            num_valid_embeddings=config.vocab_size,
            sequence_parallel=self.sequence_parallel,
        )
        if config.position_embedding == "learned":
            # fairseq's LearnedPositionalEmbedding: N(0, d^-0.5); GPT-2 / legacy: N(0, init_std).
            std = d**-0.5 if config.init == "fairseq" else config.init_std
            full = normal_full((config.seq_len, d), std, derive_seed(seed, "embedding.position"))
            self.position = mark_replicated(nn.Parameter(full))
        else:
            # Fixed, so not saved in checkpoints (persistent=False) and not a parameter.
            # fairseq numbers positions from padding_idx + 1 (model.position_offset = 2): the table
            # has seq_len + offset rows and token t reads row t + offset.
            table = sinusoidal_positions(config.seq_len + config.position_offset, d)[config.position_offset :]
            self.register_buffer("position", table, persistent=False)
        self.scale = math.sqrt(d) if config.scale_embedding else 1.0
        # The masked LM's head lives with the table it decodes with (read by masked_lm_logits).
        self.lm_head = (
            MaskedLMHead(config, tp_group=tp_group, seed=seed, sequence_parallel=self.sequence_parallel)
            if config.objective == "mlm"
            else None
        )
        # The first pipeline stage's copy of the module (the embedding: it never runs lm_head) sets
        # this (megaformer.pipeline.build_pipeline_module): forward then makes lm_head's
        # gradients zeros rather than None, so that DeepSpeed's all-reduce of the tied gradients
        # (embedding_tied_weights) finds a tensor on both stages.
        self.head_grads_here = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[-1]
        if seq_len > self.config.seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds model.seq_len={self.config.seq_len}")
        positions = self.position[:seq_len]  # (T, d)
        if self.sequence_parallel:
            tp = tp_world_size(self.tp_group)
            if seq_len % tp != 0:
                raise ValueError(
                    f"sequence parallelism splits the {seq_len} tokens of a sequence across "
                    f"tp_size={tp} ranks; use a length divisible by {tp}"
                )
            local = seq_len // tp
            # Learned positions: each rank's gradient fills only its own rows; the all-reduce of
            # the whole table (before slicing) assembles the full gradient on every rank.
            positions = sequence_region_param(positions, self.tp_group, True)
            positions = positions[tp_rank(self.tp_group) * local :][:local]  # (T/tp, d), own tokens
        x = self.token(tokens) * self.scale  # (B, T, d), or (B, T/tp, d) with sequence parallelism
        # The sinusoidal table is a buffer, which DeepSpeed's bf16/fp16 conversion (ZeRO-3 in
        # particular) leaves in fp32: follow the embedding's dtype.
        x = x + positions.to(x.dtype)
        # fairseq's dropout on the embedding output; replicated across TP ranks (the same mask on
        # each), or this rank's own tokens under sequence parallelism (its own mask).
        region = "sharded" if self.sequence_parallel else "replicated"
        x = _dropout(x, self.config.embedding_dropout, self.training, self.dropout_rng, region)
        if self.head_grads_here and self.lm_head is not None and torch.is_grad_enabled():
            # + 0 · (one element of each head parameter): the values are unchanged, the head's
            # parameters join the graph and get zero gradients.
            anchor = torch.stack([p.reshape(-1)[0] for p in self.lm_head.parameters()]).sum()
            x = x + 0.0 * anchor.to(x.dtype)
        return x


class NormFormerBlock(nn.Module):
    """One decoder layer: NormFormer (paper Fig. 1 middle) or, with every switch off, Pre-LN; or a
    Post-LN / DeepNorm layer (``norm_scheme``, formulas in the module docstring).

    LayerNorms: ``ln1`` belongs to the attention sublayer and ``ln2`` to the FFN sublayer in every
    scheme: before the sublayer under ``pre_ln``, after its residual sum under ``post_ln`` and
    ``deepnorm`` (so the parameter names are the same for every scheme).

    Init (``model.init``; every tensor drawn full from its seed name; see :func:`block_inits`). Under
    ``fairseq`` (the paper's code base): q, k, v ``xavier_uniform_(gain=1/sqrt(2))`` per d × d block,
    biases ``U(±1/sqrt(d))``; W_O ``xavier_uniform_``, bias 0; W1, W2 and biases ``nn.Linear``'s default
    ``U(±1/sqrt(fan_in))``; under ``deepnorm`` W_V, W_O, W1, W2 and their biases times β (torchscale).
    Under ``legacy`` and ``gpt2`` (the same blocks; they differ in the embedding) every weight is
    ``N(0, std²)``, biases 0:

    - ``pre_ln``: ``init_std``; W_O and W2 ``init_std / sqrt(2N)`` (GPT-2, Radford et al. 2019,
      Sec. 2.3: the Pre-LN residual stream sums 2N sublayer outputs).
    - ``post_ln``: ``init_std`` for every matrix: the residual stream is re-normalised after every
      sublayer, and fairseq's Post-LN Transformer has no depth-dependent init either.
    - ``deepnorm``: W_Q, W_K ``init_std``; W_V, W_O, W1, W2 ``β · init_std``, ``β = (8N)^(-1/4)``.
      β times this project's init, not the paper's pseudo-code ``xavier_normal_(w, gain=β)``: this
      is what torchscale (the DeepNet authors' code) does — it divides its own init of ``v_proj``,
      ``out_proj``, ``fc1``, ``fc2`` by ``(8N)^(1/4)`` — and it keeps ``init_std`` the one scale
      knob of every scheme (for ``init_std`` near Xavier's ``sqrt(2 / (fan_in + fan_out))``, e.g. 0.02
      at d = 1024 to 2048, the two agree). The V rows of the fused QKV weight are scaled after the
      draw, elementwise, so the weights are the same at every TP degree.

    Args:
        config: the model configuration (``norm_scheme``, ``qkv_ln`` and the switches
            ``post_attn_ln``, ``head_scale``, ``ffn_ln``, ``resid_scale``).
        layer_index: position of this layer (0-based); names its parameters' seeds, so a layer built
            on its own (e.g. by a pipeline stage) equals the same layer built inside the full model.
        tp_group: tensor-parallel group, or None. Heads, HeadScale ``g``, the q/k/v LayerNorms, W1
            and FFN_LN are split across it; LN1, LN2, POSTATTN_LN and ResScale ``λ`` are replicated.
        seed: the model's base seed.
        sequence_parallel: the block's input and output are sequence slices ``[B, T / tp, d]``.
        dropout_rng: generator states for dropout; None builds one from ``seed`` and the TP rank.

    Shapes: ``x: float[B, T, d]`` -> ``float[B, T, d]``, replicated on every TP rank (or
    ``[B, T / tp, d]`` -> ``[B, T / tp, d]`` with ``sequence_parallel``).

    Raises:
        ConfigError: a config the loader would refuse (:func:`megaformer.config.load.check_model_config`).
        ValueError: when the heads or the FFN width do not divide by the TP size.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        *,
        sequence_parallel: bool = False,
        dropout_rng: DropoutRNG | None = None,
    ) -> None:
        super().__init__()
        check_model_config(config)  # built alone (tests, tools): the loader's rules still hold
        self.config = config
        self.layer_index = layer_index
        d = config.hidden_size
        tp_size = tp_world_size(tp_group)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.dropout_rng = dropout_rng or DropoutRNG(seed, tp_rank=tp_rank(tp_group))
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.head_dim = config.head_dim
        self.norm_scheme = config.norm_scheme
        # model.objective: causal self-attention for the causal LM, none (bidirectional) for the MLM.
        self.is_causal = config.objective == "clm"
        # DeepNorm's α weights the residual inside the post-sublayer LayerNorm; 1 otherwise.
        self.alpha = deepnorm_alpha(config.num_layers) if config.norm_scheme == "deepnorm" else 1.0
        inits, v_scale = block_inits(config)  # model.init x norm_scheme (see block_inits)
        self._build_attention(config, inits, v_scale, seed)
        self._build_ffn(config, inits, seed)
        # Selective recomputation of the attention core (train.recompute=selective; set by
        # megaformer.model.set_selective_recompute after the model is built).
        self.recompute_core_attention = False
        # bool[B, T], False at padded keys, while :func:`padded_keys` holds it (fine-tuning on
        # padded batches of sentences); None: every key is attended (training's packed blocks).
        self.key_padding_mask: torch.Tensor | None = None
        if config.resid_scale:
            lam = nn.Parameter(torch.ones(d))  # paper Sec. 2: λ_resid initialised to 1
            self.resid_scale = mark_no_weight_decay(mark_replicated(lam))
        else:
            self.register_parameter("resid_scale", None)

    def _seed_of(self, seed: int, name: str) -> int:
        """The seed of this layer's parameter ``name``: derived from its global name, so a
        parameter's initial value does not depend on the layout (TP degree, pipeline stage)."""
        return derive_seed(seed, f"layers.{self.layer_index}.{name}")

    def _build_attention(self, config: ModelConfig, inits: dict, v_scale: float, seed: int) -> None:
        """LN1, the fused QKV (V rows scaled by ``v_scale``), the q/k/v LayerNorms, HeadScale, W_O
        and POSTATTN_LN, in this order (the order of the state dict and of the optimizer's groups)."""
        d, tp_group, sp = config.hidden_size, self.tp_group, self.sequence_parallel
        tp_size = tp_world_size(tp_group)
        self.ln1 = ReplicatedLayerNorm(d, config.layernorm_eps, tp_group=tp_group, sequence_parallel=sp)
        # Fused QKV; the full weight's rows are ordered [heads, 3, head_dim], so TP rank r's
        # contiguous slice holds the whole q, k and v of heads [r·nh/tp, (r+1)·nh/tp).
        self.qkv = ColumnParallelLinear(
            d,
            3 * d,
            tp_group=tp_group,
            init=inits["qkv"][0],
            bias_init=inits["qkv"][1],
            seed=self._seed_of(seed, "attention.qkv"),
            sequence_parallel=sp,
        )
        if v_scale != 1.0:
            with torch.no_grad():  # the V rows of every local head: [heads, 3, head_dim] rows, v = 2
                self.qkv.weight.view(self.num_heads_per_partition, 3, self.head_dim, d)[:, 2].mul_(v_scale)
                self.qkv.bias.view(self.num_heads_per_partition, 3, self.head_dim)[:, 2].mul_(v_scale)
        self.qkv_ln = (
            QKVLayerNorm(config.num_attention_heads, self.head_dim, config.layernorm_eps, tp_group=tp_group)
            if config.qkv_ln
            else None
        )
        self.head_scale_after_out_proj = config.head_scale_position == "after_out_proj"
        if config.head_scale and self.head_scale_after_out_proj:
            # fairseq's c_attn: acts on W_O's output, complete after the row-parallel reduce, so
            # replicated (a sequence-region parameter under sequence parallelism).
            g = nn.Parameter(torch.ones(config.num_attention_heads))
            self.head_scale = mark_no_weight_decay(mark_replicated(g))
        elif config.head_scale:
            g = torch.ones(config.num_attention_heads)  # paper Sec. 2: γ_i initialised to 1
            g = nn.Parameter(shard(g, 0, tp_rank(tp_group), tp_size))
            self.head_scale = mark_no_weight_decay(mark_parallel(g, partition_dim=0))
        else:
            self.register_parameter("head_scale", None)
        self.out_proj = RowParallelLinear(
            d,
            d,
            tp_group=tp_group,
            init=inits["out_proj"][0],
            bias_init=inits["out_proj"][1],
            seed=self._seed_of(seed, "attention.out_proj"),
            sequence_parallel=sp,
        )
        self.post_attn_ln = (
            ReplicatedLayerNorm(d, config.layernorm_eps, tp_group=tp_group, sequence_parallel=sp)
            if config.post_attn_ln
            else None
        )

    def _build_ffn(self, config: ModelConfig, inits: dict, seed: int) -> None:
        """LN2, W1, FFN_LN and W2, in this order."""
        d, ffn, tp_group, sp = config.hidden_size, config.ffn_size, self.tp_group, self.sequence_parallel
        self.ln2 = ReplicatedLayerNorm(d, config.layernorm_eps, tp_group=tp_group, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(
            d,
            ffn,
            tp_group=tp_group,
            init=inits["fc1"][0],
            bias_init=inits["fc1"][1],
            seed=self._seed_of(seed, "ffn.fc1"),
            sequence_parallel=sp,
        )
        self.ffn_ln = (
            ShardedLayerNorm(ffn, tp_group=tp_group, eps=config.layernorm_eps) if config.ffn_ln else None
        )
        self.fc2 = RowParallelLinear(
            ffn,
            d,
            tp_group=tp_group,
            init=inits["fc2"][0],
            bias_init=inits["fc2"][1],
            seed=self._seed_of(seed, "ffn.fc2"),
            sequence_parallel=sp,
        )

    def attention(self, x: torch.Tensor, fold_head_scale: bool = False) -> torch.Tensor:
        """``HeadScaleMHA(LN1(x))`` before POSTATTN_LN (with ``qkv_ln``, LayerNorms on q, k, v) under
        Pre-LN; ``MHA(x)`` under Post-LN / DeepNorm (whose LN1 comes after the residual sum):
        ``[B, T, d]`` -> ``[B, T, d]`` (causal; bidirectional under ``model.objective`` mlm).

        With sequence parallelism ``[B, T/tp, d]`` -> ``[B, T/tp, d]``; attention itself always
        sees the whole sequence (gathered by ``qkv``). ``fold_head_scale`` (the fused path,
        ``model.fused_kernels``): HeadScale's ``g`` multiplies W_O's input columns instead of the
        heads' outputs, the same function (ARCHITECTURE: folding ``g`` into W_O is allowed) without
        a pass over the activation.
        """
        nh, hs = self.num_heads_per_partition, self.head_dim  # local heads, head size
        if self.norm_scheme == "pre_ln":
            x = self.ln1(x)
        qkv = self.qkv(x)  # (B, T, nh·3·hs), the whole sequence
        if self.qkv_ln is not None:
            qkv = self.qkv_ln(qkv)  # statistics over all heads' q (k, v), reduced across TP ranks
        B, T, _ = qkv.shape  # noqa: N806  (batch size, sequence length)
        q, k, v = qkv.view(B, T, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 × (B, nh, T, hs)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            y = self._recomputed_core_attention(q, k, v)
        else:
            y = self._core_attention(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        input_scale = None
        if self.head_scale is not None and not self.head_scale_after_out_proj:
            # HeadScale scales each head's output BEFORE W_O (paper Eq. for HeadScaleMHA); fairseq
            # scales after out_proj (head_scale_position='after_out_proj', below), another function.
            if fold_head_scale:  # (y ∘ g) W_Oᵀ = y (W_O diag(g))ᵀ: g on W_O's d/tp input columns
                input_scale = self.head_scale.repeat_interleave(hs)  # (d/tp,)
            else:
                y = y * self.head_scale.view(nh, 1)  # (B, T, nh, hs)
        y = y.reshape(B, T, nh * hs)  # (B, T, d/tp)
        # (B, T, d), reduced across TP ranks (T/tp under sequence parallelism)
        out = self.out_proj(y, input_scale=input_scale)
        if self.head_scale is not None and self.head_scale_after_out_proj:
            # fairseq's c_attn (transformer_layer.py): W_O's output, bias included, in chunks of
            # head_dim channels, chunk i times γ_i (einsum "tbhd,h->tbhd").
            g = sequence_region_param(self.head_scale, self.tp_group, self.sequence_parallel)
            h = self.config.num_attention_heads
            out = (out.unflatten(-1, (h, self.head_dim)) * g.view(h, 1)).flatten(-2)
        return out

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(q kᵀ / sqrt(hs)) v`` with attention dropout, causal under ``model.objective`` clm,
        bidirectional (no mask) under mlm: 3 × ``[B, nh, T, hs]`` -> ``[B, nh, T, hs]``."""
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if self.key_padding_mask is not None:
            return self._padded_core_attention(q, k, v, dropout_p)
        if dropout_p > 0.0:
            # The local heads differ on every TP rank: independent masks.
            return self.dropout_rng.attention(
                q, k, v, dropout_p, "sharded", is_causal=self.is_causal, backend=self.config.attention_backend
            )
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)

    def _padded_core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        """:meth:`_core_attention` with :attr:`key_padding_mask`: no query attends to a padded key
        (and causally masked under clm). One process only: the attention dropout is torch's own
        generator, not the TP-aware streams of :class:`~megaformer.parallel.rng.DropoutRNG`."""
        keep = self.key_padding_mask[:, None, None, :]  # (B, 1, 1, T): over heads and queries
        if self.is_causal:
            t = q.shape[-2]
            keep = keep & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)

    def _recomputed_core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`_core_attention` under selective recomputation (``train.recompute=selective``):
        only q, k, v are kept for backward, which reruns the core (Korthikanti et al. 2022, Sec. 5).
        The recomputation replays this call's attention-dropout masks: the dropout generator states
        are snapshotted before the first run and put back for the rerun, then advanced again. Under
        ``torch.compile`` with attention dropout, :meth:`DropoutRNG.attention` recomputes from the
        state it was given (a pure function); without dropout there is nothing random to replay."""
        if torch.compiler.is_compiling():
            if self.config.attention_dropout > 0.0:
                return self.dropout_rng.attention(
                    q,
                    k,
                    v,
                    self.config.attention_dropout,
                    "sharded",
                    is_causal=self.is_causal,
                    recompute=True,
                    backend=self.config.attention_backend,
                )
            return torch.utils.checkpoint.checkpoint(
                self._core_attention, q, k, v, use_reentrant=False, preserve_rng_state=False
            )
        snapshot = self.dropout_rng.state_dict() if self.config.attention_dropout > 0.0 else None
        runs = []

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not runs or snapshot is None:  # the forward itself (or nothing random to replay)
                runs.append(1)
                return self._core_attention(q, k, v)
            with self.dropout_rng.replaying(snapshot):
                return self._core_attention(q, k, v)

        return torch.utils.checkpoint.checkpoint(run, q, k, v, use_reentrant=False, preserve_rng_state=False)

    def _fused_kernels(self, x: torch.Tensor):
        """:mod:`megaformer.model.kernels` when ``model.fused_kernels`` puts this call on the Triton
        kernels (``on``; ``auto`` with ``x`` on a real CUDA device and Triton installed), else None
        (the eager operations, the reference). A Python decision on the device and the config, so a
        compiled graph fixes it at trace time."""
        setting = self.config.fused_kernels
        if (
            setting == "off"
            or self.norm_scheme != "pre_ln"
            or (self.post_attn_ln is None and self.ffn_ln is None)
        ):
            return None
        norms = [m for m in (self.post_attn_ln, self.ffn_ln) if m is not None]
        if any(hasattr(p, "ds_id") for m in norms for p in m.parameters()):
            # ZeRO-3 gathers a module's parameters in hooks around that module's forward, which the
            # kernels bypass (they read the LayerNorms' weights directly): the eager operations.
            return None
        if setting == "auto" and (x.device.type != "cuda" or not fused_kernels_available()):
            return None
        if not fused_kernels_available():
            raise RuntimeError(
                "model.fused_kernels='on' needs Triton (pip install triton; requirements-dev.txt pins the "
                "version) and real tensors (not a fake-CUDA dry run); or set model.fused_kernels='auto'"
            )
        from megaformer.model import kernels  # lazy: imports Triton; only where the kernels run

        if setting == "auto" and kernels.self_check(x.device.type, x.device.index, x.dtype) is not None:
            # Once per device and dtype (a constant when compiled; it warns the first time): kernels
            # that fail to build or disagree with eager on this device leave the block eager.
            return None
        if x.device.type == "cpu" and not kernels.interpreted():
            raise RuntimeError(
                "model.fused_kernels='on' with CPU tensors: Triton runs on a CPU only in its interpreter; "
                "set TRITON_INTERPRET=1 before Triton is imported (tests/support/triton_interpreter.py), "
                "or use model.fused_kernels='auto' (eager on a CPU)"
            )
        return kernels

    def _fused_post_attn_residual(self, kernels, a: torch.Tensor, x: torch.Tensor, p: float, region: str):
        """``x + dropout(POSTATTN_LN(a))`` in one kernel (:func:`kernels.layer_norm_dropout_residual`),
        the dropout mask drawn from the same generator state as eager's ``F.dropout``."""
        a = a.contiguous()  # the layout of eager's LayerNorm output, whose mask F.dropout draws
        keep, scale = None, 1.0
        if self.training and p > 0.0:
            keep, scale = self.dropout_rng.keep_mask(a, p, region)
        ln = self.post_attn_ln
        weight = sequence_region_param(ln.weight, self.tp_group, self.sequence_parallel)
        bias = sequence_region_param(ln.bias, self.tp_group, self.sequence_parallel)
        return kernels.layer_norm_dropout_residual(a, x, weight, bias, keep=keep, scale=scale, eps=ln.eps)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (erf form) or squared ReLU (So et al. 2021, the paper's 2.7B model)."""
        if self.config.activation == "relu2":
            return F.relu(x).square()
        return F.gelu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout
        # The residual stream is replicated across TP ranks (same mask everywhere), or split along
        # the sequence under sequence parallelism (each rank its own tokens, its own mask).
        region = "sharded" if self.sequence_parallel else "replicated"
        if self.norm_scheme != "pre_ln":
            # Post-LN (alpha = 1) / DeepNorm: LN(alpha·x + F(x)) after each sublayer. The LayerNorms
            # are replicated (sequence-sliced under sequence parallelism), like the residual stream.
            a = _dropout(self.attention(x), p, self.training, self.dropout_rng, region)  # (B, T, d)
            h = self.ln1(self.alpha * x + a if self.alpha != 1.0 else x + a)
            f = self.fc2(self.activation(self.fc1(h)))  # (B, T, d)
            f = _dropout(f, p, self.training, self.dropout_rng, region)
            return self.ln2(self.alpha * h + f if self.alpha != 1.0 else h + f)
        fused = self._fused_kernels(x)
        # (B, T, d)  [(B, T/tp, d) with sequence parallelism, throughout]
        a = self.attention(x, fold_head_scale=fused is not None)
        if self.post_attn_ln is not None and fused is not None:
            h = self._fused_post_attn_residual(fused, a, x, p, region)  # one kernel, same function
        else:
            if self.post_attn_ln is not None:
                a = self.post_attn_ln(a)
            h = x + _dropout(a, p, self.training, self.dropout_rng, region)  # (B, T, d)

        u = self.fc1(self.ln2(h))  # (B, T, ffn/tp), the whole sequence
        if self.ffn_ln is not None and fused is not None:
            f = fused.layer_norm_activation(
                u,
                self.ffn_ln.weight,
                self.ffn_ln.bias,
                activation=self.config.activation,
                normalized_size=self.ffn_ln.normalized_size,
                eps=self.ffn_ln.eps,
                tp_group=self.tp_group,
            )
        else:
            f = self.activation(u)
            if self.ffn_ln is not None:
                f = self.ffn_ln(f)  # statistics over the full ffn width, reduced across TP ranks
        f = _dropout(self.fc2(f), p, self.training, self.dropout_rng, region)  # (B, T, d)
        if self.resid_scale is not None:
            # ResScale weights only the FFN residual (as fairseq)
            h = sequence_region_param(self.resid_scale, self.tp_group, self.sequence_parallel) * h
        return h + f


def set_selective_recompute(model: nn.Module, enabled: bool = True) -> int:
    """Turn selective recomputation of the attention core on (or off) in every
    :class:`NormFormerBlock` of ``model`` (a ``NormFormerLM`` or a pipeline stage). Returns how
    many blocks were set."""
    blocks = [m for m in model.modules() if isinstance(m, NormFormerBlock)]
    for block in blocks:
        block.recompute_core_attention = enabled
    return len(blocks)


class FinalNorm(nn.Module):
    """The LayerNorm after the last block (Pre-LN needs it: GPT-2, Radford et al. 2019, Sec. 2.3),
    replicated across TP ranks; under ``norm_scheme`` ``post_ln`` / ``deepnorm`` an identity without
    parameters (the last block already ends in a LayerNorm; fairseq's and torchscale's decoders
    build their final ``layer_norm`` only with ``normalize_before``), so that every scheme has the
    same layer plan.

    A module around the norm rather than the norm itself, so its parameters keep the checkpoint
    names ``<index>.norm.weight`` / ``<index>.norm.bias``.

    Shapes: ``float[B, T, d]`` -> same (``[B, T / tp, d]`` with ``sequence_parallel``).
    """

    def __init__(
        self, config: ModelConfig, *, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        sp = sequence_parallel and tp_world_size(tp_group) > 1
        self.norm = (
            ReplicatedLayerNorm(
                config.hidden_size, config.layernorm_eps, tp_group=tp_group, sequence_parallel=sp
            )
            if config.norm_scheme == "pre_ln"
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.norm is None else self.norm(hidden)


@contextlib.contextmanager
def padded_keys(blocks: Sequence[NormFormerBlock], keep: torch.Tensor) -> Iterator[None]:
    """Inside the ``with`` statement, every block's attention ignores the keys where ``keep``
    (``bool[B, T]``, the batch's real tokens) is False: right-padded batches of unequal sentences,
    as fine-tuning feeds them (:mod:`megaformer.tools.finetune`); a real token's hidden state is
    then the same as for its row alone. Single-process models only (see
    :meth:`NormFormerBlock._padded_core_attention`); the mask is removed on exit.

    Raises:
        ValueError: ``keep`` is not 2-D boolean.
    """
    if keep.dtype != torch.bool or keep.dim() != 2:
        raise ValueError(f"keep must be bool[B, T], got {keep.dtype} of shape {tuple(keep.shape)}")
    for block in blocks:
        block.key_padding_mask = keep
    try:
        yield
    finally:
        for block in blocks:
            block.key_padding_mask = None


def tied_output_logits(embedding: NormFormerEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """Tied output projection (``logits = h · E^T``, Press & Wolf 2017): ``float[B, T, d]``
    (``[B, T / tp, d]`` with sequence parallelism) -> this TP rank's raw logits
    ``float[B, T, V_pad / tp]`` (the padded columns are not masked).

    ``copy_to_tp_region`` makes the backward all-reduce the hidden-state gradient across the TP
    group (each rank saw only its vocabulary slice); under sequence parallelism the all-gather of
    the sequence slices does that job (its backward is a reduce-scatter).
    """
    weight = embedding.token.weight  # (V_pad / tp, d)
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_region(hidden, embedding.tp_group)  # (B, T, d)
    else:
        hidden = copy_to_tp_region(hidden, embedding.tp_group)
    return F.linear(hidden, weight)


class MaskedLMHead(nn.Module):
    """RoBERTa's LM head before its decoder (fairseq ``RobertaLMHead``, Hugging Face
    ``RobertaLMHead``): ``LayerNorm(GELU(dense(h)))``, ``dense`` a ``d -> d`` linear layer; plus the
    decoder's vocabulary bias. The decoder itself is the tied token embedding
    (:func:`masked_lm_logits`), so ``logits = LN(GELU(W h + b)) · Eᵀ + bias``.

    Under tensor parallelism ``dense`` and the LayerNorm are replicated on every TP rank (a plain
    ``d × d`` matmul, as cheap as one attention projection; under sequence parallelism they act on
    this rank's slice of the sequence and their gradients are summed across the group), and
    ``bias``, ``float32[V_pad / tp]``, is vocabulary-parallel like the embedding rows (each rank adds
    its slice to its slice of the logits: no communication).

    Init (fairseq's ``init_bert_params``, as RoBERTa): ``dense.weight`` ``N(0, init_std²)`` drawn
    full under the seed name ``lm_head.dense``, ``dense.bias`` 0, LayerNorm γ = 1, β = 0, ``bias`` 0.

    Shapes: ``float[B, T, d]`` (``[B, T / tp, d]`` with ``sequence_parallel``) -> same.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        self.dense = nn.Linear(d, d)
        with torch.no_grad():
            self.dense.weight.copy_(normal_full((d, d), config.init_std, derive_seed(seed, "lm_head.dense")))
            self.dense.bias.zero_()
        mark_replicated(self.dense.weight)
        mark_no_weight_decay(mark_replicated(self.dense.bias))
        self.layer_norm = ReplicatedLayerNorm(
            d, config.layernorm_eps, tp_group=tp_group, sequence_parallel=self.sequence_parallel
        )
        local_rows = config.padded_vocab_size(tp_world_size(tp_group)) // tp_world_size(tp_group)
        self.bias = mark_no_weight_decay(
            mark_parallel(nn.Parameter(torch.zeros(local_rows)), partition_dim=0)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = sequence_region_param(self.dense.weight, self.tp_group, self.sequence_parallel)
        bias = sequence_region_param(self.dense.bias, self.tp_group, self.sequence_parallel)
        return self.layer_norm(F.gelu(F.linear(hidden, weight, bias)))


def masked_lm_logits(embedding: NormFormerEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """RoBERTa's LM head on the final hidden state: :class:`MaskedLMHead` (``embedding.lm_head``),
    the tied decoder (:func:`tied_output_logits`), plus the vocabulary-parallel bias:
    ``float[B, T, d]`` (``[B, T / tp, d]`` with sequence parallelism) -> this TP rank's raw logits
    ``float[B, T, V_pad / tp]``."""
    head = embedding.lm_head
    return tied_output_logits(embedding, head(hidden)) + head.bias


class MaskedLMFeatures(NamedTuple):
    """The masked LM's last layer output under ``model.mlm_head_positions`` masked: the LM head's
    features and the tied decoder's weights, decoded by the loss at the masked positions only
    (fairseq ``RobertaLMHead(features, masked_tokens)``), so that the ``d × V`` decoder runs on
    ``max_masked_positions(T)`` rows per sequence, not ``T``.

    Fields: ``features`` ``float[B, T, d]`` (``[B, T / tp, d]`` with sequence parallelism),
    ``LN(GELU(dense(h)))`` of :class:`MaskedLMHead`; ``weight`` ``float[V_pad / tp, d]`` (the token
    embedding: the tied decoder); ``bias`` ``float32[V_pad / tp]``; the TP group and whether the
    features are sequence-parallel. Under a pipeline it is the last stage's output, which DeepSpeed
    hands to the loss on that stage (``PipelineEngine._exec_forward_pass``): it is never sent.
    """

    features: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    tp_group: ProcessGroup | None
    sequence_parallel: bool

    def _full_sequence(self) -> torch.Tensor:
        # As tied_output_logits: the all-gather of the sequence slices (backward reduce-scatter), or
        # the identity whose backward all-reduces the gradient over the vocabulary shards.
        if self.sequence_parallel:
            return gather_from_sequence_region(self.features, self.tp_group)  # (B, T, d)
        return copy_to_tp_region(self.features, self.tp_group)

    def logits(self) -> torch.Tensor:
        """Every position's raw logits, ``float[B, T, V_pad / tp]``: :func:`masked_lm_logits`."""
        return F.linear(self._full_sequence(), self.weight) + self.bias

    def masked_logits(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the masked positions and their labels.

        Args:
            labels: ``LongTensor[B, T]``, the original token at the masked positions and
                :data:`~megaformer.data.mlm.IGNORE_INDEX` elsewhere (:func:`~megaformer.data.mlm.mask_block`).

        Returns:
            ``(float[B, K, V_pad / tp], LongTensor[B, K])``, ``K = max_masked_positions(T)``: each
            row's masked positions first, in position order, then unmasked ones whose labels read
            ``IGNORE_INDEX`` (padding: their loss is zeroed). ``K`` depends on ``T`` alone, so the
            selection is a gather of fixed shape (no host sync).

        Raises:
            ValueError: ``labels`` is not ``[B, T]`` of the full sequence, or (on a CPU, where the
                check costs no device sync) a row has more than ``K`` masked positions: labels not
                drawn by :func:`~megaformer.data.mlm.mask_block`'s rule, which the head would drop.
        """
        hidden = self._full_sequence()
        b, t, d = hidden.shape
        if labels.shape != (b, t):
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of tokens {(b, t)}")
        k = max_masked_positions(t)
        chosen = labels != IGNORE_INDEX
        if labels.device.type == "cpu" and int(chosen.sum(dim=1).max()) > k:
            raise ValueError(
                f"a row of labels has {int(chosen.sum(dim=1).max())} masked positions, more than the "
                f"{k} that model.mlm_head_positions='masked' decodes at T={t} (mask_block's rule, "
                "mask_prob 0.15); set model.mlm_head_positions='all' for other masking"
            )
        # A stable sort of the 0/1 key puts each row's masked positions first, in position order.
        order = torch.argsort((~chosen).to(torch.uint8), dim=1, stable=True)[:, :k]  # (B, K)
        rows = hidden.gather(1, order.unsqueeze(-1).expand(b, k, d))  # (B, K, d)
        return F.linear(rows, self.weight) + self.bias, labels.gather(1, order)


def masked_lm_features(embedding: NormFormerEmbedding, hidden: torch.Tensor) -> MaskedLMFeatures:
    """RoBERTa's LM head without its decoder, for ``model.mlm_head_positions`` masked: the final
    hidden state ``float[B, T, d]`` (``[B, T / tp, d]`` with sequence parallelism) ->
    :class:`MaskedLMFeatures`, which :class:`MaskedLMLoss` decodes at the masked positions and
    :meth:`MaskedLMFeatures.logits` everywhere (the same function as :func:`masked_lm_logits`)."""
    head = embedding.lm_head
    return MaskedLMFeatures(
        head(hidden), embedding.token.weight, head.bias, embedding.tp_group, embedding.sequence_parallel
    )


class OutputProjection(nn.Module):
    """Untied output projection: column-parallel over the padded vocabulary, no bias, weight drawn
    from ``N(0, init_std²)`` (``N(0, 1/d)`` under ``model.init`` fairseq) under the seed name ``output``.

    Shapes: ``float[B, T, d]`` (``[B, T / tp, d]`` with ``sequence_parallel``) -> this TP rank's raw
    logits ``float[B, T, V_pad / tp]`` (padded columns not masked). The weight is ``proj.weight``
    (checkpoint name ``<index>.proj.weight``).

    Raises:
        ValueError: the padded vocabulary does not divide by the TP size.
    """

    # Parameters (relative names) whose dim 0 is the padded vocabulary.
    VOCAB_PARAMS = ("proj.weight",)

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(
            config.hidden_size,
            config.padded_vocab_size(tp_world_size(tp_group)),
            tp_group=tp_group,
            bias=False,
            # fairseq's untied output_projection: N(0, d^-0.5); GPT-2 / legacy: N(0, init_std).
            init_std=config.hidden_size**-0.5 if config.init == "fairseq" else config.init_std,
            seed=derive_seed(seed, "output"),
            num_valid_out_features=config.vocab_size,
            sequence_parallel=sequence_parallel and tp_world_size(tp_group) > 1,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


class LMLoss:
    """Mean next-token cross-entropy (nats) of vocabulary-sharded logits, padded columns ignored.

    Called as ``loss_fn(logits_local float[B, T, V_pad/tp], labels LongTensor[B, T])`` -> ``float32``
    scalar, the mean over all ``B·T`` tokens, the same on every TP rank (Megatron's
    vocabulary-parallel cross-entropy, :func:`~megaformer.parallel.vocab_parallel_cross_entropy`).
    The logits' buffer is reused for the softmax (nothing else reads them).

    Raises:
        ValueError: ``labels`` does not have the shape of the logits' first two dimensions.
    """

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None) -> None:
        self.vocab_size = config.vocab_size
        self.tp_group = tp_group
        self.fused = False  # compiled cross-entropy kernels (set where the blocks are compiled)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of tokens {tuple(logits.shape[:-1])}"
            )
        return vocab_parallel_cross_entropy(
            logits, labels, self.tp_group, self.vocab_size, inplace=True, fused=self.fused
        ).mean()


class MaskedLMLoss:
    """Mean cross-entropy (nats) of the masked positions only: RoBERTa's masked-LM loss.

    Called as ``loss_fn(logits_local float[B, T, V_pad/tp], labels LongTensor[B, T])`` -> ``float32``
    scalar, the same on every TP rank; under ``model.mlm_head_positions`` masked the first argument
    is the head's :class:`MaskedLMFeatures` instead, decoded here at the masked positions only
    (:meth:`MaskedLMFeatures.masked_logits`; the same loss up to rounding). ``labels`` hold the
    original token at the positions chosen for prediction and
    :data:`~megaformer.data.mlm.IGNORE_INDEX` (-100) elsewhere
    (:func:`~megaformer.data.mlm.mask_block`); the cross-entropy of the other positions (taken
    against label 0, so that :func:`~megaformer.parallel.vocab_parallel_cross_entropy` sees valid
    labels) is multiplied by zero, so an unmasked position neither counts nor gets a gradient, with
    shapes that do not depend on the data (no host sync).

    Averaging: the summed NLL of this micro-batch's masked positions over their count (0 when
    none). A training step's loss is fairseq's: the summed NLL of all the step's masked tokens (every
    micro-batch and data-parallel rank) over their count (its ``sample_size``), not the mean of the
    micro-batches' means; the trainer's engine adapter reweights each micro-batch's loss by its
    masked count to get it (:meth:`megaformer.training.ds_adapter.Engine.train_step`), and
    validation likewise. Under a pipeline the weight travels with the labels: ``labels`` may be
    ``(labels, weight)``, weight a 0-dim float tensor that multiplies the mean
    (:meth:`~megaformer.training.ds_adapter.Engine._weighted_masked_batches`).

    Raises:
        ValueError: ``labels`` does not have the shape of the logits' first two dimensions.
    """

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None) -> None:
        self.vocab_size = config.vocab_size
        self.tp_group = tp_group
        self.fused = False  # compiled cross-entropy kernels (set where the blocks are compiled)

    def __call__(
        self,
        logits: torch.Tensor | MaskedLMFeatures,
        labels: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        weight = None
        if isinstance(labels, (tuple, list)):  # (labels, weight): a pipeline's last stage
            labels, weight = labels
        if isinstance(logits, MaskedLMFeatures):  # model.mlm_head_positions masked
            logits, labels = logits.masked_logits(labels)  # (B, K, V_pad / tp), (B, K)
        if labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of tokens {tuple(logits.shape[:-1])}"
            )
        chosen = labels != IGNORE_INDEX  # (B, T)
        # Every position's cross-entropy, the unmasked ones against a stand-in label (0) and then
        # zeroed: selecting the masked rows (logits[chosen]) gives a data-dependent shape, a host
        # sync per micro-batch on a GPU (and a shape the fake-CUDA dry run cannot build).
        nll = vocab_parallel_cross_entropy(
            logits, labels.where(chosen, 0), self.tp_group, self.vocab_size, inplace=True, fused=self.fused
        )  # (B, T)
        loss = (nll * chosen).sum() / chosen.sum().clamp(min=1)
        return loss if weight is None else loss * weight.to(loss.dtype)


def lm_loss(config: ModelConfig, tp_group: ProcessGroup | None) -> LMLoss | MaskedLMLoss:
    """The loss of ``model.objective``: :class:`LMLoss` (clm) or :class:`MaskedLMLoss` (mlm)."""
    return MaskedLMLoss(config, tp_group) if config.objective == "mlm" else LMLoss(config, tp_group)
