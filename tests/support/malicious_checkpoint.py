"""A checkpoint that runs code when unpickled in full: the attack the safe loader must refuse.

:func:`plant_payload` adds one object to a weights file whose pickle calls ``os.system("touch
MARKER")`` (a ``__reduce__`` naming ``os.system``), then rewrites the manifest's size and sha256 for
it, as whoever hands over a checkpoint would (they hand over its manifest too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megaformer.checkpoint import integrity


class Payload:
    """Unpickling this calls ``os.system(command)``; pickling stores only the call, not the class."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def plant_payload(tag_dir: Path, marker: Path, file: str = "mp_rank_00_model_states.pt") -> str:
    """Add the payload to ``tag_dir/file`` (a dict) and make the manifest match; returns the file's
    path. The marker file is created if, and only if, the file is unpickled in full."""
    path = Path(tag_dir) / file
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["extra"] = Payload(f"touch {marker}")
    torch.save(state, path)
    manifest = Path(tag_dir) / integrity.MANIFEST
    if manifest.exists():
        body = json.loads(manifest.read_text())
        body["files"].update(integrity.describe_files(str(tag_dir), [file]))
        manifest.write_text(json.dumps(body, indent=2))
    assert not marker.exists()
    return str(path)
