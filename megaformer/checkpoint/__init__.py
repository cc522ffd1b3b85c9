"""Every checkpoint concern as its own layer, below training and the tools, behind one manager
(:class:`~megaformer.checkpoint.manager.CheckpointManager`: the checks before a fresh start, the
resume plan, saving and resuming): what may change on a resume (:mod:`.resume_rules`), DeepSpeed's
checkpoint format (:mod:`.formats`), the files' integrity (manifests, sha256, tags:
:mod:`.integrity`), weights-only reading (:mod:`.safe_load`), generator states (:mod:`.rng_state`),
storage checks and atomic writes (:mod:`.storage`), and consolidation of a checkpoint of any
(tp, pp) into full tensors, resharding and loading into a model of any layout (:mod:`.reshard`).
Nothing here imports ``megaformer.training``, ``megaformer.tools`` or ``megaformer.experiments``
(``tests/unit/test_boundaries.py``); DeepSpeed's engine is reached through the object the trainer
attaches (its ``save``/``load``)."""
