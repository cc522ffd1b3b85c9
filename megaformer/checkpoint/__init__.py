"""Checkpoints as their own layer, below the tools: tag resolution, consolidation of a checkpoint of
any (tp, pp) into full tensors, resharding, and loading them into a model of any layout
(:mod:`.reshard`). The files' integrity (manifests, sha256) and the weights-only reading are
:mod:`megaformer.training.ckpt_integrity` and :mod:`megaformer.training.safe_load`; the trainer's
saving and resuming is :mod:`megaformer.training.checkpointer`. Nothing here imports
``megaformer.tools`` (``tests/unit/test_boundaries.py``)."""
