"""Offline corpus tools: tokenize to Megatron .bin/.idx, inspect, train a tokenizer (numpy only)."""
