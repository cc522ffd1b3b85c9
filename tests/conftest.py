"""Settings every test tier shares, made before any test module imports torch."""

from __future__ import annotations

import os

# Inductor compiles its C++ kernels in a pool of worker processes by default (one per core), each
# of which imports torch first. On the 2-core CI machine the suite already runs two pytest workers,
# so the pool only adds those imports: tests/unit/test_compiled_block.py took 91-92 s with one
# compile thread against 113-115 s with the default two, from an empty inductor cache, paired, on
# 2026-12-07's VM. Set in the environment so the launched ranks inherit it; a value the caller
# exported wins.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
