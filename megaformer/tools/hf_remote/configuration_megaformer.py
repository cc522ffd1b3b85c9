"""Hugging Face configuration of a megaformer model (NormFormer / Pre-LN / Post-LN / DeepNorm), a causal
LM (decoder) or, with ``objective="mlm"``, a RoBERTa-style masked LM (bidirectional encoder).

Shipped next to the weights by ``python -m megaformer.tools.export_hf`` and loaded with
``trust_remote_code=True``; it imports only ``transformers``. The fields are the checkpoint's
``model`` section (see ``megaformer/config/schema.py``, ``ModelConfig``) under the names transformers
uses where one exists (``max_position_embeddings`` = ``seq_len``, ``intermediate_size`` = the FFN
width, ``layer_norm_eps`` = ``layernorm_eps``, ``tie_word_embeddings`` = ``tie_embeddings``).
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig


class MegaformerConfig(PretrainedConfig):
    """Shape and normalisation scheme of an exported megaformer model.

    Args:
        vocab_size: tokenizer vocabulary (GPT-2 BPE: 50257; the masked LM: megaformer's
            ``model.vocab_size``, 50265, with ``<mask>`` / ``<s>`` / ``<pad>`` at 50257..50259); the
            export drops megaformer's padding rows (those beyond ``model.vocab_size``).
        objective: ``"clm"`` (causal attention, ``MegaformerForCausalLM``) or ``"mlm"`` (bidirectional
            attention, ``MegaformerForMaskedLM`` with RoBERTa's LM head; no KV cache).
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: width d, layers N,
            heads, FFN width.
        max_position_embeddings: megaformer's ``seq_len``: the longest context (position table size).
        position_embedding: ``"sinusoidal"`` (fixed table, fairseq layout) or ``"learned"``.
        activation: ``"gelu"`` (erf form) or ``"relu2"`` (squared ReLU).
        norm_scheme: ``"pre_ln"``, ``"post_ln"`` or ``"deepnorm"`` (residual weight
            ``deepnorm_alpha`` = (2N)^(1/4) inside the post-sublayer LayerNorm).
        post_attn_ln, head_scale, ffn_ln, resid_scale, qkv_ln: NormFormer's switches (Pre-LN only).
        head_scale_position: 'before_out_proj' (the paper) or 'after_out_proj' (fairseq's c_attn:
            out_proj's output, bias included, times gamma in head_dim chunks).
        position_offset: sinusoidal row of position 0 (fairseq: 2).
        layer_norm_eps: epsilon of every LayerNorm.
        scale_embedding: token embeddings times sqrt(d) before the positions are added.
        tie_word_embeddings: the output projection is the token embedding.
    """

    model_type = "megaformer"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50257,
        objective: str = "clm",
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 256,
        position_embedding: str = "sinusoidal",
        activation: str = "gelu",
        norm_scheme: str = "pre_ln",
        post_attn_ln: bool = True,
        head_scale: bool = True,
        ffn_ln: bool = True,
        resid_scale: bool = False,
        qkv_ln: bool = False,
        head_scale_position: str = "before_out_proj",
        position_offset: int = 0,
        deepnorm_alpha: float = 1.0,
        layer_norm_eps: float = 1e-5,
        scale_embedding: bool = True,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int = 50256,
        eos_token_id: int = 50256,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.objective = objective
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding = position_embedding
        self.activation = activation
        self.norm_scheme = norm_scheme
        self.post_attn_ln = post_attn_ln
        self.head_scale = head_scale
        self.ffn_ln = ffn_ln
        self.resid_scale = resid_scale
        self.qkv_ln = qkv_ln
        self.head_scale_position = head_scale_position
        self.position_offset = position_offset
        self.deepnorm_alpha = deepnorm_alpha
        self.layer_norm_eps = layer_norm_eps
        self.scale_embedding = scale_embedding
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
