"""The NormFormer decoder LM (Shleifer, Weston & Ott 2021, arXiv:2110.09456), and its Pre-LN baseline.

One decoder layer (paper Fig. 1, Sec. 2), with NormFormer's additions in capitals::

    h = x + POSTATTN_LN( HeadScaleMHA( LN1(x) ) )
    y = RESID_SCALE ∘ h + W2 · FFN_LN( act( W1 · LN2(h) + b1 ) ) + b2
    HeadScaleMHA = Concat(g_1 head_1, ..., g_n head_n) · W_O        (g_i learned, init 1)

Each capital is a switch of :class:`~megaformer.config.schema.ModelConfig`; all off is the Pre-LN GPT
baseline. Built from the tensor-parallel layers of :mod:`megaformer.parallel`, so the same code runs
at any TP degree and computes the same function (heads and ``g`` split across ranks, FFN_LN reducing
its statistics across ranks, POSTATTN_LN replicated after the row-parallel reduce).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megaformer.config.schema import ConfigError, ModelConfig
from megaformer.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayerNorm,
    VocabParallelEmbedding,
    copy_to_tp_region,
    mask_padded_vocab,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel.utils import (
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

_POSITION_EMBEDDINGS = ("sinusoidal", "learned")
_ACTIVATIONS = ("gelu", "relu2")


def _check_config(config: ModelConfig) -> None:
    """Reject values the model cannot build (the config loader may have been bypassed)."""
    if config.position_embedding not in _POSITION_EMBEDDINGS:
        raise ConfigError(
            f"model.position_embedding={config.position_embedding!r}; use one of {_POSITION_EMBEDDINGS}"
        )
    if config.activation not in _ACTIVATIONS:
        raise ConfigError(f"model.activation={config.activation!r}; use one of {_ACTIVATIONS}")
    if config.hidden_size % config.num_attention_heads != 0:
        raise ConfigError(
            f"model.hidden_size={config.hidden_size} is not divisible by "
            f"model.num_attention_heads={config.num_attention_heads}"
        )


def replicated_layer_norm(size: int, eps: float) -> nn.LayerNorm:
    """A LayerNorm over a replicated dimension, its parameters tagged replicated and no-decay."""
    ln = nn.LayerNorm(size, eps=eps)
    for p in ln.parameters():
        mark_no_weight_decay(mark_replicated(p))
    return ln


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
    ``scale_embedding`` (fairseq, the paper's code base), plus positions.

    Shapes: ``tokens: LongTensor[B, T]`` (``T <= seq_len``) -> ``float32[B, T, d]``, replicated.
    """

    def __init__(self, config: ModelConfig, *, tp_group: ProcessGroup | None = None, seed: int = 1234):
        super().__init__()
        _check_config(config)
        self.config = config
        d = config.hidden_size
        self.token = VocabParallelEmbedding(
            config.padded_vocab_size(tp_world_size(tp_group)),
            d,
            tp_group=tp_group,
            init_std=config.token_embedding_std,
            seed=derive_seed(seed, "embedding.token"),
            num_valid_embeddings=config.vocab_size,
        )
        if config.position_embedding == "learned":
            full = normal_full((config.seq_len, d), config.init_std, derive_seed(seed, "embedding.position"))
            self.position = mark_replicated(nn.Parameter(full))
        else:
            # Fixed, so not saved in checkpoints (persistent=False) and not a parameter.
            self.register_buffer("position", sinusoidal_positions(config.seq_len, d), persistent=False)
        self.scale = math.sqrt(d) if config.scale_embedding else 1.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[-1]
        if seq_len > self.config.seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds model.seq_len={self.config.seq_len}")
        x = self.token(tokens) * self.scale  # (B, T, d)
        # The sinusoidal table is a buffer, which DeepSpeed's bf16/fp16 conversion (ZeRO-3 in
        # particular) leaves in fp32: follow the embedding's dtype.
        return x + self.position[:seq_len].to(x.dtype)  # (B, T, d)


class NormFormerBlock(nn.Module):
    """One decoder layer: NormFormer (paper Fig. 1 middle) or, with every switch off, Pre-LN.

    Args:
        config: the model configuration (switches ``post_attn_ln``, ``head_scale``, ``ffn_ln``,
            ``resid_scale``).
        layer_index: position of this layer (0-based); names its parameters' seeds, so a layer built
            on its own (e.g. by a pipeline stage) equals the same layer built inside the full model.
        tp_group: tensor-parallel group, or None. Heads, HeadScale ``g``, W1 and FFN_LN are split
            across it; LN1, LN2, POSTATTN_LN and ResScale ``λ`` are replicated.
        seed: the model's base seed.

    Shapes: ``x: float[B, T, d]`` -> ``float[B, T, d]``, replicated on every TP rank.

    Raises:
        ValueError: when the heads or the FFN width do not divide by the TP size.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp_group: ProcessGroup | None = None,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        self.layer_index = layer_index
        d, ffn = config.hidden_size, config.ffn_size
        tp_size = tp_world_size(tp_group)
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.head_dim = config.head_dim
        # GPT-2 (Radford et al. 2019, Sec. 2.3): scale the init of the layers that write into the
        # residual stream (W_O, W2) by 1/sqrt(2·num_layers), two per layer, so the residual variance
        # does not grow with depth.
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)

        def seed_of(name: str) -> int:
            return derive_seed(seed, f"layers.{layer_index}.{name}")

        # --- attention -------------------------------------------------------------------------
        self.ln1 = replicated_layer_norm(d, config.layernorm_eps)
        # Fused QKV; the full weight's rows are ordered [heads, 3, head_dim], so TP rank r's
        # contiguous slice holds the whole q, k and v of heads [r·nh/tp, (r+1)·nh/tp).
        self.qkv = ColumnParallelLinear(
            d, 3 * d, tp_group=tp_group, init_std=config.init_std, seed=seed_of("attention.qkv")
        )
        if config.head_scale:
            g = torch.ones(config.num_attention_heads)  # paper Sec. 2: γ_i initialised to 1
            g = nn.Parameter(shard(g, 0, tp_rank(tp_group), tp_size))
            self.head_scale = mark_no_weight_decay(mark_parallel(g, partition_dim=0))
        else:
            self.register_parameter("head_scale", None)
        self.out_proj = RowParallelLinear(
            d, d, tp_group=tp_group, init_std=residual_std, seed=seed_of("attention.out_proj")
        )
        self.post_attn_ln = replicated_layer_norm(d, config.layernorm_eps) if config.post_attn_ln else None

        # --- feed-forward ----------------------------------------------------------------------
        self.ln2 = replicated_layer_norm(d, config.layernorm_eps)
        self.fc1 = ColumnParallelLinear(
            d, ffn, tp_group=tp_group, init_std=config.init_std, seed=seed_of("ffn.fc1")
        )
        self.ffn_ln = (
            ShardedLayerNorm(ffn, tp_group=tp_group, eps=config.layernorm_eps) if config.ffn_ln else None
        )
        self.fc2 = RowParallelLinear(
            ffn, d, tp_group=tp_group, init_std=residual_std, seed=seed_of("ffn.fc2")
        )
        if config.resid_scale:
            lam = nn.Parameter(torch.ones(d))  # paper Sec. 2: λ_resid initialised to 1
            self.resid_scale = mark_no_weight_decay(mark_replicated(lam))
        else:
            self.register_parameter("resid_scale", None)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """``HeadScaleMHA(LN1(x))`` before POSTATTN_LN: ``[B, T, d]`` -> ``[B, T, d]`` (causal)."""
        B, T, _ = x.shape  # noqa: N806  (batch size, sequence length, hidden size d)
        nh, hs = self.num_heads_per_partition, self.head_dim  # local heads, head size
        qkv = self.qkv(self.ln1(x))  # (B, T, nh·3·hs)
        q, k, v = qkv.view(B, T, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 × (B, nh, T, hs)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        if self.head_scale is not None:
            # HeadScale scales each head's output BEFORE W_O (paper Eq. for HeadScaleMHA); fairseq
            # scales after out_proj, which is a different function.
            y = y * self.head_scale.view(nh, 1)  # (B, T, nh, hs)
        y = y.reshape(B, T, nh * hs)  # (B, T, d/tp)
        return self.out_proj(y)  # (B, T, d), reduced across TP ranks

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (erf form) or squared ReLU (So et al. 2021, the paper's 2.7B model)."""
        if self.config.activation == "relu2":
            return F.relu(x).square()
        return F.gelu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout if self.training else 0.0
        a = self.attention(x)  # (B, T, d)
        if self.post_attn_ln is not None:
            a = self.post_attn_ln(a)
        h = x + F.dropout(a, p=p, training=self.training)  # (B, T, d)

        f = self.activation(self.fc1(self.ln2(h)))  # (B, T, ffn/tp)
        if self.ffn_ln is not None:
            f = self.ffn_ln(f)  # statistics over the full ffn width, reduced across TP ranks
        f = F.dropout(self.fc2(f), p=p, training=self.training)  # (B, T, d)
        if self.resid_scale is not None:
            h = self.resid_scale * h  # ResScale weights only the FFN residual (as fairseq)
        return h + f


class NormFormerLM(nn.Module):
    """Causal language model: embedding, ``num_layers`` :class:`NormFormerBlock`, final LN, output.

    Args:
        config: the model configuration.
        tp_group: tensor-parallel group, or None for a single process.
        seed: base seed; every parameter's full tensor is drawn from a generator seeded by this and
            the parameter's name, so the same seed gives the same model at any TP degree.

    The output projection is the token embedding (``tie_embeddings``) or a separate column-parallel
    layer without bias; either way the logits stay vocabulary-sharded.

    Raises:
        ConfigError: for an unknown ``position_embedding`` / ``activation`` or heads not dividing d.
        ValueError: when heads, FFN width or padded vocabulary do not divide by the TP size.
    """

    def __init__(self, config: ModelConfig, *, tp_group: ProcessGroup | None = None, seed: int = 1234):
        super().__init__()
        _check_config(config)
        self.config = config
        self.tp_group = tp_group
        self.tp_size = tp_world_size(tp_group)
        self.padded_vocab_size = config.padded_vocab_size(self.tp_size)
        self.embedding = NormFormerEmbedding(config, tp_group=tp_group, seed=seed)
        self.layers = nn.ModuleList(
            NormFormerBlock(config, i, tp_group=tp_group, seed=seed) for i in range(config.num_layers)
        )
        self.final_ln = replicated_layer_norm(config.hidden_size, config.layernorm_eps)
        if config.tie_embeddings:
            self.output = None
        else:
            self.output = ColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                tp_group=tp_group,
                bias=False,
                init_std=config.init_std,
                seed=derive_seed(seed, "output"),
                num_valid_out_features=config.vocab_size,
            )

    def logits_local(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden state ``[B, T, d]`` to this rank's raw logits ``[B, T, padded_vocab/tp]``
        (padded columns not yet masked)."""
        if self.output is not None:
            return self.output(h)
        return F.linear(copy_to_tp_region(h, self.tp_group), self.embedding.token.weight)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits or mean loss.

        Args:
            tokens: ``LongTensor[B, T]``, ``T <= seq_len``, values in ``[0, vocab_size)``.
            labels: ``LongTensor[B, T]`` next-token targets, or None.

        Returns:
            without labels, ``float32[B, T, padded_vocab/tp]``: this rank's vocabulary slice of the
            logits, padded columns set to ``-inf``; with labels, the ``float32`` scalar mean
            cross-entropy in nats over all ``B·T`` tokens (the same on every TP rank).
        """
        h = self.embedding(tokens)  # (B, T, d)
        for layer in self.layers:
            h = layer(h)  # (B, T, d)
        h = self.final_ln(h)
        logits = self.logits_local(h)  # (B, T, V_pad/tp)
        if labels is None:
            return mask_padded_vocab(logits, self.tp_group, self.config.vocab_size)
        if labels.shape != tokens.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of tokens {tuple(tokens.shape)}"
            )
        # The fresh logits are read by nothing else, so the loss may reuse their buffer.
        loss = vocab_parallel_cross_entropy(
            logits, labels, self.tp_group, self.config.vocab_size, inplace=True
        )  # (B, T)
        return loss.mean()
