"""Megatron ``tools/preprocess_data.py`` flags that shape or name the output, for ``data_tools.preprocess``.

* ``--split-sentences``: one sequence per sentence (:mod:`data_tools.sentences`), the documents
  still delimited in the ``.idx`` (Megatron's sentence-level datasets, for BERT/T5-style models);
  the outputs are named ``{prefix}_{key}_sentence``, as Megatron names them, instead of
  ``_document``. The EOD (``--append-eod``) ends the last sentence of each document, and a
  sentence with no tokens is left out, as in Megatron.
* ``--keep-newlines``: with ``--split-sentences``, the whitespace after a sentence (newlines
  included) stays at its end instead of being dropped. Without ``--split-sentences`` it changes
  nothing, in Megatron as here.
* ``--lang``: only ``english``.
* ``--partitions P``: Megatron's document order for P partitions (:mod:`data_tools.partitions`);
  ``--keep-sequential-samples`` keeps the input order (what Megatron does with it).
* ``--output-prefix`` that already ends in ``_{key}_document`` (``_sentence``), as the training
  config's ``data.prefix`` does, is not given the suffix twice.
"""

from __future__ import annotations

import argparse

from data_tools.errors import PreprocessError

__all__ = ["add_megatron_flags", "check_megatron_flags", "level", "strip_suffix"]


def add_megatron_flags(p: argparse.ArgumentParser) -> None:
    """Adds the flags of the module docstring to the ``preprocess`` parser."""
    g = p.add_argument_group("Megatron preprocess_data.py flags")
    g.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence (offline splitter)"
    )
    g.add_argument(
        "--keep-newlines", action="store_true", help="with --split-sentences: keep whitespace after sentences"
    )
    g.add_argument("--lang", default="english", help="sentence-splitting language (english only)")
    g.add_argument("--partitions", type=int, default=1, help="Megatron's document order for P partitions")
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: keep the input order (Megatron's contiguous partitions)",
    )


def check_megatron_flags(args: argparse.Namespace) -> None:
    """Raises PreprocessError for values these flags cannot take."""
    if args.lang != "english":
        raise PreprocessError(
            f"--lang {args.lang}: the offline sentence splitter knows English only (data_tools.sentences)"
        )
    if args.partitions < 1:
        raise PreprocessError(f"--partitions must be at least 1, got {args.partitions}")


def level(args: argparse.Namespace) -> str:
    """``sentence`` with ``--split-sentences``, else ``document``: the last word of the output names."""
    return "sentence" if args.split_sentences else "document"


def strip_suffix(output_prefix: str, keys: list[str], lvl: str) -> str:
    """``output_prefix`` without a trailing ``_{key}_{level}`` (one key only), so that
    ``--output-prefix data/c4_text_document`` writes ``data/c4_text_document.bin``, not
    ``data/c4_text_document_text_document.bin``."""
    suffix = f"_{keys[0]}_{lvl}"
    if len(keys) == 1 and output_prefix.endswith(suffix) and len(output_prefix) > len(suffix):
        return output_prefix[: -len(suffix)]
    return output_prefix
