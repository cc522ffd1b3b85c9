"""Zero-shot evaluation as in the NormFormer paper (Sec. 2.2, Table 2), through lm-evaluation-harness.

    python -m megaformer.tools.zero_shot --checkpoint RUN/checkpoints \\
        --task hellaswag=hellaswag_val.jsonl --task piqa=piqa_valid.jsonl \\
        --task winogrande=winogrande_xl_dev.jsonl --task storycloze=storycloze_2016_val.jsonl \\
        --task openbookqa=openbookqa_test.jsonl [--ppl-data-prefix data/valid_text_document] [--json out.json]

The paper scores WinoGrande, StoryCloze, OpenBookQA, HellaSwag and PIQA zero-shot "with the same
prompts" as GPT-3 (Brown et al. 2020). Prompts, answer choices and scoring are lm-evaluation-harness's
own task configurations (``lm_eval`` 0.4.x: ``hellaswag``, ``piqa``, ``winogrande`` (partial scoring of
the words after the blank, as GPT-3), ``storycloze_2016``, ``openbookqa``), read from local files:
each ``--task NAME=FILE`` writes a task YAML that ``include``s lm_eval's configuration and replaces its
hub dataset by ``FILE`` (JSON lines with the hub dataset's columns; see
``tests/fixtures/zero_shot/SOURCE.md``), so nothing is downloaded. ``--task-dir DIR`` keeps those YAMLs,
for running ``lm_eval --include_path DIR`` directly.

The model is the checkpoint itself (any (tp, pp) layout, consolidated at TP = 1, fp32), scored by
:class:`MegaformerLM`, an lm_eval ``TemplateLM`` registered as ``megaformer`` (``lm_eval --model
megaformer --model_args checkpoint=...`` after ``import megaformer.tools.zero_shot``), or
``--hf-model DIR``, an export of :mod:`megaformer.tools.export_hf`, through lm_eval's ``hf`` model, with
megaformer's own modeling classes registered (the directory's Python files do not run; with
``--trust-checkpoint-code``, ``trust_remote_code=True`` runs them instead). The two give the same
accuracies (tests/distributed/test_export_hf_launch.py).

Reported, as the columns of the paper's Table 2 (HS, PI, WG, SC, OB): lm_eval's ``acc_norm``
(log-likelihood divided by the answer's length in bytes) for HellaSwag, PIQA and OpenBookQA, ``acc``
for WinoGrande and StoryCloze. GPT-3 normalised by tokens, and OpenBookQA by the answer's unconditional
probability, so the figures are lm_eval's, comparable to other lm_eval numbers, not bit-for-bit GPT-3's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

# Our task name -> (lm_eval's task YAML under lm_eval/tasks, the paper's column, the metric reported).
TASKS: dict[str, tuple[str, str, str]] = {
    "hellaswag": ("hellaswag/hellaswag.yaml", "HS", "acc_norm"),
    "piqa": ("piqa/piqa.yaml", "PI", "acc_norm"),
    "winogrande": ("winogrande/default.yaml", "WG", "acc"),
    "storycloze": ("storycloze/storycloze_2016.yaml", "SC", "acc"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "OB", "acc_norm"),
}
PREFIX = "megaformer_"  # our tasks' names in lm_eval: megaformer_<name>


def write_task_configs(task_files: dict[str, str], out_dir: str) -> list[str]:
    """One lm_eval task YAML per ``{name: jsonl file}``: lm_eval's configuration of the task, its
    dataset replaced by the local file (as the validation split, the one scored). Returns the task
    names (``megaformer_<name>``).

    Raises:
        ValueError: an unknown task name or a missing file.
    """
    import lm_eval.tasks
    import yaml

    stock_dir = Path(lm_eval.tasks.__file__).parent
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for name, path in task_files.items():
        if name not in TASKS:
            raise ValueError(f"--task {name}=...: unknown task; use one of {sorted(TASKS)}")
        if not os.path.isfile(path):
            raise ValueError(f"--task {name}={path}: no such file (JSON lines with the dataset's columns)")
        stock = stock_dir / TASKS[name][0]
        if not stock.is_file():
            raise ValueError(
                f"{stock}: lm_eval's {name} task configuration is missing (lm_eval 0.4.x expected)"
            )
        config = {
            "include": str(stock),
            "task": PREFIX + name,
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": os.path.abspath(path)}},
            "training_split": None,
            "validation_split": "validation",
            "test_split": None,
        }
        with open(os.path.join(out_dir, f"{PREFIX}{name}.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        names.append(PREFIX + name)
    return names


def _template_lm():
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class MegaformerLM(_template_lm()):
    """lm_eval model scoring with megaformer's own model, loaded from a checkpoint of any layout.

    Args:
        checkpoint: a run's ``checkpoints/`` directory or one ``global_stepN``.
        tag: checkpoint tag (default: ``latest``).
        batch_size: requests per forward pass (each padded on the right to the longest).
        device: ``cpu`` / ``cuda``.
        vocab_file, merge_file: the GPT-2 BPE files (default ``data/gpt2-bpe``).

    Log-likelihoods: ``sum_t log p(continuation_t | context, continuation_<t)`` in fp32 over the
    last ``seq_len + 1`` tokens of context + continuation (the context is cut on the left, as lm_eval's
    ``hf`` model does), and whether every continuation token is the argmax.
    """

    def __init__(
        self,
        checkpoint: str,
        tag: str | None = None,
        batch_size: int | str = 8,
        device: str = "cpu",
        vocab_file: str | None = None,
        merge_file: str | None = None,
        trust_checkpoint_code: bool | str = False,
        **kwargs,
    ) -> None:
        super().__init__()
        from data_tools.tokenizer import build_tokenizer
        from megaformer.tools.generate import REPO, load_for_generation

        # lm_eval's --model_args pass strings: only "true" (any case) trusts the file's code.
        trust = trust_checkpoint_code is True or str(trust_checkpoint_code).lower() == "true"
        self.model, self.config, self.step = load_for_generation(checkpoint, tag, trust)
        self._device = torch.device(device)
        self.model.to(self._device)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.tokenizer = build_tokenizer(
            "GPT2BPETokenizer",
            vocab_file=vocab_file or str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
            merge_file=merge_file or str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
        )

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        window = self.config.seq_len + 1
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            rows = [(ctx + cont)[-window:][:-1] for _, ctx, cont in batch]  # inputs, T_i <= seq_len
            width = max(len(r) for r in rows)
            tokens = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for i, r in enumerate(rows):
                tokens[i, : len(r)] = torch.tensor(r)
            with torch.no_grad():
                logp = F.log_softmax(
                    self.model(tokens.to(self._device)).float(), dim=-1
                ).cpu()  # (B, T, V_pad)
            for i, (_, _, cont) in enumerate(batch):
                n, length = len(cont), len(rows[i])
                scores = logp[i, length - n : length]  # predictions of the continuation's tokens
                target = torch.tensor(cont)
                total = float(scores.gather(1, target[:, None]).sum())
                out.append((total, bool((scores.argmax(dim=-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("megaformer's lm_eval model scores multiple-choice tasks only")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("megaformer's lm_eval model scores multiple-choice tasks only")


def _register() -> None:
    from lm_eval.api.registry import register_model

    with contextlib.suppress(AssertionError, ValueError):  # already registered (imported twice)
        register_model("megaformer")(MegaformerLM)


_register()


def evaluate_tasks(lm, task_files: dict[str, str], *, task_dir: str, limit: int | None = None) -> dict:
    """lm_eval's results for our tasks: ``{name: {"acc": ..., "acc_norm": ..., "n": ...}}``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names = write_task_configs(task_files, task_dir)
    results = simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        limit=limit,
        bootstrap_iters=0,
        log_samples=False,
    )
    out = {}
    for name in task_files:
        res = results["results"][PREFIX + name]
        out[name] = {k.split(",")[0]: v for k, v in res.items() if k.endswith(",none") and "stderr" not in k}
        out[name]["n"] = results["n-samples"][PREFIX + name]["effective"]
    return out


def table(rows: list[dict]) -> str:
    """The paper's Table 2 layout (Markdown): model, parameters (M), PPL, HS, PI, WG, SC, OB, Avg."""
    cols = [TASKS[n][1] for n in TASKS]
    lines = ["| Model | \\|θ\\| (M) | PPL | " + " | ".join(cols) + " | Avg |", "|---" * (len(cols) + 4) + "|"]
    for row in rows:
        accs = [row["tasks"].get(n) for n in TASKS]
        vals = [None if a is None else 100 * a[TASKS[n][2]] for n, a in zip(TASKS, accs)]
        shown = [v for v in vals if v is not None]
        avg = f"{sum(shown) / len(shown):.1f}" if shown else "-"
        ppl = f"{row['ppl']:.2f}" if row.get("ppl") is not None and math.isfinite(row["ppl"]) else "-"
        cells = ["-" if v is None else f"{v:.1f}" for v in vals]
        lines.append(
            f"| {row['model']} | {row['params_m']:.1f} | {ppl} | " + " | ".join(cells) + f" | {avg} |"
        )
    return "\n".join(lines)


def _parse_tasks(items: Sequence[str]) -> dict[str, str]:
    tasks = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--task {item!r}: write NAME=FILE, e.g. --task piqa=piqa_valid.jsonl")
        tasks[name] = path
    return tasks


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the table; 0, or 2 for a bad checkpoint, task or file."""
    from megaformer.training.safe_load import TRUST_FLAG, CheckpointReadError

    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.zero_shot",
        description="Zero-shot accuracies (lm-evaluation-harness) in the layout of the paper's Table 2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run's checkpoints/ directory or one global_stepN")
    src.add_argument("--hf-model", help="a directory written by megaformer.tools.export_hf")
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument("--task", action="append", required=True, help=f"NAME=FILE.jsonl, NAME in {sorted(TASKS)}")
    p.add_argument("--ppl-data-prefix", default=None, help="dataset for the PPL column (--checkpoint)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--task-dir", default=None, help="keep the generated lm_eval task YAMLs here")
    p.add_argument("--name", default=None, help="the model's name in the table")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        TRUST_FLAG,
        action="store_true",
        help="--checkpoint: unpickle it in full; --hf-model: run the directory's own modeling code "
        "(trust_remote_code). Either can run code: only for a source you trust",
    )
    args = p.parse_args(argv)
    try:
        tasks = _parse_tasks(args.task)
        lm, params, ppl = _model(args)
        with tempfile.TemporaryDirectory() as tmp:
            results = evaluate_tasks(lm, tasks, task_dir=args.task_dir or tmp, limit=args.limit)
    except (ValueError, CheckpointReadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or Path(args.checkpoint or args.hf_model).resolve().parent.name
    row = {"model": name, "params_m": params / 1e6, "ppl": ppl, "tasks": results}
    print(table([row]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=2)
    return 0


def _model(args) -> tuple[object, int, float | None]:
    """The lm_eval model, its parameter count and the PPL column's value (None: not measured)."""
    if args.hf_model:
        from lm_eval.models.huggingface import HFLM

        from megaformer.tools.export_hf import register_auto_classes

        if args.trust_checkpoint_code:
            from megaformer.training.safe_load import warn_trusted

            warn_trusted(f"{args.hf_model} (its modeling code, trust_remote_code=True)")
        else:
            register_auto_classes()  # a megaformer export runs this installation's code, not the directory's
        lm = HFLM(
            pretrained=args.hf_model,
            trust_remote_code=args.trust_checkpoint_code,
            batch_size=args.batch_size,
            device=args.device,
        )
        return lm, sum(p.numel() for p in lm.model.parameters()), None
    from megaformer.model import vocab_param_names

    lm = MegaformerLM(
        args.checkpoint,
        args.tag,
        batch_size=args.batch_size,
        device=args.device,
        trust_checkpoint_code=args.trust_checkpoint_code,
    )
    padded = set(vocab_param_names(lm.config))  # their rows above vocab_size are padding, not counted
    params = sum(
        (p[: lm.config.vocab_size] if name in padded else p).numel()
        for name, p in lm.model.named_parameters()
    )
    ppl = None
    if args.ppl_data_prefix:
        from megaformer.tools.evaluate import dataset_loss

        ppl = dataset_loss(lm.model, args.ppl_data_prefix, lm.config.seq_len, device=args.device)["ppl"]
    return lm, params, ppl


if __name__ == "__main__":
    sys.exit(main())
