"""Merge the shards of a sharded ``preprocess`` run into the outputs of one unsharded run.

    python -m data_tools.merge_shards --num-shards 64 --input 'data/raw/*.jsonl.zst' \\
        --output-prefix data/processed/c4 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-bpe/encoder.json --merge-file gpt2-bpe/vocab.bpe --append-eod

takes the ``preprocess`` arguments the shards were made with (without ``--shard-index``), checks
that each of the K shards is finished from the current inputs and settings (its ``.shard.json``
manifest, see :func:`data_tools.preprocess.shard_finished`), and concatenates them in shard order
(:func:`data_tools.merge.merge`) into ``{prefix}_{key}_document``: byte for byte what one
``preprocess`` run over all the inputs writes. The shards are kept. With ``--check`` it only makes
the checks possible before any shard exists (flags, inputs, at most one shard per input file, the
output prefix, the tokenizer files): ``launch/preprocess.sbatch`` runs that before it submits.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence

from data_tools.atomic import sigterm_as_interrupt
from data_tools.errors import DataToolsError, PreprocessError
from data_tools.merge import merge
from data_tools.preprocess import RunPlan, build_parser, plan_run, shard_finished
from data_tools.stats import stats_path

__all__ = ["main", "merge_shards", "shard_plans"]


def _with_shard(args: argparse.Namespace, num_shards: int, shard_index: int | None) -> argparse.Namespace:
    shard_args = copy.copy(args)
    shard_args.num_shards, shard_args.shard_index = num_shards, shard_index
    return shard_args


def shard_plans(args: argparse.Namespace, num_shards: int) -> tuple[RunPlan, list[RunPlan]]:
    """The plan of the unsharded run of ``args`` and of each of its ``num_shards`` shards (one
    tokenizer build for all).

    Raises:
        PreprocessError: bad flags or inputs, ``args`` naming a shard, or more shards than files.
        OutputError: an ``--output-prefix`` that cannot name files.
        TokenizerError: bad tokenizer files.
    """
    if args.num_shards != 1 or args.shard_index is not None:
        raise PreprocessError(
            "the preprocess arguments name a shard (--num-shards/--shard-index); give the number of "
            "shards only once, as this command's --num-shards, and no --shard-index"
        )
    if num_shards < 1:
        raise PreprocessError(f"--num-shards must be at least 1, got {num_shards}")
    whole = plan_run(args)
    tokenizer = whole.tokenizer
    if num_shards == 1:
        return whole, []
    return whole, [plan_run(_with_shard(args, num_shards, i), tokenizer) for i in range(num_shards)]


def merge_shards(args: argparse.Namespace, num_shards: int) -> list[tuple[str, int, int]]:
    """Merges the ``num_shards`` finished shards of ``args`` into the unsharded outputs, per key;
    returns ``(output prefix, documents, tokens)`` per key.

    Raises:
        PreprocessError: a shard not finished (naming each and why, with the fix), or what
            :func:`shard_plans` raises.
        DataFormatError: a shard's dataset is corrupt.
    """
    whole, shards = shard_plans(args, num_shards)
    if not shards:
        raise PreprocessError("--num-shards 1: there is nothing to merge; run data_tools.preprocess alone")
    unfinished = []
    for index, plan in enumerate(shards):
        done, why = shard_finished(plan)
        if not done:
            unfinished.append((index, why or f"{plan.outputs[0]}.idx does not exist"))
    if unfinished:
        indices = ",".join(str(i) for i, _ in unfinished)
        reasons = "; ".join(f"shard {i}: {why}" for i, why in unfinished[:3])
        raise PreprocessError(
            f"{len(unfinished)} of {num_shards} shards of {whole.output_prefix} are not finished "
            f"({reasons}); run them first (array tasks {indices}: sbatch --array={indices} with "
            f"PREPROCESS_NUM_SHARDS={num_shards}, or python -m data_tools.preprocess ... --num-shards "
            f"{num_shards} --shard-index I; finished shards are skipped), then merge again"
        )
    merged = []
    for k, output in enumerate(whole.outputs):
        docs, tokens = merge([plan.outputs[k] for plan in shards], output, eod_token=whole.eod)
        merged.append((output, docs, tokens))
    return merged


def build_merge_parser() -> argparse.ArgumentParser:
    """This command's own flags; every other argument is ``preprocess``'s."""
    p = argparse.ArgumentParser(
        prog="python -m data_tools.merge_shards",
        description="Merge the shards of data_tools.preprocess --num-shards K into one run's outputs.",
        usage="%(prog)s --num-shards K [--check] PREPROCESS_ARGUMENTS...",
    )
    p.add_argument("--num-shards", type=int, required=True, help="the number of shards (K)")
    p.add_argument(
        "--check",
        action="store_true",
        help="only check the arguments, the inputs and the tokenizer files (before the shards run)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; 0 ok, 2 bad input or an unfinished shard, 130 interrupted."""
    own, rest = build_merge_parser().parse_known_args(argv)
    args = build_parser().parse_args(rest)
    try:
        sigterm_as_interrupt()  # a scheduler's kill removes the merge's .tmp files like Ctrl-C does
        if own.check:
            whole, shards = shard_plans(args, own.num_shards)
            files = sum(len(plan.paths) for plan in shards) or len(whole.paths)
            print(
                f"ok: {files} input files in {own.num_shards} shard(s); merged into "
                + ", ".join(whole.outputs)
            )
            return 0
        merged = merge_shards(args, own.num_shards)
    except DataToolsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted; the merged outputs not finished were removed: rerun to redo them", file=sys.stderr
        )
        return 130
    for output, docs, tokens in merged:
        print(f"merged {own.num_shards} shards into {output}: {docs:,} documents, {tokens:,} tokens")
        print(f"wrote {output}.bin, {output}.idx and {stats_path(output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
