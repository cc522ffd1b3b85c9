"""GPU tests: marked ``gpu`` and skipped where CUDA is not available (CI's CPU machines).

Run them on a machine with a GPU: ``.venv/bin/python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import gutenberg_prefix  # noqa: F401  (the launcher runs' data)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
