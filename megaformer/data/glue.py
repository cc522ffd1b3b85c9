"""GLUE tasks: their files, RoBERTa's input format, and the metrics GLUE reports.

**Files.** The layout GLUE's ``download_glue_data.py`` writes (``glue_data/<TASK>/{train,dev}.tsv``),
read as GLUE's own processors read them: tab-separated, no quoting (``csv.reader(..., quotechar=None)``
in the GLUE baseline and in ``transformers``' ``glue.py``), UTF-8 with an optional byte-order mark
(MRPC's has one). CoLA has no header (columns: source, label, original mark, sentence); every other
task has one, and its columns are found by name. :data:`GLUE_TASKS` lists each task's columns,
labels and metrics; ``data/glue/`` in this repository holds the development sets of RTE, MRPC, CoLA,
SST-2 and STS-B, RTE's training set, and a documented 10,000-row subset of SST-2's training set
(``data/glue/SOURCE.md``; the subset's rule is :func:`hashed_subset`, applied by
``scripts/make_sst2_subset.py``).

A file that does not fit its task is refused with the file and line: a missing column, a label
outside the task's set, an STS-B score that is not a number in [0, 5] (:class:`GlueDataError`).

**Input format** (RoBERTa, Liu et al. 2019; fairseq ``examples/roberta/preprocess_GLUE_tasks.sh``
and the ``sentence_prediction`` task with ``--init-token 0 --separator-token 2``): one sentence is
``<s> A </s>``, a pair ``<s> A </s></s> B </s>``. megaformer's masked LM keeps GPT-2's raw ids and adds
its specials above them (:mod:`megaformer.data.mlm`), so:

    ======== ============================ ==========================================
    RoBERTa  megaformer id                why
    ======== ============================ ==========================================
    ``<s>``  :data:`~megaformer.data.mlm.BOS_ID` (50258)  the token every pretraining block starts with
    ``</s>`` :data:`~megaformer.data.mlm.EOD_ID` (50256)  GPT-2's ``<|endoftext|>``, the separator
                                                          pretraining puts at document ends
    ``<pad>`` :data:`~megaformer.data.mlm.PAD_ID` (50259) padding, masked out of attention
    ======== ============================ ==========================================

Each sentence is encoded with the GPT-2 BPE on its own (as fairseq's ``multiprocessing_bpe_encoder``
encodes each column). A pair longer than the model's ``seq_len`` loses tokens from the end of its
longer sentence first (fairseq ``--truncate-sequence`` cuts the end of the whole sequence instead,
which can drop sentence B entirely; no GLUE development example of RTE, MRPC, CoLA or SST-2 exceeds
512 tokens, so at roberta-base's 512 positions the two agree on them).

**Metrics** (Wang et al. 2019, GLUE, Table 1; what the GLUE leaderboard shows): accuracy for SST-2,
MNLI, QNLI, RTE and WNLI; F1 (of the positive class, label 1) and accuracy for MRPC and QQP; Matthews
correlation for CoLA; Pearson and Spearman correlation for STS-B. They are computed here with
numpy and checked against scikit-learn / scipy in the tests.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megaformer.data.mlm import BOS_ID, EOD_ID

__all__ = [
    "GLUE_TASKS",
    "GlueDataError",
    "GlueExample",
    "GlueTask",
    "encode_example",
    "glue_task",
    "hashed_subset",
    "read_glue_file",
    "score",
    "task_files",
]


class GlueDataError(ValueError):
    """A GLUE file, task name or data directory that cannot be used; the message names the file and
    line (or the name) and what was expected."""


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its data is, how to read it, how it is scored.

    Attributes:
        name: GLUE's name (``"RTE"``, ``"SST-2"``), also its directory in ``glue_data``.
        text_columns: the sentence column(s), by header name; by 0-based index without a header.
        label_column: the label column, by header name or index.
        labels: the label strings as they appear in the files, in class-index order; None for a
            regression task (STS-B: a score in ``[0, 5]``).
        metrics: the metrics GLUE reports, the first being the leaderboard's main one.
        batch_size: sentences per update in fairseq's RoBERTa GLUE recipe
            (``examples/roberta/README.glue.md``: 16 for RTE, MRPC, CoLA, STS-B; 32 for the rest).
        has_header: False only for CoLA.
        valid_file, train_file: file names in the task's directory (MNLI: ``dev_matched.tsv``).
        dev_size: examples in GLUE's development set (its published size).
        train_size: examples in GLUE's training set (the size of its ``train.tsv``; what the paper's
            recipe trains on, against which a smaller training set is marked in ``table3.md``).
    """

    name: str
    text_columns: tuple[str | int, ...]
    label_column: str | int
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    batch_size: int
    dev_size: int
    train_size: int
    has_header: bool = True
    valid_file: str = "dev.tsv"
    train_file: str = "train.tsv"

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_outputs(self) -> int:
        """Outputs of the classification head: the classes, or 1 for regression."""
        return 1 if self.labels is None else len(self.labels)

    @property
    def selection_metric(self) -> str:
        """The metric that picks the best epoch and learning rate, and fills Table 3: accuracy for
        every classification task (fairseq ``--best-checkpoint-metric accuracy``; the paper: "we
        report fine-tuned accuracy on GLUE in Table 3"), Pearson correlation for STS-B."""
        return "pearson" if self.is_regression else "accuracy"


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("CoLA", (3,), 1, _BINARY, ("mcc", "accuracy"), 16, 1043, 8551, has_header=False),
        GlueTask("SST-2", ("sentence",), "label", _BINARY, ("accuracy",), 32, 872, 67349),
        GlueTask("MRPC", ("#1 String", "#2 String"), "Quality", _BINARY, ("f1", "accuracy"), 16, 408, 3668),
        GlueTask("STS-B", ("sentence1", "sentence2"), "score", None, ("pearson", "spearman"), 16, 1500, 5749),
        GlueTask(
            "QQP", ("question1", "question2"), "is_duplicate", _BINARY, ("accuracy", "f1"), 32, 40430, 363846
        ),
        GlueTask(
            "MNLI",
            ("sentence1", "sentence2"),
            "gold_label",
            ("contradiction", "entailment", "neutral"),
            ("accuracy",),
            32,
            9815,
            392702,
            valid_file="dev_matched.tsv",
        ),
        GlueTask("QNLI", ("question", "sentence"), "label", _NLI2, ("accuracy",), 32, 5463, 104743),
        GlueTask("RTE", ("sentence1", "sentence2"), "label", _NLI2, ("accuracy",), 16, 277, 2490),
        GlueTask("WNLI", ("sentence1", "sentence2"), "label", _BINARY, ("accuracy",), 32, 71, 635),
    )
}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def glue_task(name: str) -> GlueTask:
    """The task called ``name``, in any case, with or without the hyphen (``sst2``, ``SST-2``).

    Raises:
        GlueDataError: no such task (the message lists them).
    """
    for task in GLUE_TASKS.values():
        if _key(task.name) == _key(name):
            return task
    names = ", ".join(_key(t) for t in GLUE_TASKS)
    raise GlueDataError(f"--task {name!r}: not a GLUE task; choose one of {names}")


def task_files(data_dir: str, task: GlueTask) -> tuple[str, str]:
    """``(train, valid)`` paths of ``task`` under ``data_dir``: the task's own directory (holding
    ``dev.tsv``) or a GLUE root holding ``<TASK>/dev.tsv``. The training file need not exist (it is
    checked when read).

    Raises:
        GlueDataError: neither layout holds the validation file (names both paths tried).
    """
    candidates = [data_dir, os.path.join(data_dir, task.name)]
    for folder in candidates:
        valid = os.path.join(folder, task.valid_file)
        if os.path.isfile(valid):
            return os.path.join(folder, task.train_file), valid
    tried = " or ".join(os.path.join(c, task.valid_file) for c in candidates)
    raise GlueDataError(f"--data {data_dir}: no {task.name} validation file ({tried})")


@dataclass(frozen=True)
class GlueExample:
    """One row: its sentence(s), its label (class index, or the STS-B score) and where it came from."""

    texts: tuple[str, ...]
    label: int | float
    line: int  # 1-based line number in the file


def _column_indexes(path: str, header: list[str] | None, task: GlueTask) -> list[int]:
    """Field indexes of the text columns, then the label column."""
    wanted = [*task.text_columns, task.label_column]
    if header is None:
        return [int(c) for c in wanted]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise GlueDataError(
            f"{path}:1: no column {missing[0]!r} in the header (columns: {', '.join(header)}); "
            f"a GLUE {task.name} file with labels has {', '.join(map(str, wanted))}"
        )
    return [header.index(str(c)) for c in wanted]


def _label(path: str, line: int, raw: str, task: GlueTask) -> int | float:
    if task.labels is not None:
        if raw not in task.labels:
            raise GlueDataError(
                f"{path}:{line}: label {raw!r} is not one of {task.name}'s labels {list(task.labels)}"
            )
        return task.labels.index(raw)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 5.0:  # also false for NaN
        raise GlueDataError(f"{path}:{line}: {task.name} score {raw!r} is not a number in [0, 5]")
    return value


def read_glue_file(path: str, task: GlueTask, limit: int = 0) -> list[GlueExample]:
    """The labelled examples of a GLUE ``.tsv`` file, in file order.

    Args:
        path: the file (``train.tsv``, ``dev.tsv``; a test file has no labels and is refused).
        task: its task (:func:`glue_task`).
        limit: read at most this many examples (0: all).

    Raises:
        GlueDataError: no such file, no examples, a header without one of the task's columns, a row
            with too few fields, a label outside the task's set, a bad STS-B score (each names the
            file and line).
    """
    if not os.path.isfile(path):
        raise GlueDataError(f"{path}: no such file (a {task.name} .tsv file from GLUE's download script)")
    examples: list[GlueExample] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    header = lines[0].rstrip("\r").split("\t") if task.has_header and lines else None
    columns = _column_indexes(path, header, task)
    names = [*task.text_columns, task.label_column]
    first = 2 if task.has_header else 1
    for line_no, line in enumerate(lines[first - 1 :], start=first):
        fields = line.rstrip("\r").split("\t")
        if len(fields) <= max(columns):
            name, index = next((n, i) for n, i in zip(names, columns, strict=True) if i >= len(fields))
            raise GlueDataError(
                f"{path}:{line_no}: {len(fields)} tab-separated field(s); column {name!r} "
                f"(field {index + 1}) is missing"
            )
        texts = tuple(fields[i] for i in columns[:-1])
        examples.append(GlueExample(texts, _label(path, line_no, fields[columns[-1]], task), line_no))
        if limit and len(examples) >= limit:
            break
    if not examples:
        raise GlueDataError(f"{path}: no examples")
    return examples


def hashed_subset(count: int, keep: int, salt: str) -> list[int]:
    """A reproducible subset of ``keep`` of ``count`` rows, defined without a random generator.

    Row ``i`` (0-based, in file order, header excluded) gets the key
    ``sha256(f"{salt}:{i}".encode("utf-8")).digest()``; the ``keep`` rows with the smallest keys
    (compared as bytes) are chosen. The rule depends on nothing but ``salt`` and the row indexes, so
    any Python, on any machine, picks the same rows (``random.sample`` and numpy's generators make
    no such promise across versions). ``data/glue/SST-2/train.tsv`` is ``salt="glue-sst2-train-subset"``,
    ``keep=10000`` of GLUE's 67,349 rows (``scripts/make_sst2_subset.py``).

    Args:
        count: rows in the full file.
        keep: rows to choose, ``1 <= keep <= count``.
        salt: names the subset; another salt gives an independent one.

    Returns:
        The chosen row indexes in ascending order (the file's order), ``len == keep``.

    Raises:
        ValueError: ``keep`` outside ``[1, count]`` (names both).
    """
    if not 1 <= keep <= count:
        raise ValueError(f"keep={keep} rows of count={count}: keep must be between 1 and count")
    digests = [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(count)]
    return sorted(sorted(range(count), key=digests.__getitem__)[:keep])


def encode_example(texts: Sequence[str], encode: Callable[[str], list[int]], max_tokens: int) -> list[int]:
    """RoBERTa's input ids: ``<s> A </s>`` or ``<s> A </s></s> B </s>`` (see the module docstring).

    Args:
        texts: one or two sentences.
        encode: text -> GPT-2 BPE ids (``GPT2BPETokenizer.encode``).
        max_tokens: the model's ``seq_len``; longer inputs lose tokens from the end of the longer
            sentence first.

    Returns:
        At most ``max_tokens`` ids.

    Raises:
        GlueDataError: ``max_tokens`` leaves no room for one token per sentence.
    """
    segments = [encode(t.strip()) for t in texts]
    specials = 2 + 2 * (len(segments) - 1)  # <s> and </s>, plus </s></s> between a pair
    budget = max_tokens - specials
    if budget < len(segments):
        raise GlueDataError(f"seq_len={max_tokens} leaves no room for {len(segments)} sentence(s)")
    while sum(len(s) for s in segments) > budget:
        longest = max(range(len(segments)), key=lambda i: len(segments[i]))
        segments[longest] = segments[longest][:-1]
    ids = [BOS_ID, *segments[0], EOD_ID]
    for segment in segments[1:]:
        ids += [EOD_ID, *segment, EOD_ID]
    return ids


# ---- metrics (GLUE's, checked against scikit-learn / scipy in tests/unit/test_finetune.py) ----


def accuracy(labels: np.ndarray, preds: np.ndarray) -> float:
    """Fraction of ``preds`` equal to ``labels``."""
    return float(np.mean(np.asarray(labels) == np.asarray(preds)))


def f1_positive(labels: np.ndarray, preds: np.ndarray) -> float:
    """F1 of class 1 (binary, as GLUE scores MRPC and QQP): ``2 tp / (2 tp + fp + fn)``; 0 when
    there is no positive label or prediction (scikit-learn's value)."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    tp = int(np.sum((preds == 1) & (labels == 1)))
    fp = int(np.sum((preds == 1) & (labels != 1)))
    fn = int(np.sum((preds != 1) & (labels == 1)))
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews(labels: np.ndarray, preds: np.ndarray) -> float:
    """Matthews correlation (Gorodkin's multiclass form, which is the binary one for two classes):
    ``(c·s - t·p) / sqrt((s² - p·p)(s² - t·t))`` with ``t``, ``p`` the true and predicted counts per
    class, ``c`` the correct count, ``s`` the total; 0 when a factor of the denominator is 0
    (scikit-learn's ``matthews_corrcoef``)."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    classes = np.union1d(labels, preds)
    t = np.array([np.sum(labels == c) for c in classes], dtype=np.float64)
    p = np.array([np.sum(preds == c) for c in classes], dtype=np.float64)
    c, s = float(np.sum(labels == preds)), float(labels.size)
    denominator = (s * s - p @ p) * (s * s - t @ t)
    return 0.0 if denominator == 0 else float((c * s - t @ p) / math.sqrt(denominator))


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank (scipy's ``rankdata(method="average")``)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + 1 + end) / 2.0
            start = end
    return ranks


def pearson(labels: np.ndarray, preds: np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant (scipy warns and returns NaN)."""
    x, y = np.asarray(labels, dtype=np.float64), np.asarray(preds, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(x @ x) * float(y @ y))
    return math.nan if denominator == 0 else float(x @ y) / denominator


def spearman(labels: np.ndarray, preds: np.ndarray) -> float:
    """Spearman correlation: Pearson of the average ranks."""
    x, y = np.asarray(labels, dtype=np.float64), np.asarray(preds, dtype=np.float64)
    return pearson(_ranks(x), _ranks(y))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": f1_positive,
    "mcc": matthews,
    "pearson": pearson,
    "spearman": spearman,
}


def score(task: GlueTask, labels: np.ndarray, outputs: np.ndarray) -> dict[str, float]:
    """Every metric the task uses (its :attr:`~GlueTask.metrics`, plus the selection metric).

    Args:
        labels: ``int[N]`` class indexes, or ``float[N]`` STS-B scores.
        outputs: the head's ``float[N, C]`` logits (classification: the argmax is the prediction),
            or ``float[N]`` / ``float[N, 1]`` predicted scores (regression).

    Returns:
        ``{metric: value}`` as fractions (accuracy 0.664, not 66.4); NaN where undefined.
    """
    outputs = np.asarray(outputs)
    preds = outputs.reshape(-1) if task.is_regression else outputs.argmax(axis=-1)
    names = dict.fromkeys((*task.metrics, task.selection_metric))
    return {name: METRICS[name](np.asarray(labels), preds) for name in names}
