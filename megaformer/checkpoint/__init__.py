"""Checkpoints as their own layer, below training and the tools: DeepSpeed's checkpoint format
(:mod:`.formats`), the files' integrity (manifests, sha256, tags: :mod:`.integrity`), weights-only
reading (:mod:`.safe_load`), generator states (:mod:`.rng_state`), storage checks and atomic writes
(:mod:`.storage`), and consolidation of a checkpoint of any (tp, pp) into full tensors, resharding
and loading into a model of any layout (:mod:`.reshard`). The trainer's saving and resuming is
:mod:`megaformer.training.checkpointer`, which uses this package; nothing here imports
``megaformer.training`` or ``megaformer.tools`` (``tests/unit/test_boundaries.py``)."""
