"""Fine-tune a masked-LM checkpoint on a GLUE task, over the paper's learning-rate grid.

    python -m megaformer.tools.finetune --checkpoint RUN/checkpoints --task rte --data data/glue
        [--lr 1e-5 1e-4 ...] [--epochs 10] [--batch-size N] [--out DIR] [--device cuda]
        [--random-init [--init-seed S]] [--pooling first|mean] [--no-save-best]
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
token's final hidden state (``--pooling mean``: on the mean over the non-padding positions, a
difference from the recipe that ``recipe_differences`` lists); the loss is cross-entropy, or mean
squared error for STS-B (``sentence_prediction`` criterion, ``--regression-target``). Inputs are
RoBERTa's ``<s> A </s></s> B </s>`` with megaformer's ids (:mod:`megaformer.data.glue`),
right-padded per batch, the padding masked out of attention.

**Scope.** One process, one device (CPU or one CUDA GPU), TP = 1: the checkpoint, saved at any
(tp, pp, dp) layout, is consolidated into one fp32 model (as ``evaluate`` and ``export_hf`` load it).
That is ample for the paper's 125M models (fine-tuning RTE for 10 epochs is minutes on one GPU); no
process group is made. Only masked-LM checkpoints (``model.objective: mlm``) are accepted.

**Outputs** (``--out``, default ``RUN/finetune/``, ``RUN/finetune-random-init/`` with
``--random-init``): ``<task>.json`` (every learning rate's per-epoch validation metrics, the best per
learning rate and over the grid with the accuracy's 95% Wilson interval and the best model's
predictions, the hyperparameters, the data used, and ``recipe_differences``: every setting that
differs from the paper's recipe, :func:`recipe_differences`); ``<task>_best/`` (the best model by the
task's metric over the grid and the epochs, fairseq's ``checkpoint_best.pt``, as a megaformer
checkpoint every tool reads, with the classification head: :func:`save_best`,
:func:`load_classifier`); and ``table3.md``, rebuilt from every ``*.json`` there: the paper's Table 3
layout (Model, Size, λ_resid, PPL, CoLA, MNLI, MRPC, QNLI, QQP, RTE, SST-2, Avg; accuracy, as the
paper reports; ``†`` on a run that differs from the recipe), the same runs in GLUE's own metrics
(Matthews for CoLA, F1/accuracy for MRPC, Pearson/Spearman for STS-B), the accuracies with their
intervals beside the majority class, and the list of differences from the recipe.

**The random-initialisation control** (``--random-init``): the checkpoint's architecture, but the
weights its pretraining started from (the trainer's initialisation with the run's ``train.seed``, or
``--init-seed``), fine-tuned exactly as the pretrained weights are. What pretraining adds is the
difference between the two; a model that only reaches the control's accuracy has learnt nothing from
pretraining that the task uses.
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

from data_tools.errors import DataToolsError
from data_tools.tokenizer import build_tokenizer
from megaformer.checkpoint.formats import model_states_name
from megaformer.checkpoint.integrity import NEEDS_WEIGHTS, verify
from megaformer.checkpoint.reshard import (
    consolidate,
    load_full,
    resolve_tag_dir,
    split,
    write_module_checkpoint,
)
from megaformer.checkpoint.safe_load import CheckpointReadError, load_weights
from megaformer.config.schema import ConfigError, ModelConfig
from megaformer.data.glue import (
    GLUE_TASKS,
    GlueDataError,
    GlueTask,
    encode_example,
    glue_task,
    read_glue_file,
    score,
    task_files,
)
from megaformer.data.mlm import PAD_ID
from megaformer.model import NormFormerLM, vocab_param_names
from megaformer.model.normformer import padded_keys
from megaformer.tools.generate import REPO

POOLINGS = ("first", "mean")  # FinetuneConfig.pooling, --pooling
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
    pooling: str = "first"
    """What the head reads (:data:`POOLINGS`): ``first``, the ``<s>`` token's final hidden state
    (fairseq's ``RobertaClassificationHead``, the recipe), or ``mean``, the mean over the row's
    non-padding positions (``<s>`` and ``</s>`` included; Sentence-BERT's mean pooling, Reimers &
    Gurevych 2019, Sec. 3). A masked LM never predicts ``<s>``, so its last layer is not trained
    there (megaformer masks no special token, :mod:`megaformer.data.mlm`), while every other
    position's state is what the pretraining loss shaped."""
    max_steps: int = 0
    """Stop after this many updates (0: the epochs' worth); the schedule spans the updates made."""
    seed: int = 1


class ClassificationHead(nn.Module):
    """fairseq's ``RobertaClassificationHead``: the first token's features ``float[B, d]`` ->
    dropout -> dense ``d -> d`` -> tanh -> dropout -> ``out_proj`` ``d -> num_outputs``.
    PyTorch's default ``nn.Linear`` init, as fairseq registers the head after the model's init.
    With ``pooling="mean"`` (:attr:`FinetuneConfig.pooling`) the pooled features are the mean over
    the non-padding positions instead of the first token's.

    Raises:
        ValueError: ``pooling`` not in :data:`POOLINGS`.
    """

    def __init__(
        self, hidden_size: int, num_outputs: int, pooler_dropout: float = 0.0, pooling: str = "first"
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: expected one of {', '.join(POOLINGS)}")
        self.pooling = pooling
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(pooler_dropout)
        self.out_proj = nn.Linear(hidden_size, num_outputs)

    def forward(self, features: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` ``float[B, T, d]``; ``keep`` ``bool[B, T]``, the non-padding positions (for
        ``mean``; None: every position). Returns ``float[B, num_outputs]``."""
        if self.pooling == "first":
            pooled = features[:, 0, :]  # (B, d): <s>, RoBERTa's [CLS]
        else:
            weight = features.new_ones(features.shape[:2]) if keep is None else keep.to(features.dtype)
            pooled = (features * weight.unsqueeze(-1)).sum(1) / weight.sum(1, keepdim=True).clamp_min(1.0)
        x = self.dropout(pooled)
        x = self.dropout(torch.tanh(self.dense(x)))
        return self.out_proj(x)  # (B, num_outputs)


class SentenceClassifier(nn.Module):
    """A pretrained masked LM's encoder (embedding, blocks, final LayerNorm) and a
    :class:`ClassificationHead`. The LM head (``lm_head``, the tied decoder) is kept but unused: the
    encoder is called through the modules of :class:`~megaformer.model.NormFormerLM` one by one,
    stopping before the LM head, padded keys masked (:func:`~megaformer.model.normformer.padded_keys`)."""

    def __init__(
        self, lm: NormFormerLM, num_outputs: int, pooler_dropout: float = 0.0, pooling: str = "first"
    ) -> None:
        super().__init__()
        self.lm = lm
        self.head = ClassificationHead(lm.config.hidden_size, num_outputs, pooler_dropout, pooling)

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
        return self.head(self.features(tokens), tokens != PAD_ID)


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

    ft_config = dataclasses.replace(
        config,
        hidden_dropout=hp.dropout,
        attention_dropout=hp.attention_dropout,
        embedding_dropout=hp.dropout,
    )
    lm = NormFormerLM(ft_config, tp_group=None, seed=hp.seed)  # every weight is replaced below
    load_full(lm, full, ft_config, tp_rank=0, tp=1)
    torch.manual_seed(hp.seed)  # the head's init, then dropout
    return SentenceClassifier(lm, task.num_outputs, hp.pooler_dropout, hp.pooling).to(device)


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
    keeper: BestModel | None = None,
) -> dict[str, Any]:
    """Fine-tune from ``full`` at peak rate ``lr``; validate after every epoch.

    Args:
        train, valid: ``(token rows, labels)`` (:func:`~megaformer.data.glue.encode_example`).
        keeper: offered the model after every epoch's validation (it keeps a copy of the best).

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
        outputs = predict(model, valid[0], hp.batch_size, device)
        metrics = score(task, np.asarray(valid[1]), outputs)
        if keeper is not None:
            keeper.offer(model, metrics, outputs, lr=lr, epoch=epoch, update=update)
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


def accuracy_interval(accuracy: float, n: int, level: float = 0.95) -> dict[str, Any]:
    """The binomial confidence interval of an accuracy measured on ``n`` examples: Wilson's score
    interval (Wilson 1927; ``scipy.stats.binomtest(k, n).proportion_ci(level, method="wilson")``),
    which keeps its coverage near ``level`` at small ``n`` and near 0 or 1, where the normal
    approximation does not.

    It is the sampling error of the validation set alone: the best accuracy over a grid of learning
    rates and epochs is also selected on that set, so it is biased upwards by more than this
    interval says.

    Args:
        accuracy: the fraction correct, ``k / n``.
        n: validation examples (> 0).
        level: confidence level.

    Returns:
        ``{"low", "high"}`` (fractions), ``"correct"`` (k), ``"n"``, ``"level"``, ``"method": "wilson"``.

    Raises:
        ValueError: ``n < 1`` or ``accuracy * n`` not within 1e-6 of an integer in ``[0, n]``.
    """
    from scipy import stats

    correct = round(accuracy * n) if n >= 1 else -1
    if n < 1 or not 0 <= correct <= n or abs(accuracy * n - correct) > 1e-6:
        raise ValueError(f"accuracy {accuracy!r} on n={n} examples is not a count k/n with 0 <= k <= n")
    ci = stats.binomtest(correct, n).proportion_ci(confidence_level=level, method="wilson")
    return {
        "low": float(ci.low),
        "high": float(ci.high),
        "correct": correct,
        "n": n,
        "level": level,
        "method": "wilson",
    }


class BestModel:
    """The best fine-tuned model seen so far by the task's selection metric (fairseq's
    ``checkpoint_best.pt``, ``--best-checkpoint-metric accuracy --maximize-best-checkpoint-metric``;
    STS-B: Pearson), over every learning rate and epoch it is offered, with ties going to the first
    (as :func:`_best` picks). It keeps a CPU copy of the weights: ``lm_state`` (the encoder in
    :func:`~megaformer.checkpoint.reshard.consolidate`'s naming, vocabulary rows cut to
    ``vocab_size``) and ``head_state`` (the :class:`ClassificationHead`'s ``state_dict``), so memory
    grows by one fp32 model (500 MB at 125M parameters)."""

    def __init__(self, task: GlueTask) -> None:
        self.task = task
        self.value: float | None = None
        self.lm_state: dict[str, torch.Tensor] | None = None
        self.head_state: dict[str, torch.Tensor] | None = None
        self.info: dict[str, Any] = {}
        self.predictions: str | None = None

    def offer(
        self, model: SentenceClassifier, metrics: dict[str, float], outputs: np.ndarray, **where: Any
    ) -> bool:
        """Keep ``model`` if its ``metrics[task.selection_metric]`` beats the best so far (NaN never
        does, but the first offer is always kept); ``outputs``: its validation outputs ``float[N, C]``
        (for a classification task the argmax is kept as ``predictions``, a string of one digit
        per validation example, for paired comparisons of models); ``where``: ``lr``,
        ``epoch``, ``update``. Returns whether it was kept."""

        value = _rank_value(metrics[self.task.selection_metric])
        if self.value is not None and value <= self.value:
            return False
        config = model.lm.config
        vocab = set(vocab_param_names(config))
        self.lm_state = {
            n: (p.detach().cpu()[: config.vocab_size] if n in vocab else p.detach().cpu()).clone()
            for n, p in model.lm.named_parameters()
        }
        self.head_state = {n: t.detach().cpu().clone() for n, t in model.head.state_dict().items()}
        self.value = value
        self.info = {**where, "metrics": dict(metrics), "selected_by": self.task.selection_metric}
        if not self.task.is_regression:
            # One digit per validation example, its predicted class (GLUE tasks have <= 3 classes).
            self.predictions = "".join(str(int(i)) for i in np.asarray(outputs).argmax(axis=-1))
        return True


BEST_TAG = "checkpoint_best"  # fairseq's name for the best checkpoint


def best_checkpoint_dir(out: str, task: GlueTask) -> str:
    """Where :func:`save_best` writes ``task``'s best model: ``OUT/<task>_best`` (e.g. ``sst-2_best``),
    a checkpoints directory like a run's (``latest`` naming the tag ``checkpoint_best``)."""
    return os.path.join(out, f"{task.name.lower()}_best")


def save_best(out: str, keeper: BestModel, run_config: dict[str, Any], doc: dict[str, Any]) -> str:
    """Write the best model in megaformer's checkpoint format (DeepSpeed's layout at TP = 1, with a
    manifest: :func:`~megaformer.checkpoint.reshard.write_module_checkpoint`), so that every tool
    reading a run's checkpoints reads it: ``export_hf`` (the encoder and the pretrained LM head, as
    ``MegaformerForMaskedLM``), ``evaluate``, ``reshard``, ``train.init_from``, and this tool again
    (``--checkpoint``). The classification head and the selection travel in the same file as the
    client-state entries ``classification_head`` (tensors) and ``finetune`` (task, lr, epoch,
    metrics, initialisation, source checkpoint), read back by :func:`load_classifier`.

    Args:
        out: the output directory; the checkpoint goes to :func:`best_checkpoint_dir`.
        keeper: holding the best model (:class:`BestModel`, after :func:`run_grid`).
        run_config: the source checkpoint's run config (its ``model`` is the architecture); saved
            with ``parallel.tp_size = pp_size = 1``.
        doc: the ``<task>.json`` document (task, model, best).

    Returns:
        The tag directory written (``OUT/<task>_best/checkpoint_best``).
    """
    import copy

    assert keeper.lm_state is not None and keeper.head_state is not None, "nothing was offered"
    config = ModelConfig(**run_config["model"])
    run = copy.deepcopy(run_config)
    run.setdefault("parallel", {}).update(tp_size=1, pp_size=1)
    provenance = {
        "finetune": {
            "tool": "megaformer.tools.finetune",
            "task": doc["task"],
            **{k: keeper.info[k] for k in ("selected_by", "lr", "epoch", "update", "metrics")},
            "init": doc["model"]["init"],
            "init_seed": doc["model"].get("init_seed"),
            "source_checkpoint": doc["model"]["checkpoint"],
            "hyperparameters": doc["hyperparameters"],
        },
        "classification_head": keeper.head_state,
    }
    shards = split(keeper.lm_state, config, 1)
    return write_module_checkpoint(
        best_checkpoint_dir(out, GLUE_TASKS[doc["task"]]),
        BEST_TAG,
        shards,
        run,
        doc["model"]["step"],
        provenance,
    )


def load_classifier(
    ckpt_dir: str, tag: str | None = None, device: str = "cpu", trust_code: bool = False
) -> tuple[SentenceClassifier, GlueTask, dict[str, Any]]:
    """The fine-tuned model :func:`save_best` wrote, ready to predict (evaluation mode).

    Args:
        ckpt_dir: ``OUT/<task>_best`` or its ``checkpoint_best`` directory.

    Returns:
        ``(model, task, finetune)``: the encoder and the classification head on ``device``, the GLUE
        task, and the ``finetune`` entry saved with it (lr, epoch, metrics, initialisation, source).

    Raises:
        ConfigError: a checkpoint without a classification head (a pretraining checkpoint: give it
            to ``--checkpoint`` to fine-tune it instead).
        ReshardError / CheckpointReadError / CheckpointError: see :func:`load_masked_lm`.
    """

    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    verify(tag_dir, needs=NEEDS_WEIGHTS)
    state = load_weights(os.path.join(tag_dir, model_states_name(0)), trust_code)
    head, info = state.get("classification_head"), state.get("finetune")
    if not isinstance(head, dict) or not isinstance(info, dict):
        raise ConfigError(
            f"{tag_dir}: no classification head; not a model saved by megaformer.tools.finetune "
            "(OUT/<task>_best). To fine-tune this checkpoint, pass it to --checkpoint"
        )
    full, run_config, _ = consolidate(tag_dir, trust_code=trust_code)
    task = glue_task(info["task"])
    model = build_classifier(
        {k: v.float() for k, v in full.items()},
        ModelConfig(**run_config["model"]),
        task,
        # Saved before pooling existed: the recipe's first token.
        FinetuneConfig(pooling=(info.get("hyperparameters") or {}).get("pooling", "first")),
        device,
    )
    model.head.load_state_dict({k: v.to(device) for k, v in head.items()}, strict=True)
    return model.eval(), task, info


def initial_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The weights a run of ``config`` with ``train.seed = seed`` starts from, before any update:
    the trainer's initialisation (:class:`~megaformer.model.NormFormerLM` draws every full tensor
    from ``seed`` and the parameter's name, the same at any TP degree), in
    :func:`~megaformer.checkpoint.reshard.consolidate`'s naming (vocabulary rows cut to
    ``vocab_size``). The random-initialisation control of ``--random-init``."""

    lm = NormFormerLM(config, tp_group=None, seed=seed)
    vocab = set(vocab_param_names(config))
    return {
        n: (p.detach()[: config.vocab_size] if n in vocab else p.detach()).clone().float()
        for n, p in lm.named_parameters()
    }


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
    ``trust_code``), its model config and ``{"tag_dir", "step", "params", "run_config"}``.

    Raises:
        ConfigError: not a masked LM (:func:`require_masked_lm`).
        ReshardError / CheckpointReadError / CheckpointError: see
            :func:`megaformer.tools.generate.load_for_generation`.
    """

    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    verify(tag_dir, needs=NEEDS_WEIGHTS)
    full, run_config, extra = consolidate(tag_dir, trust_code=trust_code)
    config = ModelConfig(**run_config["model"])
    require_masked_lm(config, tag_dir)
    params = sum(t.numel() for t in full.values())  # unpadded vocabulary: the paper's |θ|
    info = {
        "tag_dir": os.path.abspath(tag_dir),
        "step": int(extra.get("step") or 0),
        "params": params,
        "run_config": run_config,
    }
    return {k: v.float() for k, v in full.items()}, config, info


def encode_split(examples, encode, seq_len: int) -> tuple[list[list[int]], list, int]:
    """``(token rows, labels, truncated count)`` of :class:`~megaformer.data.glue.GlueExample` s."""

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


def run_grid(
    full, config, task, train, valid, lrs, hp, device="cpu", log=print, keeper: BestModel | None = None
) -> dict[str, Any]:
    """:func:`finetune_one` at every learning rate of ``lrs``; the best on validation by the paper's
    metric (``best``: accuracy, Pearson for STS-B) and by GLUE's main metric (``best_glue``), each
    with the accuracy's 95% binomial interval (:func:`accuracy_interval`) for a classification task.
    ``keeper`` (None: one is made) ends holding the weights of ``best``'s (lr, epoch)."""
    keeper = keeper if keeper is not None else BestModel(task)
    runs = []
    for lr in lrs:
        log(f"{task.name}: lr {lr:g}")
        runs.append(finetune_one(full, config, task, train, valid, lr, hp, device, log, keeper))
    best, best_glue = _best(runs, task.selection_metric), _best(runs, task.metrics[0])
    assert (keeper.info["lr"], keeper.info["epoch"]) == (best["lr"], best["epoch"])  # one rule for both
    n = len(valid[0])
    for entry in (best, best_glue):
        if "accuracy" in entry["metrics"]:
            entry["accuracy_ci95"] = accuracy_interval(entry["metrics"]["accuracy"], n)
    if keeper.predictions is not None:
        best["predictions"] = keeper.predictions  # per validation example, for paired comparisons
    return {"runs": runs, "best": best, "best_glue": best_glue}


def score_held_out(
    keeper: BestModel, config: ModelConfig, hp: FinetuneConfig, rows: tuple[list, list, int], device: str
) -> dict[str, Any]:
    """Score the selected model (``keeper``, after :func:`run_grid`) once on a held-out labelled set
    that took no part in choosing the learning rate and epoch, so that its accuracy is not biased
    upwards by the selection as the validation's best is (:func:`accuracy_interval`).

    Args:
        keeper: the best model by validation.
        rows: ``(token rows, labels, truncated)`` (:func:`encode_split`).

    Returns:
        ``{"examples", "truncated_to_seq_len", "selected_at": {"lr", "epoch"}, "metrics"}``, and for
        a classification task ``"accuracy_ci95"`` (Wilson), ``"predictions"`` and ``"labels"`` (one
        digit per example, for paired comparisons of models on the same set).
    """
    assert keeper.lm_state is not None and keeper.head_state is not None, "nothing was offered"
    task = keeper.task
    model = build_classifier(keeper.lm_state, config, task, hp, device)
    model.head.load_state_dict({k: v.to(device) for k, v in keeper.head_state.items()}, strict=True)
    outputs = predict(model, rows[0], hp.batch_size, device)
    metrics = score(task, np.asarray(rows[1]), outputs)
    out: dict[str, Any] = {
        "examples": len(rows[0]),
        "truncated_to_seq_len": rows[2],
        "selected_at": {"lr": keeper.info["lr"], "epoch": keeper.info["epoch"]},
        "metrics": metrics,
    }
    if not task.is_regression:
        out["accuracy_ci95"] = accuracy_interval(metrics["accuracy"], len(rows[0]))
        out["predictions"] = "".join(str(int(i)) for i in outputs.argmax(axis=-1))
        out["labels"] = "".join(str(int(y)) for y in rows[1])
    return out


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
        marked = t in by_task and recipe_differences(by_task[t])
        cells.append(_fmt(value) + (DIFFERS if marked else ""))
        if value is not None and not math.isnan(value):
            values.append(value)
    avg = _fmt(float(np.mean(values)), 100, 2) if values else "–"
    cells.append(avg if len(values) == len(TABLE3_TASKS) else f"{avg} ({len(values)}/{len(TABLE3_TASKS)})")
    return "| " + " | ".join(cells) + " |"


def _glue_cell(result: dict | None) -> str:
    if result is None:
        return "–"
    best = result["best_glue"]
    cell = "/".join(_fmt(best["metrics"][m]) for m in GLUE_TASKS[result["task"]].metrics)
    return cell + (DIFFERS if recipe_differences(result) else "")


DIFFERS = "†"  # marks a table cell whose run differs from the paper's recipe


def _lrs(values: Sequence[float]) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


def recipe_differences(doc: dict[str, Any]) -> list[str]:
    """What a ``<task>.json`` run did differently from the paper's recipe (RoBERTa-base's GLUE
    fine-tuning, the module docstring's table, from pretrained weights, on GLUE's whole training and
    development sets): one phrase per setting, empty when it followed the recipe. Read from the
    document alone, so results written before this function existed are judged too.

    Checked: the initialisation, the learning-rate grid, the epochs, the batch size, updates cut by
    ``--max-steps``, fewer training or validation examples than GLUE's, inputs reaching the model's
    ``seq_len`` (roberta-base has 512 positions), and every other hyperparameter of
    :class:`FinetuneConfig`. Not listed (every run shares it): fp32 instead of fairseq's ``--fp16``.
    """
    task = GLUE_TASKS[doc["task"]]
    hp, data, recipe = doc["hyperparameters"], doc["data"], FinetuneConfig()
    out = []
    if doc["model"].get("init") == "random":
        out.append(f"random initialisation, not pretrained (seed {doc['model'].get('init_seed')})")
    grid = hp.get("lr_grid")
    if grid is not None and sorted(grid) != sorted(PAPER_LR_GRID):
        out.append(f"learning rates {_lrs(grid)} (recipe: {_lrs(PAPER_LR_GRID)})")
    if hp["epochs"] != recipe.epochs:
        out.append(f"{hp['epochs']} epoch{'' if hp['epochs'] == 1 else 's'} (recipe: {recipe.epochs})")
    if hp["batch_size"] != task.batch_size:
        out.append(f"batch size {hp['batch_size']} (recipe: {task.batch_size})")
    full_updates = hp["epochs"] * math.ceil(data["train_examples"] / hp["batch_size"])
    if hp.get("max_steps") and hp["max_steps"] < full_updates:
        out.append(f"{hp['max_steps']} updates per learning rate (--max-steps; the epochs': {full_updates})")
    if data["train_examples"] < task.train_size:
        out.append(f"{data['train_examples']:,} of GLUE's {task.train_size:,} training examples")
    if data["valid_examples"] < task.dev_size:
        out.append(f"{data['valid_examples']:,} of GLUE's {task.dev_size:,} validation examples")
    cut = data.get("truncated_to_seq_len") or {}
    if cut.get("train") or cut.get("valid"):
        out.append(
            f"{cut.get('train', 0):,} training / {cut.get('valid', 0):,} validation inputs reach "
            f"seq_len {cut.get('seq_len')} and may be cut (roberta-base: 512 positions)"
        )
    for field in dataclasses.fields(FinetuneConfig):
        if field.name in ("epochs", "batch_size", "max_steps", "seed") or field.name not in hp:
            continue
        want = getattr(recipe, field.name)
        got = hp[field.name]
        if (list(got) if isinstance(got, list | tuple) else got) != (
            list(want) if isinstance(want, tuple) else want
        ):
            out.append(f"{field.name} {got} (recipe: {want})")
    return out


def _interval(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The best accuracy's 95% interval: as saved, or computed for a document written before it was."""
    best = doc["best"]
    if "accuracy" not in best["metrics"] or best["metrics"]["accuracy"] is None:
        return None
    return best.get("accuracy_ci95") or accuracy_interval(
        best["metrics"]["accuracy"], doc["data"]["valid_examples"]
    )


def paired_difference(a: dict[str, Any], b: dict[str, Any], level: float = 0.95) -> dict[str, Any] | None:
    """Accuracy of ``a`` minus ``b``'s on the same validation examples, paired example by example.

    Both are ``<task>.json`` documents of one classification task whose best entries carry
    ``predictions`` and whose data carry the same ``valid_labels`` (the same examples in the same
    order); None otherwise (other tasks or examples, or documents written before predictions were
    kept). With ``n`` examples, ``only_a`` of them right only in ``a`` and ``only_b`` only in ``b``:

    - difference ``d = (only_a - only_b) / n``;
    - its ``level`` interval: the Wald interval for paired proportions (Agresti 2013, Categorical
      Data Analysis, Sec. 10.1), ``d ± z · sqrt((only_a + only_b) - (only_a - only_b)² / n) / n``,
      which uses the correlation of the two models' errors (an unpaired interval would be wider);
    - McNemar's exact test: the two-sided binomial p of ``only_a`` among the ``only_a + only_b``
      discordant examples at 1/2 (1.0 when there are none).

    The same caveat as :func:`accuracy_interval`: each model's best is selected on this set.

    Returns:
        ``{"n", "accuracy_a", "accuracy_b", "difference", "low", "high", "only_a", "only_b",
        "mcnemar_p", "level"}`` (fractions), or None when the two cannot be paired.
    """
    from scipy import stats

    labels = a["data"].get("valid_labels")
    pa, pb = a["best"].get("predictions"), b["best"].get("predictions")
    if a["task"] != b["task"] or not labels or labels != b["data"].get("valid_labels") or not pa or not pb:
        return None
    assert len(pa) == len(pb) == len(labels), "predictions and labels of one validation set"
    right_a = np.frombuffer(pa.encode(), np.uint8) == np.frombuffer(labels.encode(), np.uint8)
    right_b = np.frombuffer(pb.encode(), np.uint8) == np.frombuffer(labels.encode(), np.uint8)
    n = len(labels)
    only_a, only_b = int(np.sum(right_a & ~right_b)), int(np.sum(right_b & ~right_a))
    d = (only_a - only_b) / n
    z = float(stats.norm.ppf(0.5 + level / 2))
    half = z * math.sqrt(max(0.0, (only_a + only_b) - (only_a - only_b) ** 2 / n)) / n
    discordant = only_a + only_b
    p = float(stats.binomtest(only_a, discordant, 0.5).pvalue) if discordant else 1.0
    return {
        "n": n,
        "accuracy_a": float(right_a.mean()),
        "accuracy_b": float(right_b.mean()),
        "difference": d,
        "low": d - half,
        "high": d + half,
        "only_a": only_a,
        "only_b": only_b,
        "mcnemar_p": p,
        "level": level,
    }


def _interval_lines(rows: dict[str, dict[str, dict]], glue: list[str]) -> list[str]:
    """render_tables' section: each accuracy with its 95 % Wilson interval."""
    out: list[str] = []
    out += [
        "",
        "## Accuracy with its 95% interval",
        "",
        "| Model | Task | accuracy (%) | 95% interval (Wilson) | correct / n | majority class (%) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, by_task in rows.items():
        for t in glue:
            ci = _interval(by_task[t]) if t in by_task else None
            if ci is None:
                continue
            majority = by_task[t]["data"].get("valid_majority")
            out.append(
                f"| {name} | {t} | {100 * ci['correct'] / ci['n']:.1f} | "
                f"[{100 * ci['low']:.1f}, {100 * ci['high']:.1f}] | {ci['correct']} / {ci['n']} | "
                f"{_fmt(majority)} |"
            )
    out += [
        "",
        "The interval is the validation set's sampling error of the selected (lr, epoch) only; the",
        "selection over the grid on the same set biases the best accuracy upwards beyond it. Majority",
        "class: the accuracy of always predicting the validation set's most common label.",
    ]
    return out


def _paired_lines(rows: dict[str, dict[str, dict]], glue: list[str]) -> list[str]:
    """render_tables' section: paired differences between models on the same examples."""
    out: list[str] = []
    pairs = [
        (t, x, y, paired_difference(rows[x][t], rows[y][t]))
        for t in glue
        for i, x in enumerate(rows)
        for y in list(rows)[i + 1 :]
        if t in rows[x] and t in rows[y]
    ]
    pairs = [(t, x, y, d) for t, x, y, d in pairs if d is not None]
    if pairs:
        out += [
            "",
            "## Paired differences on the same validation examples",
            "",
            "| Task | A | B | A − B (points) | 95% interval (paired Wald) | right only in A / only in B | "
            "McNemar exact p |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| {t} | {x} | {y} | {100 * d['difference']:+.1f} | "
            f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] | {d['only_a']} / {d['only_b']} | "
            f"{d['mcnemar_p']:.3g} |"
            for t, x, y, d in pairs
        ]
        out += [
            "",
            "Each model's best (lr, epoch), compared example by example; an interval that contains 0",
            "does not resolve the two at this validation set's size.",
        ]
    return out


def _recipe_lines(rows: dict[str, dict[str, dict]], glue: list[str]) -> list[str]:
    """render_tables' section: every setting that differs from the paper's recipe."""
    out: list[str] = []
    out += [
        "",
        "## Settings that differ from the paper's recipe",
        "",
    ]
    differences = [
        (name, t, recipe_differences(by_task[t]))
        for name, by_task in rows.items()
        for t in glue
        if t in by_task
    ]
    if any(d for _, _, d in differences):
        out += ["| Model | Task | differs from the recipe |", "|---|---|---|"]
        out += [f"| {name} | {t} | {'; '.join(d)} |" for name, t, d in differences if d]
    else:
        out.append("None: every run followed the recipe.")
    out += [
        "",
        "The recipe: the NormFormer paper's learning rates 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 6e-3 and",
        "roberta-base's other fine-tuning settings (fairseq examples/roberta/README.glue.md: 10 epochs,",
        "batch 16 or 32 by task, Adam (0.9, 0.98), eps 1e-6, weight decay 0.1, 6% warmup, dropout 0.1),",
        "from pretrained weights, on GLUE's whole training and development sets. Every run here is",
        "fp32 (fairseq: fp16).",
    ]
    return out


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
        f"{DIFFERS}: the run differs from the paper's recipe (listed below the tables).",
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
    out += _interval_lines(rows, glue) + _paired_lines(rows, glue) + _recipe_lines(rows, glue)
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
        "--checkpoint",
        help="a run directory, its checkpoints/ directory or one global_stepN (model.objective mlm)",
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
    p.add_argument(
        "--test-file",
        default=None,
        help="a labelled file of the task's format, scored once by the model selected on validation "
        "(e.g. data/glue/SST-2/test_labelled.tsv); it takes no part in the selection",
    )
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default="first",
        help="what the head reads: the <s> token's features (first, RoBERTa's recipe) or the mean over "
        "the non-padding positions (mean)",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="the control: fine-tune the checkpoint's architecture from the trainer's random "
        "initialisation instead of its weights (the table row gets ' (random init)')",
    )
    p.add_argument(
        "--init-seed",
        type=int,
        default=None,
        help="with --random-init: the initialisation's seed; None: the checkpoint run's train.seed "
        "(the very weights its pretraining started from)",
    )
    p.add_argument(
        "--no-save-best",
        action="store_true",
        help="do not write OUT/<task>_best (the best model by the task's metric, a checkpoint "
        "every tool reads)",
    )
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
    if args.init_seed is not None and not args.random_init:
        p.error("--init-seed is the seed of --random-init's weights; add --random-init, or drop --init-seed")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")


def _tokenizer(args: argparse.Namespace):

    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=args.vocab_file or str(REPO / "data" / "gpt2-bpe" / "encoder.json"),
        merge_file=args.merge_file or str(REPO / "data" / "gpt2-bpe" / "vocab.bpe"),
    )


def _data_doc(
    task: GlueTask, train_path: str, valid_path: str, train: tuple, valid: tuple, seq_len: int
) -> dict:
    """The ``data`` entry of ``<task>.json``: the files, the counts, the truncation and the labels."""
    majority = None
    if not task.is_regression:
        majority = float(max(np.bincount(np.asarray(valid[1], dtype=np.int64))) / len(valid[1]))
    return {
        "train": os.path.abspath(train_path),
        "valid": os.path.abspath(valid_path),
        "train_examples": len(train[0]),
        "valid_examples": len(valid[0]),
        "truncated_to_seq_len": {"train": train[2], "valid": valid[2], "seq_len": seq_len},
        "valid_majority": majority,
        # One digit per validation example, its label: what paired comparisons check.
        "valid_labels": None if task.is_regression else "".join(str(int(y)) for y in valid[1]),
    }


def finetune_task(args: argparse.Namespace, log=print) -> tuple[dict[str, Any], BestModel, dict[str, Any]]:
    """The command's work (after its flags are checked). Bad input (task, data, checkpoint) is
    raised before any training.

    Returns:
        ``(doc, keeper, run_config)``: the ``<task>.json`` document, the best model
        (:class:`BestModel`) and the checkpoint's run config (for :func:`save_best`).
    """

    task = glue_task(args.task)
    train_path, valid_path = task_files(args.data, task)
    # The data files are checked (and read) before the checkpoint is.
    train_rows = read_glue_file(train_path, task, args.max_train_examples)
    valid_rows = read_glue_file(valid_path, task, args.max_valid_examples)
    test_rows = read_glue_file(args.test_file, task) if args.test_file else None
    full, config, info = load_masked_lm(args.checkpoint, args.tag, args.trust_checkpoint_code)
    init_seed = None
    if args.random_init:
        # The control: the same architecture, none of the pretraining.
        saved_seed = (info["run_config"].get("train") or {}).get("seed", 1234)
        init_seed = int(args.init_seed if args.init_seed is not None else saved_seed)
        full = initial_weights(config, init_seed)
    encode = _tokenizer(args).encode
    train = encode_split(train_rows, encode, config.seq_len)
    valid = encode_split(valid_rows, encode, config.seq_len)
    hp = FinetuneConfig(
        epochs=args.epochs,
        batch_size=args.batch_size or task.batch_size,
        max_steps=args.max_steps,
        seed=args.seed,
        pooling=args.pooling,
    )
    run_dir = os.path.dirname(os.path.dirname(info["tag_dir"]))
    weights = (
        f"random initialisation (seed {init_seed}) of {info['tag_dir']}'s architecture"
        if args.random_init
        else f"{info['tag_dir']} (step {info['step']})"
    )
    log(
        f"# {task.name}: {len(train[0])} train / {len(valid[0])} valid examples ({train[2]} / {valid[2]} "
        f"at seq_len {config.seq_len}, longer ones cut), {weights}, device {args.device}, lr grid {args.lr}"
    )
    start = time.perf_counter()
    keeper = BestModel(task)
    grid = run_grid(full, config, task, train[:2], valid[:2], args.lr, hp, args.device, log, keeper)
    if test_rows is not None:
        test = encode_split(test_rows, encode, config.seq_len)
        grid["test"] = score_held_out(keeper, config, hp, test, args.device)
        grid["test"]["file"] = os.path.abspath(args.test_file)
    name = args.name or os.path.basename(run_dir) + (" (random init)" if args.random_init else "")
    doc = {
        "tool": "megaformer.tools.finetune",
        "task": task.name,
        "model": {
            "name": name,
            "checkpoint": info["tag_dir"],
            "init": "random" if args.random_init else "pretrained",
            "init_seed": init_seed,
            "step": 0 if args.random_init else info["step"],
            "params": info["params"],
            "norm_scheme": config.norm_scheme,
            "normformer": [k for k in ("post_attn_ln", "head_scale", "ffn_ln") if getattr(config, k)],
            "resid_scale": config.resid_scale,
        },
        "ppl": args.ppl if args.ppl is not None else (None if args.random_init else _run_ppl(run_dir)),
        "data": _data_doc(task, train_path, valid_path, train, valid, config.seq_len),
        "hyperparameters": {**dataclasses.asdict(hp), "lr_grid": list(args.lr)},
        "device": args.device,
        "seconds": time.perf_counter() - start,
        **grid,
    }
    doc["recipe_differences"] = recipe_differences(doc)
    return doc, keeper, info["run_config"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 2 for a bad task, data file, checkpoint or flag."""

    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    if args.table is not None:
        sys.stdout.write(render_tables(collect_results(args.table)))
        return 0
    try:
        doc, keeper, run_config = finetune_task(args)
    except (GlueDataError, ConfigError, CheckpointReadError, DataToolsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = os.path.dirname(os.path.dirname(doc["model"]["checkpoint"]))
    # The control's results go beside the pretrained model's, not over them.
    out = args.out or os.path.join(run_dir, "finetune-random-init" if args.random_init else "finetune")
    os.makedirs(out, exist_ok=True)
    if not args.no_save_best:
        doc["best"]["checkpoint"] = os.path.abspath(save_best(out, keeper, run_config, doc))
    path = os.path.join(out, f"{doc['task'].lower()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(doc), f, indent=2, allow_nan=False)
    table = render_tables(collect_results([out]))
    with open(os.path.join(out, "table3.md"), "w", encoding="utf-8") as f:
        f.write(table)
    best = doc["best"]
    ci = best.get("accuracy_ci95")
    interval = f" (95% interval [{ci['low']:.4f}, {ci['high']:.4f}], {ci['correct']}/{ci['n']})" if ci else ""
    print(
        f"{doc['task']}: best {best['selected_by']} {best['metrics'][best['selected_by']]:.4f}{interval} "
        f"at lr {best['lr']:g}, epoch {best['epoch']}; wrote {path} and {os.path.join(out, 'table3.md')}"
        + (f"; best model {best['checkpoint']}" if "checkpoint" in best else "")
    )
    if "test" in doc:
        test, tci = doc["test"], doc["test"].get("accuracy_ci95")
        shown = (
            f"accuracy {test['metrics']['accuracy']:.4f} (95% interval "
            f"[{tci['low']:.4f}, {tci['high']:.4f}], {tci['correct']}/{tci['n']})"
            if tci
            else " ".join(f"{k} {v:.4f}" for k, v in test["metrics"].items())
        )
        print(f"{doc['task']} held-out {test['file']}: {shown}, by the model selected on validation")
    if doc["recipe_differences"]:
        print("differs from the paper's recipe: " + "; ".join(doc["recipe_differences"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
