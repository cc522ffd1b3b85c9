"""Test-only: a fault in one rank's checkpoint write, injected into a launched run.

Production code has no test hook; a test that needs a failing or stuck writer puts this directory
on ``PYTHONPATH`` (every Python process of the run imports it at start-up) and sets

    MEGAFORMER_TEST_SAVE_FAULT=RANK:STEP:FILE:ACTION

The worker whose ``RANK`` is RANK wraps ``torch.save`` (DeepSpeed's checkpoint engine and the
generator-state writer call it); every other process leaves it alone and imports nothing. When
that worker saves a file named FILE (its base name, without a ``.tmp`` suffix) under
``global_stepSTEP/``, ACTION happens:

- ``stall``: the file is written, then the worker prints ``[save-fault] rank R: stalls after
  writing PATH`` and sleeps for 10 minutes (a slow or stuck writer; the test kills the job).
- ``torch-full``: half of the file is written, then the ``RuntimeError`` torch's zip writer raises
  on a full disk (``[enforce fail at inline_container.cc:672] . unexpected pos``: no errno).
- ``enospc`` / ``edquot``: half of the file is written, then ``OSError`` with that errno and path.
- ``erofs``: nothing is written; ``OSError(EROFS)`` with the path.
"""

import os

_SPEC = os.environ.get("MEGAFORMER_TEST_SAVE_FAULT", "").split(":")


def _install(step: str, name: str, action: str) -> None:
    import errno
    import time

    import torch

    save = torch.save

    def faulty_save(obj, f, *args, **kwargs):
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else ""
        base = os.path.basename(path).split(".tmp")[0]
        chosen = f"global_step{step}{os.sep}" in path and base == name
        if not chosen:
            return save(obj, f, *args, **kwargs)
        rank = os.environ["RANK"]
        if action == "stall":
            save(obj, f, *args, **kwargs)
            print(f"[save-fault] rank {rank}: stalls after writing {path}", flush=True)
            time.sleep(600)
            return None
        print(f"[save-fault] rank {rank}: {action} at {path}", flush=True)
        if action == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        save(obj, f, *args, **kwargs)
        size = os.path.getsize(path)
        with open(path, "r+b") as out:
            out.truncate(size // 2)
        if action == "torch-full":
            raise RuntimeError(
                f"[enforce fail at inline_container.cc:672] . unexpected pos {size // 2 + 112} vs {size // 2}"
            )
        code = {"enospc": errno.ENOSPC, "edquot": errno.EDQUOT}[action]
        raise OSError(code, os.strerror(code), path)

    torch.save = faulty_save


if len(_SPEC) == 4 and os.environ.get("RANK") == _SPEC[0]:
    _install(*_SPEC[1:])
