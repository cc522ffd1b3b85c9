"""Offline tools that operate on megaformer checkpoints."""
