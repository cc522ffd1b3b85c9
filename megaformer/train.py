"""Entry point run by ``launch/pretrain.sh``: ``python -m megaformer.train CONFIG.yaml [key=value ...]``.

The ``deepspeed`` launcher appends ``--local_rank=N``; it is accepted and ignored (LOCAL_RANK is
read from the environment).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from megaformer.config import ConfigError, load_config, validate_layout


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a process count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the job's process count, an integer >= 1")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megaformer.train",
        description="Pretrain a NormFormer LM with DeepSpeed; overrides: section.key=value.",
    )
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides applied after the YAML")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="only load and validate the config with its overrides and a resume's rules from the "
        "checkpoint's manifest (exit 0, or 2 with the error); launch/pretrain.sh runs it before the "
        "launcher starts one worker per rank",
    )
    parser.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --check-config: the job's process count, to check the layout too (tp × pp "
        "dividing it, the global batch dividing into micro-batches of every data-parallel rank)",
    )
    parser.add_argument(
        "--check-files",
        action="store_true",
        help="with --check-config: check the files here too (output.dir writable, the datasets, the "
        "held-out split); launch/pretrain.sh asks it on a single node, where its workers will run",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Load the config, train, exit cleanly: 0 when the run is complete (also when it was complete
    before this launch, which then changes nothing), 75 when it stopped early
    for a signal or ``train.exit_duration_mins`` with its checkpoint saved (resume to continue),
    2 on a configuration, data or checkpoint error, or an ``output.dir`` another live run holds
    (:mod:`megaformer.training.run_lock`)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.check_config:  # before torch and DeepSpeed are imported: a fraction of a second
        from data_tools.errors import DataFormatError
        from megaformer.checkpoint.resume_rules import check_before_launch
        from megaformer.training.data_checks import check_files_before_launch

        try:
            cfg = load_config(args.config, args.overrides)
            if args.world_size is not None:
                validate_layout(cfg, args.world_size)
            # the layout, output.dir, the datasets and the held-out split, then the resume /
            # extension / init_from rules from the checkpoints' manifests: each said once, here,
            # not by every rank after its start-up
            if args.check_files:
                check_files_before_launch(cfg)
            check_before_launch(cfg)
        except (ConfigError, DataFormatError) as e:  # CheckpointError (a damaged 'latest') is one too
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        sys.exit(0)
    from megaformer.training.supervisor import join_launcher_group

    join_launcher_group()  # under launch/pretrain.sh: in its group; its supervisor forwards Ctrl-C
    # DeepSpeed's ZeRO still calls the deprecated torch name once per step; the warning says nothing
    # a user can act on and buries the step log.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)
    from data_tools.errors import DataFormatError
    from megaformer.checkpoint.safe_load import CheckpointReadError
    from megaformer.training.distributed import finish
    from megaformer.training.stopping import EXIT_CODE_STOPPED

    try:
        cfg = load_config(args.config, args.overrides)
        from megaformer.training.run_lock import hold_run_dir
        from megaformer.training.trainer import train

        with hold_run_dir(cfg):  # rank 0 owns output.dir until it exits (megaformer/training/run_lock.py)
            summary = train(cfg)
    except (ConfigError, DataFormatError, CheckpointReadError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        finish(2)
    finish(EXIT_CODE_STOPPED if summary.get("stopped") else 0)


if __name__ == "__main__":
    main()
