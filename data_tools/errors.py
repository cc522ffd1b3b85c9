"""Typed errors of the data tools: each one is a mistake in the user's files or flags, not a bug.

Every message names the file (and line or row where there is one), what was expected, what was
found and, where there is one, the fix. Command-line entry points print them as one ``error: ...``
line and exit with status 2; anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class DataToolsError(ValueError):
    """Base class of the errors the data tools raise for bad inputs or flags."""


class DataFormatError(DataToolsError):
    """A ``.bin``/``.idx`` pair does not follow Megatron's ``MMIDIDX`` layout (or is truncated)."""


class TokenizerError(DataToolsError):
    """A tokenizer file is missing, of the wrong kind or internally inconsistent."""


class PreprocessError(DataToolsError):
    """An input file or record cannot be turned into tokens (and ``--skip-bad-records`` is off)."""


class WorkerError(DataToolsError):
    """A worker process ended in the middle of the run (killed by a signal, the out-of-memory
    killer, a crash); the other workers have been stopped."""


class OutputError(DataToolsError):
    """An output cannot be written (no space left, a quota, a read-only directory); the partial
    output has been removed."""
