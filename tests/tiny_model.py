"""The tiny model configuration the single-process and TP tests share."""

from __future__ import annotations

from megaformer.config.schema import ModelConfig

# 2 layers, d 32, 4 heads, seq_len 16; vocabulary 97 with divisible_by 16 -> padded to 112 at TP = 1
# (128 at TP = 2 and 4), so the padded rows are exercised. NormFormer's switches at their defaults
# (post-attention LN, HeadScale, FFN LN on), tied embeddings, sinusoidal positions, GELU.
TINY_MODEL = ModelConfig(
    vocab_size=97,
    make_vocab_size_divisible_by=16,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    seq_len=16,
)
