"""Fine-tune a masked-LM checkpoint on a GLUE task, over the paper's learning-rate grid.

    python -m megaformer.tools.finetune --checkpoint RUN/checkpoints --task rte --data data/glue
        [--lr 1e-5 1e-4 ...] [--epochs 10] [--batch-size N] [--out DIR] [--device cuda]
    python -m megaformer.tools.finetune --table DIR [DIR ...]     # one Table 3 from several runs

What the NormFormer paper (Shleifer et al. 2021, Sec. 3, "Fine-Tuning") does: "We fine-tune both the
baseline MLM and NormFormer with learning rates 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 6e-3 and report the
best performance on the validation set for each GLUE task, following Liu et al. (2019). Other
fine-tuning hyperparameters match those used for roberta-base in Liu et al. (2019)." Those are the
flags of fairseq's ``examples/roberta/README.glue.md`` (the recipe RoBERTa's GLUE numbers come from):

    ============================ ===================================================================
    learning rates               ``--lr`` default: the paper's grid {1e-5, 1e-4, 3e-4, 1e-3, 3e-3,
                                 6e-3}; one run per rate, each from the pretrained weights
    optimizer                    Adam, betas (0.9, 0.98), eps 1e-6 (README: ``--adam-betas
                                 "(0.9, 0.98)" --adam-eps 1e-06``), decoupled weight decay 0.1 on every
                                 parameter (``--weight-decay 0.1``; fairseq's Adam decays as AdamW)
    schedule                     polynomial decay, power 1 (linear) to 0, after a linear warmup over
                                 6% of the updates (``--lr-scheduler polynomial_decay``,
                                 ``--warmup-updates``: "6 percent of the number of updates")
    updates                      10 epochs (``--max-epoch 10``; README's ``--total-num-update`` is
                                 "10 epochs through RTE for bsz 16"); here computed from the data
    batch size                   16 for RTE, MRPC, CoLA, STS-B; 32 for SST-2, MNLI, QNLI, QQP
                                 (README's table, ``--batch-size``)
    dropout                      0.1 in the model, 0.1 on attention (``--dropout 0.1
                                 --attention-dropout 0.1``), also on the embeddings (fairseq's encoder
                                 applies ``--dropout`` there); 0.0 in the head (``pooler_dropout``,
                                 fairseq roberta ``base_architecture``'s default, not overridden)
    gradient clipping            none (``--clip-norm 0.0``)
    best checkpoint              the best validation accuracy over the epochs (``--best-checkpoint-
                                 metric accuracy --maximize-best-checkpoint-metric``); STS-B: Pearson
    precision                    fp32 here (fairseq: ``--fp16``)
    ============================ ===================================================================

The head is fairseq's ``RobertaClassificationHead`` (:class:`ClassificationHead`) on the first
token's final hidden state; the loss is cross-entropy, or mean squared error for STS-B
(``sentence_prediction`` criterion, ``--regression-target``). Inputs are RoBERTa's ``<s> A </s></s> B
</s>`` with megaformer's ids (:mod:`megaformer.data.glue`), right-padded per batch, the padding masked
out of attention.

**Scope.** One process, one device (CPU or one CUDA GPU), TP = 1: the checkpoint, saved at any
(tp, pp, dp) layout, is consolidated into one fp32 model (as ``evaluate`` and ``export_hf`` load it).
That is ample for the paper's 125M models (fine-tuning RTE for 10 epochs is minutes on one GPU); no
process group is made. Only masked-LM checkpoints (``model.objective: mlm``) are accepted.

**Outputs** (``--out``, default ``RUN/finetune/``): ``<task>.json`` (every learning rate's per-epoch
validation metrics, the best per learning rate and over the grid, the hyperparameters and the data
used) and ``table3.md``, rebuilt from every ``*.json`` there: the paper's Table 3 layout (Model, Size,
λ_resid, PPL, CoLA, MNLI, MRPC, QNLI, QQP, RTE, SST-2, Avg; accuracy, as the paper reports) and the
same runs in GLUE's own metrics (Matthews for CoLA, F1/accuracy for MRPC, Pearson/Spearman for STS-B).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megaformer.config.schema import ConfigError, ModelConfig
from megaformer.data.glue import GLUE_TASKS, GlueDataError, GlueTask, score
from megaformer.data.mlm import PAD_ID
from megaformer.model import NormFormerLM
from megaformer.model.normformer import padded_keys

PAPER_LR_GRID = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 6e-3)  # NormFormer paper, Sec. 3 "Fine-Tuning"
TABLE3_TASKS = ("CoLA", "MNLI", "MRPC", "QNLI", "QQP", "RTE", "SST-2")  # the paper's Table 3 columns


@dataclass(frozen=True)
class FinetuneConfig:
    """RoBERTa-base's GLUE fine-tuning hyperparameters (sources: the module docstring's table)."""

    epochs: int = 10
    batch_size: int = 16
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-6
    weight_decay: float = 0.1
    warmup_ratio: float = 0.06
    dropout: float = 0.1
    attention_dropout: float = 0.1
    pooler_dropout: float = 0.0
    max_steps: int = 0
    """Stop after this many updates (0: the epochs' worth); the schedule spans the updates made."""
    seed: int = 1


class ClassificationHead(nn.Module):
    """fairseq's ``RobertaClassificationHead``: the first token's features ``float[B, d]`` ->
    dropout -> dense ``d -> d`` -> tanh -> dropout -> ``out_proj`` ``d -> num_outputs``.
    PyTorch's default ``nn.Linear`` init, as fairseq registers the head after the model's init."""

    def __init__(self, hidden_size: int, num_outputs: int, pooler_dropout: float = 0.0) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(pooler_dropout)
        self.out_proj = nn.Linear(hidden_size, num_outputs)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.dropout(features[:, 0, :])  # (B, d): <s>, RoBERTa's [CLS]
        x = self.dropout(torch.tanh(self.dense(x)))
        return self.out_proj(x)  # (B, num_outputs)


class SentenceClassifier(nn.Module):
    """A pretrained masked LM's encoder (embedding, blocks, final LayerNorm) and a
    :class:`ClassificationHead`. The LM head (``lm_head``, the tied decoder) is kept but unused: the
    encoder is called through the modules of :class:`~megaformer.model.NormFormerLM` one by one,
    stopping before the LM head, padded keys masked (:func:`~megaformer.model.normformer.padded_keys`)."""

    def __init__(self, lm: NormFormerLM, num_outputs: int, pooler_dropout: float = 0.0) -> None:
        super().__init__()
        self.lm = lm
        self.head = ClassificationHead(lm.config.hidden_size, num_outputs, pooler_dropout)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``float[B, T, d]`` of ``tokens`` (``int64[B, T]``, padded with
        :data:`~megaformer.data.mlm.PAD_ID`, which no query attends to)."""
        with padded_keys(self.lm.blocks, tokens != PAD_ID):
            x = self.lm.embedding(tokens)  # (B, T, d)
            for block in self.lm.blocks:
                x = block(x)
            return self.lm.final_norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``float[B, num_outputs]``: logits, or the predicted score (regression)."""
        return self.head(self.features(tokens))


def pad_batch(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``int64[B, T_max]``, right-padded with :data:`~megaformer.data.mlm.PAD_ID`."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def polynomial_decay(total: int, warmup: int):
    """fairseq's ``polynomial_decay`` scheduler (power 1, end rate 0) as a multiplier of the peak
    rate, given the updates made so far ``n``: ``max(n, 1) / warmup`` while ``n <= warmup`` (fairseq
    starts at ``1 / warmup``, so no update is made at rate 0), then ``(total - n) / (total - warmup)``,
    0 from ``total`` on."""

    def factor(n: int) -> float:
        if warmup > 0 and n <= warmup:
            return max(n, 1) / warmup
        return max(0.0, (total - n) / max(1, total - warmup))

    return factor


def predict(
    model: SentenceClassifier, rows: Sequence[Sequence[int]], batch_size: int, device: str
) -> np.ndarray:
    """The head's outputs ``float[N, C]`` for ``rows`` (evaluation mode, longest-first batches)."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # less padding
    out = np.zeros((len(rows), model.head.out_proj.out_features), dtype=np.float64)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            idx = order[start : start + batch_size]
            out[idx] = model(pad_batch([rows[i] for i in idx]).to(device)).double().cpu().numpy()
    return out


def _loss(task: GlueTask, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, or mean squared error for regression (fairseq ``sentence_prediction``)."""
    if task.is_regression:
        return F.mse_loss(outputs.squeeze(-1).float(), labels.float())
    return F.cross_entropy(outputs.float(), labels)


def build_classifier(
    full: dict[str, torch.Tensor], config: ModelConfig, task: GlueTask, hp: FinetuneConfig, device: str
) -> SentenceClassifier:
    """The pretrained weights ``full`` (consolidated, :func:`megaformer.checkpoint.reshard.consolidate`)
    in a fresh model with fine-tuning dropout, plus a head seeded from ``hp.seed``."""
    from megaformer.checkpoint.reshard import load_full

    ft_config = dataclasses.replace(
        config,
        hidden_dropout=hp.dropout,
        attention_dropout=hp.attention_dropout,
        embedding_dropout=hp.dropout,
    )
    lm = NormFormerLM(ft_config, tp_group=None, seed=hp.seed)  # every weight is replaced below
    load_full(lm, full, ft_config, tp_rank=0, tp=1)
    torch.manual_seed(hp.seed)  # the head's init, then dropout
    return SentenceClassifier(lm, task.num_outputs, hp.pooler_dropout).to(device)


def finetune_one(
    full: dict[str, torch.Tensor],
    config: ModelConfig,
    task: GlueTask,
    train: tuple[list[list[int]], list],
    valid: tuple[list[list[int]], list],
    lr: float,
    hp: FinetuneConfig,
    device: str = "cpu",
    log=print,
) -> dict[str, Any]:
    """Fine-tune from ``full`` at peak rate ``lr``; validate after every epoch.

    Args:
        train, valid: ``(token rows, labels)`` (:func:`~megaformer.data.glue.encode_example`).

    Returns:
        ``{"lr", "updates", "warmup", "epochs": [{"epoch", "update", "train_loss", "metrics"}],
        "best": the epoch entry with the best ``task.selection_metric``}``.
    """
    model = build_classifier(full, config, task, hp, device)
    steps_per_epoch = math.ceil(len(train[0]) / hp.batch_size)
    total = hp.epochs * steps_per_epoch
    total = min(total, hp.max_steps) if hp.max_steps else total
    warmup = round(hp.warmup_ratio * total)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=hp.adam_betas, eps=hp.adam_eps, weight_decay=hp.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, polynomial_decay(total, warmup))
    dtype = torch.float32 if task.is_regression else torch.long
    gen = torch.Generator().manual_seed(hp.seed)
    history, update = [], 0
    for epoch in range(1, hp.epochs + 1):
        model.train()
        losses = []
        for idx in torch.randperm(len(train[0]), generator=gen).split(hp.batch_size):
            tokens = pad_batch([train[0][i] for i in idx]).to(device)
            labels = torch.tensor([train[1][i] for i in idx], dtype=dtype, device=device)
            loss = _loss(task, model(tokens), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            update += 1
            if update >= total:
                break
        metrics = score(task, np.asarray(valid[1]), predict(model, valid[0], hp.batch_size, device))
        history.append(
            {"epoch": epoch, "update": update, "train_loss": float(np.mean(losses)), "metrics": metrics}
        )
        log(
            f"  lr {lr:g} epoch {epoch} update {update}/{total}: train loss {np.mean(losses):.4f} | "
            + " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        )
        if update >= total:
            break
    best = max(history, key=lambda h: _rank_value(h["metrics"][task.selection_metric]))
    return {"lr": lr, "updates": total, "warmup": warmup, "epochs": history, "best": best}


def _rank_value(value: float) -> float:
    return -math.inf if value is None or math.isnan(value) else value


def require_masked_lm(config: ModelConfig, checkpoint: str) -> None:
    """Refuse a causal-LM checkpoint, before any model is built.

    Raises:
        ConfigError: ``config.objective`` is not ``mlm``; names the checkpoint and ``model.objective``.
    """
    if config.objective != "mlm":
        raise ConfigError(
            f"{checkpoint}: the checkpoint's model.objective='{config.objective}' (a causal LM): "
            "finetune fine-tunes a masked LM as RoBERTa is fine-tuned (bidirectional attention, the "
            "head reads <s>); give it a checkpoint trained with model.objective='mlm'"
        )


def load_masked_lm(
    ckpt_dir: str, tag: str | None = None, trust_code: bool = False
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """The checkpoint's full fp32 weights (any (tp, pp, dp) layout, weights-only unpickling unless
    ``trust_code``), its model config and ``{"tag_dir", "step", "params"}``.

    Raises:
        ConfigError: not a masked LM (:func:`require_masked_lm`).
        ReshardError / CheckpointReadError / CheckpointError: see
            :func:`megaformer.tools.generate.load_for_generation`.
    """
    from megaformer.checkpoint.reshard import consolidate, resolve_tag_dir
    from megaformer.training.ckpt_integrity import NEEDS_WEIGHTS, verify

    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    verify(tag_dir, needs=NEEDS_WEIGHTS)
    full, run_config, extra = consolidate(tag_dir, trust_code=trust_code)
    config = ModelConfig(**run_config["model"])
    require_masked_lm(config, tag_dir)
    params = sum(t.numel() for t in full.values())  # unpadded vocabulary: the paper's |θ|
    info = {"tag_dir": os.path.abspath(tag_dir), "step": int(extra.get("step") or 0), "params": params}
    return {k: v.float() for k, v in full.items()}, config, info


def encode_split(examples, encode, seq_len: int) -> tuple[list[list[int]], list, int]:
    """``(token rows, labels, truncated count)`` of :class:`~megaformer.data.glue.GlueExample` s."""
    from megaformer.data.glue import encode_example

    rows = [encode_example(e.texts, encode, seq_len) for e in examples]
    # A row at the limit may have been cut (or fit exactly): counted as truncated.
    truncated = sum(len(r) >= seq_len for r in rows)
    return rows, [e.label for e in examples], truncated


def _best(runs: list[dict], metric: str) -> dict[str, Any]:
    """The (lr, epoch) with the best ``metric`` over the grid, and all metrics there."""
    lr, entry = max(
        ((r["lr"], h) for r in runs for h in r["epochs"]), key=lambda x: _rank_value(x[1]["metrics"][metric])
    )
    return {"selected_by": metric, "lr": lr, "epoch": entry["epoch"], "metrics": entry["metrics"]}


def run_grid(full, config, task, train, valid, lrs, hp, device="cpu", log=print) -> dict[str, Any]:
    """:func:`finetune_one` at every learning rate of ``lrs``; the best on validation by the paper's
    metric (``best``: accuracy, Pearson for STS-B) and by GLUE's main metric (``best_glue``)."""
    runs = []
    for lr in lrs:
        log(f"{task.name}: lr {lr:g}")
        runs.append(finetune_one(full, config, task, train, valid, lr, hp, device, log))
    return {
        "runs": runs,
        "best": _best(runs, task.selection_metric),
        "best_glue": _best(runs, task.metrics[0]),
    }


def _fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value * scale:.{digits}f}"
    )


def _table3_row(name: str, by_task: dict[str, dict]) -> str:
    """One row of the paper's Table 3: accuracy (%) per task, Avg over the tasks present."""
    first = next(iter(by_task.values()))
    model = first["model"]
    cells = [
        name,
        f"{model['params'] / 1e6:.2f}",
        "✓" if model["resid_scale"] else "-",
        _fmt(first.get("ppl"), 1, 2),
    ]
    values = []
    for t in TABLE3_TASKS:
        value = by_task[t]["best"]["metrics"]["accuracy"] if t in by_task else None
        cells.append(_fmt(value))
        if value is not None and not math.isnan(value):
            values.append(value)
    avg = _fmt(float(np.mean(values)), 100, 2) if values else "–"
    cells.append(avg if len(values) == len(TABLE3_TASKS) else f"{avg} ({len(values)}/{len(TABLE3_TASKS)})")
    return "| " + " | ".join(cells) + " |"


def _glue_cell(result: dict | None) -> str:
    if result is None:
        return "–"
    best = result["best_glue"]
    return "/".join(_fmt(best["metrics"][m]) for m in GLUE_TASKS[result["task"]].metrics)


def render_tables(results: list[dict[str, Any]]) -> str:
    """Markdown: the paper's Table 3 layout (accuracy, best over learning rates and epochs), then the
    same runs in GLUE's metrics and the learning rate each task chose. ``results``: the
    ``<task>.json`` documents; one row per model name."""
    rows: dict[str, dict[str, dict]] = {}
    for r in sorted(results, key=lambda r: (r["model"]["name"], r["task"])):
        rows.setdefault(r["model"]["name"], {})[r["task"]] = r
    head = ["Model", "Size (M)", "λ_resid", "PPL", *TABLE3_TASKS, "Avg"]
    out = ["## Table 3 layout: validation accuracy (%)", "", "| " + " | ".join(head) + " |"]
    out.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    out += [_table3_row(name, by_task) for name, by_task in rows.items()]
    out += [
        "",
        "Best validation accuracy over the learning-rate grid and the epochs, per task (the paper:",
        '"we report fine-tuned accuracy on GLUE in Table 3"). PPL: the run\'s final validation',
        "perplexity on masked tokens (summary.json), – if unknown. Avg over the tasks present.",
        "",
    ]
    glue = list(GLUE_TASKS)
    labels = [f"{t} ({'/'.join(GLUE_TASKS[t].metrics)})" for t in glue]
    out += ["## GLUE metrics (%)", "", "| Model | " + " | ".join(labels) + " |"]
    out.append("|---|" + "---:|" * len(glue))
    for name, by_task in rows.items():
        out.append(f"| {name} | " + " | ".join(_glue_cell(by_task.get(t)) for t in glue) + " |")
    out += [
        "",
        "Selected by each task's first metric (GLUE's main one), all metrics at that (lr, epoch).",
        "",
        "## Learning rate chosen (Table 3 / GLUE)",
        "",
        "| Model | " + " | ".join(glue) + " |",
        "|---|" + "---:|" * len(glue),
    ]
    for name, by_task in rows.items():
        cells = [
            f"{by_task[t]['best']['lr']:g} / {by_task[t]['best_glue']['lr']:g}" if t in by_task else "–"
            for t in glue
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def collect_results(dirs: Sequence[str]) -> list[dict[str, Any]]:
    """Every ``<task>.json`` written by this tool in ``dirs``."""
    results = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if isinstance(doc, dict) and doc.get("tool") == "megaformer.tools.finetune":
                results.append(doc)
    return results


def _finite(obj: Any) -> Any:
    """``obj`` with NaN / inf floats as None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def _run_ppl(run_dir: str) -> float | None:
    """``final_valid_ppl`` of the run's ``summary.json`` (masked tokens, for an MLM run), or None."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            value = json.load(f).get("final_valid_ppl")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megaformer.tools.finetune",
        description="Fine-tune a masked-LM checkpoint on a GLUE task over the NormFormer paper's "
        "learning-rate grid (RoBERTa-base's other hyperparameters); write <task>.json and table3.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint", help="a run's checkpoints/ directory or one global_stepN (model.objective mlm)"
    )
    p.add_argument("--tag", default=None, help="checkpoint tag; None: the one the 'latest' file names")
    p.add_argument("--task", help="GLUE task: " + ", ".join(GLUE_TASKS))
    p.add_argument("--data", help="the task's directory (dev.tsv, train.tsv) or a GLUE root (<TASK>/dev.tsv)")
    p.add_argument("--lr", type=float, nargs="+", default=list(PAPER_LR_GRID), help="peak learning rate(s)")
    p.add_argument("--epochs", type=int, default=10, help="epochs per learning rate (fairseq --max-epoch)")
    p.add_argument("--batch-size", type=int, default=0, help="0: fairseq's RoBERTa recipe (16 or 32 by task)")
    p.add_argument(
        "--max-steps", type=int, default=0, help="stop each run after this many updates (0: epochs)"
    )
    p.add_argument("--max-train-examples", type=int, default=0, help="use the first N training rows (0: all)")
    p.add_argument(
        "--max-valid-examples", type=int, default=0, help="use the first N validation rows (0: all)"
    )
    p.add_argument("--seed", type=int, default=1, help="head init, dropout and data order")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="output directory; None: RUN/finetune")
    p.add_argument(
        "--name", default=None, help="the model's row in table3.md; None: the run directory's name"
    )
    p.add_argument(
        "--ppl", type=float, default=None, help="Table 3's PPL; None: final_valid_ppl of RUN/summary.json"
    )
    p.add_argument("--vocab-file", default=None, help="GPT-2 encoder.json; None: data/gpt2-bpe's")
    p.add_argument("--merge-file", default=None, help="GPT-2 vocab.bpe; None: data/gpt2-bpe's")
    p.add_argument("--trust-checkpoint-code", action="store_true", help="unpickle the checkpoint in full")
    p.add_argument(
        "--table", nargs="+", default=None, metavar="DIR", help="only print one table from DIRs' results"
    )
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.table is None:
        missing = [f"--{k}" for k in ("checkpoint", "task", "data") if getattr(args, k) is None]
        if missing:
            p.error(f"{', '.join(missing)} required (or --table DIR ... to print a table)")
    counts = ("epochs", "batch_size", "max_steps", "max_train_examples", "max_valid_examples")
    for key in counts:
        if getattr(args, key) < (1 if key == "epochs" else 0):
            p.error(f"--{key.replace('_', '-')} must be >= {1 if key == 'epochs' else 0}")
    if any(lr <= 0 for lr in args.lr):
        p.error("--lr values must be > 0")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")


def _tokenizer(args: argparse.Namespace):
    from data_tools.tokenizer import build_tokenizer
    from megaformer.tools.generate import REPO

    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=args.vocab_file or str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
        merge_file=args.merge_file or str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
    )


def finetune_task(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """The command's work (after its flags are checked); returns the ``<task>.json`` document.
    Bad input (task, data, checkpoint) is raised before any training."""
    from megaformer.data.glue import glue_task, read_glue_file, task_files

    task = glue_task(args.task)
    train_path, valid_path = task_files(args.data, task)
    # The data files are checked (and read) before the checkpoint is.
    train_rows = read_glue_file(train_path, task, args.max_train_examples)
    valid_rows = read_glue_file(valid_path, task, args.max_valid_examples)
    full, config, info = load_masked_lm(args.checkpoint, args.tag, args.trust_checkpoint_code)
    encode = _tokenizer(args).encode
    train = encode_split(train_rows, encode, config.seq_len)
    valid = encode_split(valid_rows, encode, config.seq_len)
    hp = FinetuneConfig(
        epochs=args.epochs,
        batch_size=args.batch_size or task.batch_size,
        max_steps=args.max_steps,
        seed=args.seed,
    )
    run_dir = os.path.dirname(os.path.dirname(info["tag_dir"]))
    log(
        f"# {task.name}: {len(train[0])} train / {len(valid[0])} valid examples ({train[2]} / {valid[2]} "
        f"at seq_len {config.seq_len}, longer ones cut), {info['tag_dir']} "
        f"(step {info['step']}), device {args.device}, lr grid {args.lr}"
    )
    start = time.perf_counter()
    grid = run_grid(full, config, task, train[:2], valid[:2], args.lr, hp, args.device, log)
    return {
        "tool": "megaformer.tools.finetune",
        "task": task.name,
        "model": {
            "name": args.name or os.path.basename(run_dir),
            "checkpoint": info["tag_dir"],
            "step": info["step"],
            "params": info["params"],
            "norm_scheme": config.norm_scheme,
            "normformer": [k for k in ("post_attn_ln", "head_scale", "ffn_ln") if getattr(config, k)],
            "resid_scale": config.resid_scale,
        },
        "ppl": args.ppl if args.ppl is not None else _run_ppl(run_dir),
        "data": {
            "train": os.path.abspath(train_path),
            "valid": os.path.abspath(valid_path),
            "train_examples": len(train[0]),
            "valid_examples": len(valid[0]),
            "truncated_to_seq_len": {"train": train[2], "valid": valid[2], "seq_len": config.seq_len},
        },
        "hyperparameters": {**dataclasses.asdict(hp), "lr_grid": list(args.lr)},
        "device": args.device,
        "seconds": time.perf_counter() - start,
        **grid,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad task, data file, checkpoint or flag."""
    from data_tools.errors import DataToolsError
    from megaformer.training.safe_load import CheckpointReadError

    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    if args.table is not None:
        sys.stdout.write(render_tables(collect_results(args.table)))
        return 0
    try:
        doc = finetune_task(args)
    except (GlueDataError, ConfigError, CheckpointReadError, DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(doc["model"]["checkpoint"])), "finetune")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{doc['task'].lower()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(doc), f, indent=2, allow_nan=False)
    table = render_tables(collect_results([out]))
    with open(os.path.join(out, "table3.md"), "w", encoding="utf-8") as f:
        f.write(table)
    best = doc["best"]
    print(
        f"{doc['task']}: best {best['selected_by']} {best['metrics'][best['selected_by']]:.4f} "
        f"at lr {best['lr']:g}, "
        f"epoch {best['epoch']}; wrote {path} and {os.path.join(out, 'table3.md')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
