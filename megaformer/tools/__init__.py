"""Commands on top of everything: checkpoints (reshard, export, generate, evaluate, zero-shot,
fine-tune, import from fairseq), plots, and the planner and dry run over :mod:`megaformer.perf`."""
