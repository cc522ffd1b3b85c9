"""A megaformer decoder as a Hugging Face causal LM, with a KV cache for ``generate()``.

Shipped next to the weights by ``python -m megaformer.tools.export_hf``; loaded with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``. It imports only ``torch`` and
``transformers`` and recomputes, in one process, the function megaformer's tensor-parallel model
(``megaformer/model/normformer.py``) computes at TP = 1::

    pre_ln:    h = x + POSTATTN_LN(HeadScaleMHA(LN1(x)))
               y = RESID_SCALE * h + W2 FFN_LN(act(W1 LN2(h) + b1)) + b2
    post_ln:   h = LN1(x + MHA(x)),          y = LN2(h + W2 act(W1 h + b1) + b2)
    deepnorm:  h = LN1(a x + MHA(x)),        y = LN2(a h + W2 act(W1 h + b1) + b2),  a = (2N)^(1/4)

(capitals: NormFormer's switches; HeadScale scales each head's output before W_O; "+3 More LN"
(``qkv_ln``) normalises each of q, k, v over its full width). Tokens are embedded times sqrt(d) when
``scale_embedding``, plus a sinusoidal (fairseq layout) or learned position; Pre-LN ends in a final
LayerNorm; the output projection is the token embedding when tied.

Weights keep megaformer's fused layouts: ``qkv.weight`` is ``[3d, d]`` with rows ordered
``[heads, 3, head_dim]`` (per head its q, k, v), ``qkv_ln.{weight,bias}`` are ``[3d]`` in that order.
Positions are absolute, ``0 .. max_position_embeddings - 1``; a longer context raises ValueError, as
in megaformer. ``attention_mask`` (0 = padding) hides padded keys; positions come from ``position_ids``
or count from 0 (plus the cached length): a left-padded batch needs ``position_ids`` from the mask,
which ``generate()`` passes (tests/unit/test_export_hf.py checks such a batch against each row alone).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megaformer import MegaformerConfig


def sinusoidal_positions(num_positions: int, dim: int) -> torch.Tensor:
    """``float32[num_positions, dim]``: ``[sin(p w_0) .. sin(p w_{k-1}) | cos(p w_0) .. cos(p w_{k-1})]``,
    ``w_i = 10000^(-i/(k-1))``, ``k = dim // 2`` (fairseq's layout, position 0 first, no offset); an odd
    ``dim`` gets a zero last column."""
    half = dim // 2
    step = math.log(10000.0) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)
    angles = torch.arange(num_positions, dtype=torch.float32).unsqueeze(1) * freqs  # (P, half)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2 == 1:
        table = F.pad(table, (0, 1))
    return table


class QKVLayerNorm(nn.Module):
    """LayerNorm of each of q, k and v over its ``d`` features; ``[B, T, 3d]`` (rows
    ``[heads, 3, head_dim]``) -> same. Gains and shifts are ``[3d]`` in the same order."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(3 * num_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(3 * num_heads * head_dim))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        nh, hs = self.num_heads, self.head_dim
        x = qkv.float().unflatten(-1, (nh, 3, hs)).transpose(-3, -2).flatten(-2)  # (B, T, 3, d)
        normed = F.layer_norm(x, (nh * hs,), eps=self.eps).unflatten(-1, (nh, hs)).transpose(-3, -2)
        y = normed * self.weight.float().view(nh, 3, hs) + self.bias.float().view(nh, 3, hs)
        return y.flatten(-3).to(qkv.dtype)  # (B, T, 3d)


class MegaformerAttention(nn.Module):
    """Causal multi-head attention with NormFormer's HeadScale and optional q/k/v LayerNorms.

    ``x: float[B, T, d]`` -> ``float[B, T, d]``; with a cache the keys and values of earlier calls are
    prepended (this layer's slot ``layer_idx``).
    """

    def __init__(self, config: MegaformerConfig, layer_idx: int) -> None:
        super().__init__()
        d, nh = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, nh, d // nh
        self.qkv = nn.Linear(d, 3 * d)
        self.qkv_ln = QKVLayerNorm(nh, d // nh, config.layer_norm_eps) if config.qkv_ln else None
        self.head_scale = nn.Parameter(torch.ones(nh)) if config.head_scale else None
        self.out_proj = nn.Linear(d, d)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, past_key_values: Cache | None
    ) -> torch.Tensor:
        B, T, _ = x.shape  # noqa: N806  (batch size, new tokens)
        nh, hs = self.num_heads, self.head_dim
        qkv = self.qkv(x)
        if self.qkv_ln is not None:
            qkv = self.qkv_ln(qkv)
        q, k, v = qkv.view(B, T, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)  # (B, nh, past + T, hs)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        if self.head_scale is not None:
            y = y * self.head_scale.view(nh, 1)  # before W_O, as the paper
        return self.out_proj(y.reshape(B, T, nh * hs))


class MegaformerBlock(nn.Module):
    """One decoder layer; ``[B, T, d]`` -> ``[B, T, d]`` (formulas in the module docstring)."""

    def __init__(self, config: MegaformerConfig, layer_idx: int) -> None:
        super().__init__()
        d, ffn, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.norm_scheme = config.norm_scheme
        self.alpha = config.deepnorm_alpha if config.norm_scheme == "deepnorm" else 1.0
        self.activation = config.activation
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.attn = MegaformerAttention(config, layer_idx)
        self.post_attn_ln = nn.LayerNorm(d, eps=eps) if config.post_attn_ln else None
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, ffn)
        self.ffn_ln = nn.LayerNorm(ffn, eps=eps) if config.ffn_ln else None
        self.fc2 = nn.Linear(ffn, d)
        self.resid_scale = nn.Parameter(torch.ones(d)) if config.resid_scale else None

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square() if self.activation == "relu2" else F.gelu(x)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        if self.norm_scheme != "pre_ln":
            a = self.attn(x, mask, cache)
            h = self.ln1(self.alpha * x + a if self.alpha != 1.0 else x + a)
            f = self.fc2(self.act(self.fc1(h)))
            return self.ln2(self.alpha * h + f if self.alpha != 1.0 else h + f)
        a = self.attn(self.ln1(x), mask, cache)
        if self.post_attn_ln is not None:
            a = self.post_attn_ln(a)
        h = x + a
        f = self.act(self.fc1(self.ln2(h)))
        if self.ffn_ln is not None:
            f = self.ffn_ln(f)
        f = self.fc2(f)
        if self.resid_scale is not None:
            h = self.resid_scale * h  # ResScale weights the FFN residual only
        return h + f


class MegaformerPreTrainedModel(PreTrainedModel):
    """Weight init and loading glue shared by the base model and the LM."""

    config_class = MegaformerConfig
    config: MegaformerConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["MegaformerBlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Only parameters missing from a checkpoint are initialised (a fresh model for tests).
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, (nn.LayerNorm, QKVLayerNorm)):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, MegaformerAttention) and module.head_scale is not None:
            module.head_scale.fill_(1.0)
        elif isinstance(module, MegaformerBlock) and module.resid_scale is not None:
            module.resid_scale.fill_(1.0)


def _attention_mask(
    attention_mask: torch.Tensor | None, past: int, new: int, device: torch.device
) -> torch.Tensor | None:
    """``bool[B, 1, new, past + new]`` (True: may attend), or None where plain causal attention over
    the new tokens alone is exact (no cache, no padding). A padded query row keeps its own key, so
    that no row is all False (SDPA would return NaN there; the row's output is never used)."""
    if past == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    total = past + new
    q_pos = torch.arange(past, total, device=device).view(new, 1)
    k_pos = torch.arange(total, device=device).view(1, total)
    allowed = (k_pos <= q_pos).view(1, 1, new, total)
    if attention_mask is not None:
        keys = attention_mask[:, -total:].bool().view(-1, 1, 1, total)
        allowed = allowed & (keys | (k_pos == q_pos).view(1, 1, new, total))
    return allowed


class MegaformerModel(MegaformerPreTrainedModel):
    """Token ids to the last hidden states ``float[B, T, d]`` (after the final LayerNorm under Pre-LN)."""

    def __init__(self, config: MegaformerConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        if config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, d)
        # The fixed sinusoidal table is built on first use, on the input's device (a plain attribute,
        # not a buffer: transformers builds models on the meta device and leaves non-persistent
        # buffers unfilled when loading).
        self._position_table: torch.Tensor | None = None
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.layers = nn.ModuleList(MegaformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = (
            nn.LayerNorm(d, eps=config.layer_norm_eps) if config.norm_scheme == "pre_ln" else None
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        limit = self.config.max_position_embeddings
        if int(position_ids.max()) >= limit:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond the model's context of {limit} tokens "
                "(megaformer's model.seq_len); shorten the input or max_new_tokens"
            )
        if self.config.position_embedding == "learned":
            return self.embed_positions(position_ids)
        table = self._position_table
        if table is None or table.device != position_ids.device:
            table = sinusoidal_positions(limit, self.config.hidden_size).to(position_ids.device)
            self._position_table = table
        return table[position_ids]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        new = inputs_embeds.shape[1]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + new, device=inputs_embeds.device).unsqueeze(0)
        x = inputs_embeds * self.embed_scale + self._positions(position_ids).to(inputs_embeds.dtype)
        mask = _attention_mask(attention_mask, past, new, x.device)
        for layer in self.layers:
            x = layer(x, mask, past_key_values)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return BaseModelOutputWithPast(
            last_hidden_state=x, past_key_values=past_key_values if use_cache else None
        )


class MegaformerForCausalLM(MegaformerPreTrainedModel, GenerationMixin):
    """The LM: logits ``float[B, T, vocab_size]`` over the real vocabulary (megaformer's padding rows
    are not exported), a mean next-token cross-entropy when ``labels`` are given (shifted inside, as
    every transformers causal LM; -100 ignored)."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegaformerConfig) -> None:
        super().__init__(config)
        self.model = MegaformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
