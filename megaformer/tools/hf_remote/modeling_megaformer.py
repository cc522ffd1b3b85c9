"""A megaformer decoder as a Hugging Face causal LM, with a KV cache for ``generate()``, and a megaformer
masked LM (``model.objective: mlm``) as a Hugging Face masked LM.

Shipped next to the weights by ``python -m megaformer.tools.export_hf``; loaded with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` (or ``AutoModelForMaskedLM``
for a masked LM: :class:`MegaformerForMaskedLM`, the same blocks with bidirectional attention and
RoBERTa's LM head, as megaformer's ``MaskedLMHead``; no KV cache; ``pipeline("fill-mask")`` works).
It imports only ``torch`` and ``transformers`` and recomputes, in one process, the function
megaformer's tensor-parallel model (``megaformer/model/normformer.py``) computes at TP = 1::

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
The cache arrives as ``cache`` (the name in recent transformers 5 releases, whose ``generate()``
passes it so) or ``past_key_values`` (the older name); outputs carry it under the installed version's
field name.

Outputs follow transformers' conventions, with ``return_dict`` True (a ``ModelOutput``) or False (its
non-None fields as a tuple):

* ``output_hidden_states=True``: ``hidden_states`` is a tuple of ``num_hidden_layers + 1`` tensors
  ``float[B, T, d]``: the embedding output (tokens times the scale, plus positions), then each block's
  output, except that under Pre-LN the last entry is taken *after* the final LayerNorm (it equals
  ``last_hidden_state``; the last block's raw output is not returned): GPT-2's convention
  (``GPT2Model`` puts ``ln_f``'s output last). Post-LN and DeepNorm have no final LayerNorm: the last
  entry is the last block's output. With a KV cache only the new tokens' states are returned.
* ``output_attentions=True``: ``attentions`` is a tuple of ``num_hidden_layers`` tensors
  ``float[B, heads, q_len, kv_len]`` (``kv_len`` = cached + new tokens), the softmax weights over keys
  (padded and future keys 0). ``F.scaled_dot_product_attention`` (the default kernel) cannot return
  them, so such a call computes attention explicitly, ``softmax(q k^T / sqrt(head_dim) + mask) v``
  (softmax in fp32), in every layer; its outputs equal the SDPA path's within fp32 rounding. The explicit
  path is also used for every call when the model is loaded with ``attn_implementation="eager"``;
  otherwise SDPA. The weights are those applied to v: after ``qkv_ln`` (when on) and before HeadScale
  and ``out_proj``, in every norm scheme.
* Gradient (activation) checkpointing: ``model.gradient_checkpointing_enable()`` (or
  ``activation_checkpointing_enable()``, or ``Trainer``'s ``gradient_checkpointing=True``) recomputes
  each block in the backward pass (the blocks are transformers' ``GradientCheckpointingLayer``); while
  training with it the KV cache is off (``use_cache=False``, as in GPT-2).
* ``labels``: with ``num_items_in_batch`` (which ``Trainer`` passes) the loss is the summed token loss
  divided by it, as transformers' own causal LMs do, so gradient accumulation scales correctly.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MaskedLMOutput
from transformers.utils import logging

from .configuration_megaformer import MegaformerConfig

logger = logging.get_logger(__name__)

# The outputs' cache field: ``cache`` in recent transformers 5 releases, ``past_key_values`` before.
_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def _one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache passed under either name (``cache``: what ``generate()`` passes in recent releases)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the KV cache once, as cache or as past_key_values")
    return cache if cache is not None else past_key_values


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(head_dim) + mask) v`` and the softmax weights ``[B, heads, T, S]``: what
    ``F.scaled_dot_product_attention`` computes, with its weights. ``q: [B, heads, T, hs]``, ``k, v: [B,
    heads, S, hs]``; ``mask``: bool (True: may attend), broadcast to ``[B, heads, T, S]``, or None for
    causal attention (query i sees keys 0..i + S - T), or for no mask at all when not ``causal`` (the
    masked LM). The softmax runs in fp32."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v), weights


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
    """Multi-head attention with NormFormer's HeadScale and optional q/k/v LayerNorms; causal, or
    bidirectional under ``config.objective == "mlm"`` (the masked LM).

    ``x: float[B, T, d]`` -> (``float[B, T, d]``, the attention weights ``[B, heads, T, past + T]`` when
    ``output_attentions`` else None); with a cache the keys and values of earlier calls are prepended
    (this layer's slot ``layer_idx``). SDPA unless weights are asked for or the model's attention
    implementation is ``"eager"`` (then :func:`eager_attention`).
    """

    def __init__(self, config: MegaformerConfig, layer_idx: int) -> None:
        super().__init__()
        d, nh = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, nh, d // nh
        self.qkv = nn.Linear(d, 3 * d)
        self.qkv_ln = QKVLayerNorm(nh, d // nh, config.layer_norm_eps) if config.qkv_ln else None
        self.head_scale = nn.Parameter(torch.ones(nh)) if config.head_scale else None
        # 'after_out_proj' (fairseq's c_attn): gamma scales out_proj's output in head_dim chunks.
        self.head_scale_after = getattr(config, "head_scale_position", "before_out_proj") == "after_out_proj"
        self.out_proj = nn.Linear(d, d)
        self.is_causal = getattr(config, "objective", "clm") != "mlm"
        self.config = config  # its _attn_implementation is read at call time (set_attn_implementation)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        past_key_values: Cache | None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape  # noqa: N806  (batch size, new tokens)
        nh, hs = self.num_heads, self.head_dim
        qkv = self.qkv(x)
        if self.qkv_ln is not None:
            qkv = self.qkv_ln(qkv)
        q, k, v = qkv.view(B, T, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)  # (B, nh, past + T, hs)
        weights = None
        if output_attentions or getattr(self.config, "_attn_implementation", None) == "eager":
            y, weights = eager_attention(q, k, v, mask, causal=self.is_causal)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        if self.head_scale is not None and not self.head_scale_after:
            y = y * self.head_scale.view(nh, 1)  # before W_O, as the paper
        out = self.out_proj(y.reshape(B, T, nh * hs))
        if self.head_scale is not None and self.head_scale_after:
            out = (out.view(B, T, nh, hs) * self.head_scale.view(nh, 1)).reshape(B, T, nh * hs)
        return out, weights if output_attentions else None


class MegaformerBlock(GradientCheckpointingLayer):
    """One decoder layer; ``[B, T, d]`` -> (``[B, T, d]``, attention weights or None) (formulas in the
    module docstring). Checkpointable: ``x`` is passed positionally, the rest by keyword (the
    checkpoint wrapper drops ``cache`` while recomputing)."""

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

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.norm_scheme != "pre_ln":
            a, weights = self.attn(x, mask, cache, output_attentions)
            h = self.ln1(self.alpha * x + a if self.alpha != 1.0 else x + a)
            f = self.fc2(self.act(self.fc1(h)))
            return self.ln2(self.alpha * h + f if self.alpha != 1.0 else h + f), weights
        a, weights = self.attn(self.ln1(x), mask, cache, output_attentions)
        if self.post_attn_ln is not None:
            a = self.post_attn_ln(a)
        h = x + a
        f = self.act(self.fc1(self.ln2(h)))
        if self.ffn_ln is not None:
            f = self.ffn_ln(f)
        f = self.fc2(f)
        if self.resid_scale is not None:
            h = self.resid_scale * h  # ResScale weights the FFN residual only
        return h + f, weights


class MegaformerPreTrainedModel(PreTrainedModel):
    """Weight init and loading glue shared by the base model and the LM."""

    config_class = MegaformerConfig
    config: MegaformerConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["MegaformerBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True

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
        elif isinstance(module, MegaformerMaskedLMHead):
            module.bias.zero_()


def _attention_mask(
    attention_mask: torch.Tensor | None, past: int, new: int, device: torch.device, causal: bool = True
) -> torch.Tensor | None:
    """``bool[B, 1, new, past + new]`` (True: may attend), or None where plain causal attention over
    the new tokens alone (bidirectional when not ``causal``) is exact (no cache, no padding). A
    padded query row keeps its own key, so that no row is all False (SDPA would return NaN there;
    the row's output is never used)."""
    if past == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    total = past + new
    q_pos = torch.arange(past, total, device=device).view(new, 1)
    k_pos = torch.arange(total, device=device).view(1, total)
    if causal:
        allowed = (k_pos <= q_pos).view(1, 1, new, total)
    else:
        allowed = torch.ones(1, 1, new, total, dtype=torch.bool, device=device)
    if attention_mask is not None:
        keys = attention_mask[:, -total:].bool().view(-1, 1, 1, total)
        allowed = allowed & (keys | (k_pos == q_pos).view(1, 1, new, total))
    return allowed


class MegaformerModel(MegaformerPreTrainedModel):
    """Token ids to the last hidden states ``float[B, T, d]`` (after the final LayerNorm under Pre-LN),
    and on request every layer's hidden states and attention weights (see the module docstring)."""

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
        self.is_causal = getattr(config, "objective", "clm") != "mlm"
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable() (with the blocks')
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
            # position_offset (fairseq: 2): position p reads row p + offset of the sinusoid.
            offset = getattr(self.config, "position_offset", 0)
            table = sinusoidal_positions(limit + offset, self.config.hidden_size)[offset:]
            table = table.to(position_ids.device)
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
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        past_key_values = _one_cache(past_key_values, cache)
        cfg = self.config
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = cfg.return_dict if return_dict is None else return_dict
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if not self.is_causal and (use_cache or past_key_values is not None):
            # Bidirectional attention: cached tokens would not see later ones; no cache to reuse.
            if past_key_values is not None:
                raise ValueError("the masked LM (objective='mlm') attends both ways and takes no KV cache")
            use_cache = False
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing: use_cache=False")
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        new = inputs_embeds.shape[1]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + new, device=inputs_embeds.device).unsqueeze(0)
        x = inputs_embeds * self.embed_scale + self._positions(position_ids).to(inputs_embeds.dtype)
        mask = _attention_mask(attention_mask, past, new, x.device, causal=self.is_causal)
        hidden_states = (x,) if output_hidden_states else None
        attentions = () if output_attentions else None
        for layer in self.layers:
            x, weights = layer(x, mask=mask, cache=past_key_values, output_attentions=output_attentions)
            if output_hidden_states:
                hidden_states += (x,)
            if output_attentions:
                attentions += (weights,)
        if self.final_norm is not None:
            x = self.final_norm(x)
            if output_hidden_states:  # GPT-2's convention: the last entry is after the final LayerNorm
                hidden_states = hidden_states[:-1] + (x,)
        cache_out = {_CACHE_FIELD: past_key_values if use_cache else None}
        out = BaseModelOutputWithPast(
            last_hidden_state=x, hidden_states=hidden_states, attentions=attentions, **cache_out
        )
        return out if return_dict else out.to_tuple()


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
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            cache=cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            num_items = kwargs.get("num_items_in_batch")  # Trainer's token count over accumulated batches
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten().to(logits.device),
                ignore_index=-100,
                reduction="mean" if num_items is None else "sum",
            )
            if num_items is not None:
                loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)},
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()


class MegaformerMaskedLMHead(nn.Module):
    """RoBERTa's LM head as megaformer's ``MaskedLMHead`` + ``masked_lm_logits``:
    ``logits = LayerNorm(GELU(dense(h))) · Eᵀ + bias``, ``float[B, T, d]`` -> ``float[B, T, vocab_size]``;
    ``decoder`` is tied to the token embedding ``E`` (unscaled: ``scale_embedding`` applies to the
    input only, as in megaformer). Weight names follow transformers' ``RobertaLMHead``."""

    def __init__(self, config: MegaformerConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(d, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(hidden)))) + self.bias


class MegaformerForMaskedLM(MegaformerPreTrainedModel):
    """The masked LM (megaformer's ``model.objective: mlm``): bidirectional attention, RoBERTa's LM
    head (:class:`MegaformerMaskedLMHead`); logits ``float[B, T, vocab_size]`` over megaformer's whole
    ``model.vocab_size`` (GPT-2's ids, then ``<mask>`` 50257, ``<s>`` 50258, ``<pad>`` 50259 and the
    never-used rows up to 50264, as RoBERTa-base's 50265). With ``labels`` (original ids at the
    predicted positions, -100 elsewhere) the loss is the mean cross-entropy over the predicted
    positions (megaformer's ``MaskedLMLoss``), or their sum over ``num_items_in_batch`` when
    ``Trainer`` passes it. ``attention_mask`` (0 = padding) hides padded keys; positions count from 0
    (right padding keeps every real token's position)."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.decoder.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegaformerConfig) -> None:
        super().__init__(config)
        self.model = MegaformerModel(config)
        self.lm_head = MegaformerMaskedLMHead(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            num_items = kwargs.get("num_items_in_batch")  # Trainer's count over accumulated batches
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(),
                labels.flatten().to(logits.device),
                ignore_index=-100,
                reduction="mean" if num_items is None else "sum",
            )
            if num_items is not None:
                loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        result = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()
