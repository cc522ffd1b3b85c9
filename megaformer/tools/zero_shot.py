"""Zero-shot (and few-shot) evaluation through lm-evaluation-harness, the paper's tasks laid out as its
Table 2 (NormFormer, Sec. 2.2).

    python -m megaformer.tools.zero_shot --checkpoint RUN/checkpoints \\
        --task hellaswag=hellaswag_val.jsonl --task piqa=piqa_valid.jsonl \\
        --task winogrande=winogrande_xl_dev.jsonl --task storycloze=storycloze_2016_val.jsonl \\
        --task openbookqa=openbookqa_test.jsonl [--json out.json] \\
        [--ppl-data-prefix data/processed/gutenberg_text_document] [--ppl-max-tokens 262144]
    python -m megaformer.tools.zero_shot --checkpoint RUN/checkpoints --tasks arc_easy,my_task.yaml \\
        [--num-fewshot 5] [--include-path DIR]

Tasks: ``--tasks`` takes any lm_eval task, group or tag name, a path to a task YAML file or a directory
of them (:mod:`megaformer.tools.lm_eval_tasks`); ``--task NAME=FILE`` scores one of the paper's five
tasks on a local JSON-lines file. Without either, the paper's five by their lm_eval names (their hub
datasets; StoryCloze needs its manual download). ``--num-fewshot K`` is passed to lm_eval (a task whose
YAML sets ``num_fewshot: 0`` keeps 0, as lm_eval does).

The paper scores WinoGrande, StoryCloze, OpenBookQA, HellaSwag and PIQA zero-shot "with the same
prompts" as GPT-3 (Brown et al. 2020). Prompts, answer choices and scoring are lm-evaluation-harness's
own task configurations (``lm_eval`` 0.4.x: ``hellaswag``, ``piqa``, ``winogrande`` (partial scoring of
the words after the blank, as GPT-3), ``storycloze_2016``, ``openbookqa``); each ``--task NAME=FILE``
writes a task YAML that ``include``s lm_eval's configuration and replaces its hub dataset by ``FILE``
(JSON lines with the hub dataset's columns, checked line by line first; see
``tests/fixtures/zero_shot/SOURCE.md``), so nothing is downloaded. ``--task-dir DIR`` keeps those YAMLs,
for running ``lm_eval --include_path DIR`` directly.

The model is the checkpoint itself (any (tp, pp) layout, consolidated at TP = 1, fp32), scored by
:class:`MegaformerLM`, an lm_eval ``TemplateLM`` registered as ``megaformer``: by importing this
module, and for lm_eval's own command line through the ``lm_eval.models`` entry point in
pyproject.toml (read by lm_eval releases with entry-point plugins; on lm_eval 0.4.13, which does not
read entry points, run ``megaformer-lm-eval --model megaformer --model_args checkpoint=...``,
:mod:`megaformer.tools.lm_eval_cli`). Or ``--hf-model DIR``, an export of
:mod:`megaformer.tools.export_hf`, through lm_eval's ``hf`` model, with megaformer's own modeling
classes registered (the directory's Python files do not run; with ``--trust-checkpoint-code``,
``trust_remote_code=True`` runs them instead). The two give the same accuracies
(tests/distributed/test_export_hf_launch.py).

Reported, as the columns of the paper's Table 2 (HS, PI, WG, SC, OB): lm_eval's ``acc_norm``
(log-likelihood divided by the answer's length in bytes) for HellaSwag, PIQA and OpenBookQA, ``acc``
for WinoGrande and StoryCloze, in %, each ± its standard error (lm_eval's ``*_stderr``: the sample
standard deviation over sqrt(n)); Avg's is sqrt(sum of squares) / k (independent test sets). GPT-3
normalised by tokens, and OpenBookQA by the answer's unconditional probability, so the figures are
lm_eval's, comparable to other lm_eval numbers, not bit-for-bit GPT-3's. Any other task gets lm_eval's
layout (task, n-shot, metric, value, ± stderr, n). |θ| is the model's parameter count, each tensor once
(tied embeddings once; vocabulary padding not counted; :func:`unique_parameter_count` for exports).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from data_tools.tokenizer import build_tokenizer
from megaformer.checkpoint.safe_load import TRUST_FLAG, CheckpointReadError, warn_trusted
from megaformer.tools.evaluate import dataset_loss
from megaformer.tools.generate import REPO, load_for_generation
from megaformer.tools.lm_eval_tasks import (
    PAPER_COLUMNS,
    check_names,
    check_records,
    explain_missing_field,
    resolve_task_specs,
)

# Our task name -> (lm_eval's task YAML under lm_eval/tasks, the paper's column, the metric reported).
TASKS: dict[str, tuple[str, str, str]] = {
    "hellaswag": ("hellaswag/hellaswag.yaml", "HS", "acc_norm"),
    "piqa": ("piqa/piqa.yaml", "PI", "acc_norm"),
    "winogrande": ("winogrande/default.yaml", "WG", "acc"),
    "storycloze": ("storycloze/storycloze_2016.yaml", "SC", "acc"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "OB", "acc_norm"),
}
PREFIX = "megaformer_"  # our tasks' names in lm_eval: megaformer_<name>
# Our task name -> lm_eval's name of the same task (its hub dataset): the default --tasks.
LM_EVAL_NAMES: dict[str, str] = {
    "hellaswag": "hellaswag",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "storycloze": "storycloze_2016",
    "openbookqa": "openbookqa",
}
DEFAULT_TASKS = tuple(LM_EVAL_NAMES.values())


def paper_name(task: str) -> str | None:
    """Our name of a paper task from its lm_eval name (``piqa``, ``megaformer_piqa``), else None."""
    for name, stock in LM_EVAL_NAMES.items():
        if task in (stock, PREFIX + name):
            return name
    return None


def write_task_configs(task_files: dict[str, str], out_dir: str) -> list[str]:
    """One lm_eval task YAML per ``{name: jsonl file}``: lm_eval's configuration of the task, its
    dataset replaced by the local file (as the validation split, the one scored). Returns the task
    names (``megaformer_<name>``).

    Raises:
        ValueError: an unknown task name or a missing file.
        TaskFileError: a line of a file that is not a JSON object with the task's columns
            (:data:`~megaformer.tools.lm_eval_tasks.PAPER_COLUMNS`): names the file, the line and the
            missing field.
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
        others = {k: v for k, v in PAPER_COLUMNS.items() if k != name}
        if check_records(path, PAPER_COLUMNS[name], name, formats=others) == 0:
            raise ValueError(f"--task {name}={path}: no records (JSON lines with the dataset's columns)")
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
        device: ``cpu`` / ``cuda`` / ``cuda:N``; a CUDA device without CUDA (lm_eval's command line
            defaults to ``cuda:0``) falls back to the CPU, with a warning.
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
        device: str | None = "cpu",
        vocab_file: str | None = None,
        merge_file: str | None = None,
        trust_checkpoint_code: bool | str = False,
        **kwargs,
    ) -> None:
        super().__init__()

        # lm_eval's --model_args pass strings: only "true" (any case) trusts the file's code.
        trust = trust_checkpoint_code is True or str(trust_checkpoint_code).lower() == "true"
        self.model, self.config, self.step = load_for_generation(checkpoint, tag, trust)
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:
                print(
                    f"warning: megaformer lm_eval model: {device!r} without CUDA; using cpu", file=sys.stderr
                )
            device = "cpu"
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
    import lm_eval.models  # noqa: F401 - lm_eval's own models first: get_model() loads them only into an empty registry
    from lm_eval.api.registry import model_registry, register_model

    # Already there: registered by an earlier import, or as the entry point lm_eval is loading now
    # (a placeholder it replaces by this class; registering over it would fail).
    if "megaformer" not in model_registry:
        register_model("megaformer")(MegaformerLM)


_register()


class TaskDataError(ValueError):
    """A task's dataset that lm_eval (through ``datasets``) could not load; says why and what to do."""


def _task_selection(
    task_files: dict[str, str], task_dir: str, tasks: Sequence[str], include_paths: Sequence[str]
) -> tuple[list[str], Any, Any]:
    """What :func:`evaluate_tasks` hands lm_eval: ``(specs, task_manager, selection)``, the paper's
    local tasks written as YAMLs into ``task_dir`` first.

    Raises:
        TaskFileError: an unknown task name. ValueError: a paper task given twice.
    """
    from lm_eval.tasks import TaskManager

    selection = resolve_task_specs(tasks, include_paths)
    local = write_task_configs(task_files, task_dir) if task_files else []
    if local:
        selection.include_paths.append(task_dir)
        selection.data_files += [os.path.abspath(p) for p in task_files.values()]
    manager = TaskManager(
        include_path=selection.include_paths or None, include_defaults=selection.needs_defaults
    )
    names = check_names(selection.names, manager) if selection.names else []
    paths = [s for s in selection.specs if s not in selection.names]
    keys = [paper_name(s) for s in local + names]
    for key in {k for k in keys if k is not None and keys.count(k) > 1}:
        raise ValueError(f"{key}: given twice (by --task {key}=FILE and by --tasks); keep one")
    return local + names + paths, manager, selection


def evaluate_tasks(
    lm,
    task_files: dict[str, str],
    *,
    task_dir: str,
    limit: int | None = None,
    tasks: Sequence[str] = (),
    include_paths: Sequence[str] = (),
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100000,
) -> dict[str, dict]:
    """lm_eval's results for the paper's tasks on local files (``task_files``: ``{name: jsonl}``) and
    any ``tasks`` (lm_eval names, YAML paths, directories:
    :func:`~megaformer.tools.lm_eval_tasks.resolve_task_specs`).

    Args:
        lm: an lm_eval ``LM`` (:class:`MegaformerLM`, lm_eval's ``HFLM``).
        task_dir: where the YAMLs of ``task_files`` are written.
        limit: score only the first ``limit`` items of each task.
        num_fewshot: examples in each prompt (None: each task's own default, 0 if it has none).
        bootstrap_iters: lm_eval's bootstrap draws for the standard error of metrics without a closed
            form (accuracy has one, sqrt of the sample variance over n); 0: no standard errors.

    Returns:
        ``{key: {"task": lm_eval name, "acc": ..., "acc_stderr": ..., ..., "n": items scored,
        "num_fewshot": k}}``, ``key`` our name for a paper task (``piqa``), else lm_eval's name (a
        group's row has its aggregate metrics and no ``n``). A metric of a filter other than ``none``
        is keyed ``metric,filter``; a standard error lm_eval did not compute is None.

    Raises:
        TaskFileError: a task YAML or data file that is missing or wrong (names the file, the line
            and the field), or an unknown task name.
        TaskDataError: a dataset that could not be loaded (the hub out of reach, a file datasets
            cannot parse).
        ValueError: the same paper task given twice.
    """
    import datasets.exceptions
    import jinja2
    from lm_eval import simple_evaluate

    specs, manager, selection = _task_selection(task_files, task_dir, tasks, include_paths)
    try:
        results = simple_evaluate(
            model=lm,
            tasks=specs,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )
    except (KeyError, jinja2.exceptions.UndefinedError) as e:
        clear = explain_missing_field(e, selection.data_files)
        if clear is None:
            raise
        raise clear from None
    except (ConnectionError, datasets.exceptions.DatasetsError) as e:
        # A hub dataset out of reach (offline, StoryCloze's manual download) or a data file datasets
        # cannot parse: said in one line, with the offline alternatives.
        raise TaskDataError(
            f"a task's dataset could not be loaded ({type(e).__name__}: {e}); without the hub, score the "
            "paper's tasks on local files (--task NAME=FILE) or give a task YAML reading local files "
            "(dataset_path: json, dataset_kwargs: {data_files: ...})"
        ) from None
    return _collect(results)


def _collect(results: dict) -> dict[str, dict]:
    """Our rows from lm_eval's ``simple_evaluate`` result (see :func:`evaluate_tasks`)."""
    out: dict[str, dict] = {}
    for task, res in results["results"].items():
        row: dict = {"task": task}
        for key, value in res.items():
            metric, sep, filt = key.partition(",")
            if not sep:
                continue  # alias, name
            name = metric if filt == "none" else key
            row[name] = None if value in ("N/A", None) else value
        samples = results.get("n-samples", {}).get(task)
        if samples is not None:
            row["n"] = samples["effective"]
        shots = results.get("n-shot", {}).get(task)
        if shots is not None:
            row["num_fewshot"] = shots
        out[paper_name(task) or task] = row
    return out


def _pct(value: float, stderr: float | None) -> str:
    return f"{100 * value:.1f}" + ("" if stderr is None else f" ± {100 * stderr:.1f}")


def table(rows: list[dict]) -> str:
    """The paper's Table 2 layout (Markdown): model, parameters (M), PPL, HS, PI, WG, SC, OB, Avg.

    Each task cell is the accuracy in % ± its standard error (where lm_eval computed one); Avg is the
    mean of the tasks shown, ± sqrt(sum of their squared standard errors) / k.
    """
    cols = [TASKS[n][1] for n in TASKS]
    lines = ["| Model | \\|θ\\| (M) | PPL | " + " | ".join(cols) + " | Avg |", "|---" * (len(cols) + 4) + "|"]
    for row in rows:
        cells, vals, errs = [], [], []
        for n in TASKS:
            res, metric = row["tasks"].get(n), TASKS[n][2]
            if res is None or res.get(metric) is None:
                cells.append("-")
                continue
            stderr = res.get(f"{metric}_stderr")
            cells.append(_pct(res[metric], stderr))
            vals.append(res[metric])
            errs.append(stderr)
        avg = "-"
        if vals:
            err = None if None in errs else math.sqrt(sum(e * e for e in errs)) / len(errs)
            avg = _pct(sum(vals) / len(vals), err)
        ppl = f"{row['ppl']:.2f}" if row.get("ppl") is not None and math.isfinite(row["ppl"]) else "-"
        cells = [row["model"], f"{row['params_m']:.1f}", ppl, *cells, avg]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_table(row: dict) -> str:
    """lm_eval's layout (Markdown) for the tasks of ``row`` outside the paper's table: one line per
    task and metric, with the few-shot count, value, ± standard error and items scored."""
    lines = ["| Task | n-shot | Metric | Value | ± Stderr | n |", "|---|---|---|---|---|---|"]
    for key, res in row["tasks"].items():
        if key in TASKS:
            continue
        metrics = [m for m in res if m not in ("task", "n", "num_fewshot") and "_stderr" not in m]
        for i, metric in enumerate(metrics):
            name, sep, filt = metric.partition(",")
            value, stderr = res[metric], res.get(f"{name}_stderr{sep}{filt}")
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            err = "-" if not isinstance(stderr, float) else f"± {stderr:.4f}"
            first = i == 0
            lines.append(
                f"| {key if first else ''} | {res.get('num_fewshot', '-') if first else ''} | {metric} | "
                f"{shown} | {err} | {res.get('n', '-') if first else ''} |"
            )
    return "\n".join(lines)


def report(row: dict) -> str:
    """What ``main`` prints: the paper's table for its tasks (with a line saying the metrics and the
    few-shot counts), lm_eval's layout for any other task."""
    parts = []
    paper = [n for n in TASKS if n in row["tasks"]]
    if paper:
        shots = sorted({row["tasks"][n].get("num_fewshot", 0) for n in paper})
        shot = (
            f"{shots[0]}-shot"
            if len(shots) == 1
            else "n-shot " + ", ".join(f"{TASKS[n][1]} {row['tasks'][n].get('num_fewshot')}" for n in paper)
        )
        parts.append(
            table([row]) + f"\n\n{shot}; HS, PI, OB: acc_norm, WG, SC: acc (lm_eval's), in % ± standard error"
        )
    ppl = f"{row['ppl']:.2f}" if row.get("ppl") is not None and math.isfinite(row["ppl"]) else "-"
    head = f"{row['model']}: |θ| {row['params_m']:.1f} M, PPL {ppl}"
    if len(paper) < len(row["tasks"]):
        parts.append(head + "\n\n" + task_table(row))
    if not row["tasks"]:  # --tasks none: the PPL column alone
        parts.append(head)
    return "\n\n".join(parts)


def _parse_tasks(items: Sequence[str]) -> dict[str, str]:
    tasks = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--task {item!r}: write NAME=FILE, e.g. --task piqa=piqa_valid.jsonl")
        tasks[name] = path
    return tasks


def _check_task_files(task_files: dict[str, str], specs: Sequence[str], include_paths: Sequence[str]) -> None:
    """The checks :func:`evaluate_tasks` makes of task files, made before a model is loaded.

    Raises:
        TaskFileError: as :func:`evaluate_tasks`.
        ValueError: an unknown paper task, a missing file.
    """

    resolve_task_specs(specs, include_paths)
    with tempfile.TemporaryDirectory() as tmp:
        write_task_configs(task_files, tmp)


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""

    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.zero_shot",
        description="Zero- or few-shot scores of any lm-evaluation-harness task, with standard errors; the "
        "paper's five tasks in the layout of its Table 2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run directory, its checkpoints/ directory or one global_stepN")
    src.add_argument("--hf-model", help="a directory written by megaformer.tools.export_hf")
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument(
        "--tasks",
        action="append",
        default=None,
        metavar="TASKS",
        help="lm_eval task, group or tag names (glob patterns too), task YAML files, directories of them; "
        f"comma-separated or repeated. Default, without --task: the paper's {','.join(DEFAULT_TASKS)}; "
        "'none': the PPL column alone (with --ppl-data-prefix)",
    )
    p.add_argument(
        "--task",
        action="append",
        default=None,
        metavar="NAME=FILE",
        help=f"a paper task on a local JSON-lines file (the hub dataset's columns), NAME in {sorted(TASKS)}",
    )
    p.add_argument("--include-path", action="append", default=[], help="a directory of task YAMLs")
    p.add_argument(
        "--num-fewshot", type=int, default=None, help="examples per prompt (None: each task's default, or 0)"
    )
    p.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100000,
        help="lm_eval's bootstrap draws for standard errors without a closed form; 0: no standard errors",
    )
    p.add_argument("--ppl-data-prefix", default=None, help="dataset for the PPL column (--checkpoint)")
    p.add_argument(
        "--ppl-max-tokens",
        type=int,
        default=262_144,
        help="read at most this many tokens of --ppl-data-prefix, from its start (0: all of it: the "
        "bundled 4.9M-token corpus takes tens of minutes on a CPU)",
    )
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
    return p


def row_name(checkpoint: str | None, hf_model: str | None) -> str:
    """The table's name of a model: an export's own directory (``--hf-model DIR``: ``DIR``'s name,
    not its parent's), a run's directory for a checkpoint given as the run, its ``checkpoints/`` or
    one ``global_stepN`` (``RUN``, with ``@global_stepN`` for a step other than ``latest``'s)."""
    if hf_model:
        return Path(hf_model).resolve().name
    path = Path(checkpoint).resolve()
    if path.name.startswith("global_step"):
        return f"{path.parent.parent.name}@{path.name}" if path.parent.name == "checkpoints" else path.name
    return path.parent.name if path.name == "checkpoints" else path.name


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the table; 0, or 2 for a bad checkpoint, task or file."""

    p = _parser()
    args = p.parse_args(argv)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        p.error(f"--num-fewshot {args.num_fewshot}: a count of examples, 0 or more")
    if args.ppl_max_tokens < 0:
        p.error(f"--ppl-max-tokens {args.ppl_max_tokens}: a number of tokens, 0 (all) or more")
    ppl_only = args.tasks is not None and [t for spec in args.tasks for t in spec.split(",")] == ["none"]
    if ppl_only and (args.task or not args.ppl_data_prefix):
        p.error("--tasks none scores no task: give --ppl-data-prefix PREFIX for the PPL column, no --task")
    try:
        tasks = _parse_tasks(args.task or [])
        specs = args.tasks if args.tasks is not None else ([] if tasks else list(DEFAULT_TASKS))
        specs = [] if ppl_only else specs
        _check_task_files(tasks, specs, args.include_path)  # before the model loads
        lm, params, ppl = _model(args)
        with tempfile.TemporaryDirectory() as tmp:
            results = (
                {}
                if ppl_only
                else evaluate_tasks(
                    lm,
                    tasks,
                    task_dir=args.task_dir or tmp,
                    limit=args.limit,
                    tasks=specs,
                    include_paths=args.include_path,
                    num_fewshot=args.num_fewshot,
                    bootstrap_iters=args.bootstrap_iters,
                )
            )
    except (ValueError, CheckpointReadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or row_name(args.checkpoint, args.hf_model)
    row = {
        "model": name,
        "params": params,
        "params_m": params / 1e6,
        "ppl": ppl,
        "num_fewshot": args.num_fewshot,
        "tasks": results,
    }
    print(report(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=2)
    return 0


def megaformer_parameter_count(model: torch.nn.Module, config) -> int:
    """Parameters of a :class:`~megaformer.model.NormFormerLM` (TP = 1): each tensor once (the tied
    output projection is the embedding), the vocabulary padding rows (above ``config.vocab_size``) not
    counted, the sinusoidal table (a buffer) neither."""
    # lazy: the model's module imports torch._dynamo (1 s): --help and bad flags answer without it
    from megaformer.model import vocab_param_names

    padded = set(vocab_param_names(config))
    return sum(
        (p[: config.vocab_size] if name in padded else p).numel() for name, p in model.named_parameters()
    )


def unique_parameter_count(model: torch.nn.Module) -> int:
    """Parameters of a transformers model as the model it came from holds them: each tensor once (one
    shared by several modules, as tied embeddings, counted once).

    A native GPT-2 export of megaformer (``export_hf --format gpt2``) holds two tensors that are no
    parameters of their own, recognised by value and not counted: ``lm_head.weight`` equal to
    ``wte / sqrt(n_embd)`` (the tied embedding, which the export unties because GPT-2 cannot scale its
    input embedding: ``scale_embedding``), and a ``wpe`` equal to the sinusoidal table (a fixed function
    of the position; a buffer in megaformer). So the count of a ``gpt2`` export equals the checkpoint's
    (:func:`megaformer_parameter_count`; before, 13.7M for a 7.2M model: the embedding twice and the
    position table).

    Args:
        model: a ``torch.nn.Module`` (a ``PreTrainedModel`` for the GPT-2 rules).

    Returns:
        The number of parameter elements.
    """
    # lazy: the model's module imports torch._dynamo (1 s): --help and bad flags answer without it
    from megaformer.model.normformer import sinusoidal_positions

    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    total = 0
    for p in model.parameters():  # already one entry per Parameter object
        key = (p.data_ptr(), p.numel(), tuple(p.shape))  # two Parameters viewing one storage: once
        if key not in seen:
            seen.add(key)
            total += p.numel()
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2" or not hasattr(model, "transformer"):
        return total

    with torch.no_grad():
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        d = config.n_embd
        untied = head is not None and head.data_ptr() != wte.data_ptr() and head.shape == wte.shape
        if untied and torch.allclose(head.float() * math.sqrt(d), wte.float(), rtol=1e-5, atol=1e-6):
            total -= head.numel()  # megaformer's tied embedding, scaled by sqrt(d) on the way in
        table = sinusoidal_positions(wpe.shape[0], d)
        if torch.allclose(wpe.float().cpu(), table, rtol=0, atol=1e-6):
            total -= wpe.numel()  # the fixed sinusoidal table, not a learned one
    return total


def _model(args) -> tuple[object, int, float | None]:
    """The lm_eval model, its parameter count and the PPL column's value (None: not measured)."""
    if args.hf_model:
        from lm_eval.models.huggingface import HFLM

        # lazy: the Hugging Face path only (--hf-model): the export's transformers classes
        from megaformer.tools.export_hf import register_auto_classes

        if args.trust_checkpoint_code:
            warn_trusted(f"{args.hf_model} (its modeling code, trust_remote_code=True)")
        else:
            register_auto_classes()  # a megaformer export runs this installation's code, not the directory's
        lm = HFLM(
            pretrained=args.hf_model,
            trust_remote_code=args.trust_checkpoint_code,
            batch_size=args.batch_size,
            device=args.device,
        )
        return lm, unique_parameter_count(lm.model), None

    lm = MegaformerLM(
        args.checkpoint,
        args.tag,
        batch_size=args.batch_size,
        device=args.device,
        trust_checkpoint_code=args.trust_checkpoint_code,
    )
    params = megaformer_parameter_count(lm.model, lm.config)
    ppl = None
    if args.ppl_data_prefix:
        seq_len = lm.config.seq_len
        cap = max(args.ppl_max_tokens // seq_len, 1) if args.ppl_max_tokens else 0  # samples; 0: all
        result = dataset_loss(
            lm.model, args.ppl_data_prefix, seq_len, max_samples=cap, device=args.device, label="PPL"
        )
        print(
            f"PPL {result['ppl']:.2f} over the first {result['tokens']:,} tokens of {args.ppl_data_prefix} "
            "(--ppl-max-tokens; 0: all)",
            file=sys.stderr,
        )
        ppl = result["ppl"]
    return lm, params, ppl


if __name__ == "__main__":
    sys.exit(main())
