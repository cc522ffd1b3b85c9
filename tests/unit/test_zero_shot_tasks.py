"""``zero_shot`` beyond the paper's five tasks (issue 23 item 4), offline, in one process, on a tiny
random Pre-LN model exported by ``export_hf`` (tests/unit/test_export_hf.py's ``_export``):

- any lm_eval task YAML (a local ``dataset_path: json`` dataset written here) or a directory of them;
- ``--num-fewshot`` reaches lm_eval (the prompts the model scores hold that many examples);
- standard errors in the JSON and in both tables (the paper's, and lm_eval's layout for other tasks);
- |θ| of a ``--format gpt2`` export equals the model's unique parameter count (was the embedding
  twice plus the sinusoidal table: 13.7M for a 7.2M model);
- a malformed task file ends in one line naming the file, the line and the missing field (was
  ``KeyError: 'ctx_a'`` with a traceback), before any model loads;
- the ``megaformer`` lm_eval model is declared as an ``lm_eval.models`` entry point with the
  ``megaformer-lm-eval`` command (lm_eval's own command line is run in
  tests/distributed/test_zero_shot_lm_eval_cli.py, on a trained checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from megaformer.tools import zero_shot
from tests.unit.test_export_hf import _export

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "zero_shot"
ITEMS = [
    ("The sun rises in the", ["east", "west"], 0),
    ("Water freezes at zero degrees", ["Celsius", "banana"], 0),
    ("A cat says", ["woof", "meow"], 1),
    ("Two plus two is", ["four", "seven"], 0),
    ("The sky on a clear day is", ["green", "blue"], 1),
    ("Birds can", ["fly", "read"], 0),
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory):
    """(model, config, directory) of a tiny random Pre-LN model exported ``--format gpt2``."""
    return _export(tmp_path_factory.mktemp("gpt2"), "pre_ln", "gpt2")


def write_task(directory: Path, name: str = "tiny_qa", records: list[dict] | None = None, **override) -> Path:
    """A multiple-choice task YAML reading local JSON lines: ``records`` (default: ITEMS) as the
    validation split, ITEMS reversed as the train split (where few-shot examples come from)."""
    directory.mkdir(parents=True, exist_ok=True)
    items = [{"question": q, "choices": c, "label": label} for q, c, label in ITEMS]
    for split, rows in (("train", items[::-1]), ("valid", records or items)):
        (directory / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "train": str(directory / f"{name}_train.jsonl"),
                "validation": str(directory / f"{name}_valid.jsonl"),
            }
        },
        "output_type": "multiple_choice",
        "training_split": "train",
        "validation_split": "validation",
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "label",
        "doc_to_choice": "{{choices}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    config.update(override)
    config = {k: v for k, v in config.items() if v is not None}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = zero_shot.main([*args, "--device", "cpu"])
    return rc, out.getvalue()


def sample_stderr(p: float, n: int) -> float:
    """lm_eval's standard error of a mean of n 0/1 scores: sample standard deviation / sqrt(n)."""
    return math.sqrt(p * (1 - p) * n / (n - 1) / n)


def test_yaml_task_file_with_few_shot_and_standard_errors(gpt2_export, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    contexts: list[str] = []
    original = HFLM.loglikelihood

    def spy(self, requests, *a, **kw):
        contexts.extend(r.args[0] for r in requests)
        return original(self, requests, *a, **kw)

    monkeypatch.setattr(HFLM, "loglikelihood", spy)
    task = write_task(tmp_path / "task")
    result = tmp_path / "result.json"
    _, _, export = gpt2_export
    rc, out = run(
        ["--hf-model", str(export), "--tasks", str(task), "--num-fewshot", "2", "--json", str(result)]
    )
    assert rc == 0
    row = json.loads(result.read_text())
    res = row["tasks"]["tiny_qa"]
    assert res["task"] == "tiny_qa" and res["n"] == 6 and res["num_fewshot"] == 2 and row["num_fewshot"] == 2
    # Each prompt: the two few-shot examples, then the question (the count reached lm_eval's prompts).
    assert len(contexts) == 12 and all(c.count("Q: ") == 3 for c in contexts), contexts[:2]
    for metric in ("acc", "acc_norm"):
        assert res[f"{metric}_stderr"] == pytest.approx(sample_stderr(res[metric], 6), rel=1e-9)
        assert f"| {metric} | {res[metric]:.4f} | ± {res[f'{metric}_stderr']:.4f} |" in out, (
            out
        )  # lm_eval's layout for a task outside the paper's table
    assert f"| tiny_qa | 2 | acc | {res['acc']:.4f} | ± {res['acc_stderr']:.4f} | 6 |" in out, out


def test_directory_of_task_yamls(gpt2_export, tmp_path):
    directory = tmp_path / "tasks"
    write_task(directory, "tiny_a")
    write_task(directory, "tiny_b", doc_to_text="Question: {{question}}\nAnswer:")
    result = tmp_path / "result.json"
    _, _, export = gpt2_export
    rc, _ = run(["--hf-model", str(export), "--tasks", str(directory), "--limit", "2", "--json", str(result)])
    assert rc == 0
    tasks = json.loads(result.read_text())["tasks"]
    assert sorted(tasks) == ["tiny_a", "tiny_b"]
    assert all(t["n"] == 2 and t["num_fewshot"] == 0 for t in tasks.values())


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_group_yaml_runs_its_tasks_and_aggregate(gpt2_export, tmp_path):
    """A group YAML by its path (lm_eval 0.4.13 cannot load one by path: it is run by its name, its
    directory searched for the members), with lm_eval's aggregate row and its standard error."""
    directory = tmp_path / "tasks"
    write_task(directory, "tiny_a")
    write_task(directory, "tiny_b", doc_to_text="Question: {{question}}\nAnswer:")
    group = {
        "group": "tiny_group",
        "task": ["tiny_a", "tiny_b"],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}],
    }
    (directory / "group.yaml").write_text(yaml.safe_dump(group))
    result = tmp_path / "result.json"
    _, _, export = gpt2_export
    args = ["--hf-model", str(export), "--limit", "3", "--json", str(result)]
    rc, out = run([*args, "--tasks", str(directory / "group.yaml")])
    assert rc == 0
    tasks = json.loads(result.read_text())["tasks"]
    assert sorted(tasks) == ["tiny_a", "tiny_b", "tiny_group"]
    mean = (tasks["tiny_a"]["acc"] + tasks["tiny_b"]["acc"]) / 2
    assert tasks["tiny_group"]["acc"] == pytest.approx(mean) and tasks["tiny_group"]["acc_stderr"] > 0
    assert "| tiny_group | 0 | acc |" in out
    rc, _ = run([*args, "--tasks", str(directory)])  # the directory: the group once, not its members again
    assert rc == 0 and sorted(json.loads(result.read_text())["tasks"]) == ["tiny_a", "tiny_b", "tiny_group"]


def test_paper_table_has_standard_errors(gpt2_export, tmp_path):
    result = tmp_path / "result.json"
    _, _, export = gpt2_export
    args = ["--hf-model", str(export), "--json", str(result)]
    args += [f"--task=piqa={FIXTURES / 'piqa.jsonl'}", f"--task=winogrande={FIXTURES / 'winogrande.jsonl'}"]
    rc, out = run(args)
    assert rc == 0
    tasks = json.loads(result.read_text())["tasks"]
    pi, wg = tasks["piqa"], tasks["winogrande"]
    assert pi["acc_norm_stderr"] == pytest.approx(sample_stderr(pi["acc_norm"], 6), rel=1e-9)
    assert wg["acc_stderr"] == pytest.approx(sample_stderr(wg["acc"], 6), rel=1e-9)
    header = "| Model | \\|θ\\| (M) | PPL | HS | PI | WG | SC | OB | Avg |"
    assert header in out  # the paper's layout kept
    line = next(x for x in out.splitlines() if x.startswith(f"| {export.name} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == f"{100 * pi['acc_norm']:.1f} ± {100 * pi['acc_norm_stderr']:.1f}", line
    assert cells[5] == f"{100 * wg['acc']:.1f} ± {100 * wg['acc_stderr']:.1f}", line
    avg, avg_err = (pi["acc_norm"] + wg["acc"]) / 2, math.hypot(pi["acc_norm_stderr"], wg["acc_stderr"]) / 2
    assert cells[-1] == f"{100 * avg:.1f} ± {100 * avg_err:.1f}", line
    assert "0-shot" in out


@pytest.mark.parametrize("scheme", ["pre_ln", "pre_ln_learned_untied_relu2"])
@pytest.mark.parametrize("fmt", ["gpt2", "megaformer"])
def test_parameter_count_of_an_export_is_the_models(scheme, fmt, tmp_path):
    """|θ| of an export, counted on the loaded transformers model, equals megaformer's count of the
    model it came from (each tensor once, vocabulary padding not counted), in both formats: the
    gpt2 format's untied ``sqrt(d)·E`` / ``E`` pair and its sinusoidal ``wpe`` are not parameters of
    their own; a learned position table and an untied output projection are."""
    import transformers

    from megaformer.tools.export_hf import register_auto_classes

    register_auto_classes()
    model, config, export = _export(tmp_path, scheme, fmt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export))
    expected = zero_shot.megaformer_parameter_count(model, config)
    assert zero_shot.unique_parameter_count(hf) == expected
    if fmt == "gpt2" and scheme == "pre_ln":  # what was reported before: the embedding twice + wpe
        naive = sum(p.numel() for p in hf.parameters())
        assert (
            naive == expected + config.vocab_size * config.hidden_size + config.seq_len * config.hidden_size
        )


def test_parameter_column_of_a_gpt2_export(gpt2_export, tmp_path):
    model, config, export = gpt2_export
    result = tmp_path / "result.json"
    args = ["--hf-model", str(export), f"--task=piqa={FIXTURES / 'piqa.jsonl'}", "--limit", "1"]
    rc, out = run([*args, "--json", str(result)])
    assert rc == 0
    params = zero_shot.megaformer_parameter_count(model, config)
    assert json.loads(result.read_text())["params"] == params
    assert f"| {export.name} | {params / 1e6:.1f} | - |" in out


def _malformed(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(zero_shot arguments, the start of the one-line error) of a malformed task file."""
    if case == "paper_file_of_another_task":  # issue 23: was KeyError: 'ctx_a'
        path = FIXTURES / "piqa.jsonl"
        return [
            f"--task=hellaswag={path}"
        ], f"error: {path}:1: missing field 'activity_label': hellaswag reads"
    if case == "yaml_without_task":
        path = write_task(tmp_path, task=None)
        return ["--tasks", str(path)], f"error: {path}: missing field 'task'"
    if case == "yaml_without_doc_to_choice":
        path = write_task(tmp_path, doc_to_choice=None)
        return [
            "--tasks",
            str(path),
        ], f"error: {path}: task 'tiny_qa' (output_type multiple_choice) has no field 'doc_to_choice'"
    if case == "yaml_without_dataset_path":
        path = write_task(tmp_path, dataset_path=None)
        return ["--tasks", str(path)], f"error: {path}: task 'tiny_qa' has no field 'dataset_path'"
    if case == "yaml_syntax":
        path = tmp_path / "broken.yaml"
        path.write_text("task: x\n  dataset_path: [json\n")
        return ["--tasks", str(path)], f"error: {path}:2: not valid YAML"
    records = [{"question": q, "choices": c, "label": label} for q, c, label in ITEMS]
    if case == "record_without_field":
        del records[2]["question"]
        path = write_task(tmp_path, records=records)
        data = tmp_path / "tiny_qa_valid.jsonl"
        return ["--tasks", str(path)], f"error: {data}:3: missing field 'question'"
    assert case == "record_not_json"
    path = write_task(tmp_path)
    data = tmp_path / "tiny_qa_valid.jsonl"
    lines = data.read_text().splitlines()
    data.write_text("\n".join([lines[0], lines[1][:-1], *lines[2:]]) + "\n")
    return ["--tasks", str(path)], f"error: {data}:2: not JSON"


MALFORMED = [
    "paper_file_of_another_task",
    "yaml_without_task",
    "yaml_without_doc_to_choice",
    "yaml_without_dataset_path",
    "yaml_syntax",
    "record_without_field",
    "record_not_json",
]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_task_file_is_named_before_the_model_loads(case, tmp_path, capsys):
    args, start = _malformed(tmp_path, case)
    # A model directory that does not exist: the task files are checked first.
    rc, out = run(["--hf-model", str(tmp_path / "no-model-here"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and out == ""
    assert err.startswith(start), err
    assert err.count("\n") == 1 and "Traceback" not in err and "KeyError" not in err


def test_field_missing_after_process_docs_is_traced_to_its_record(gpt2_export, tmp_path, capsys):
    """A task whose ``process_docs`` (code) reads a field some records lack: lm_eval's KeyError at run
    time becomes the file, the line and the field."""
    (tmp_path / "utils.py").write_text(
        textwrap.dedent(
            """
            def process_docs(dataset):
                return dataset.map(lambda doc: {"query": doc["question"] + " " + doc["context"]})
            """
        )
    )
    path = write_task(tmp_path, doc_to_text="{{query}}")
    path.write_text(path.read_text() + "process_docs: !function utils.process_docs\n")
    _, _, export = gpt2_export
    rc, _ = run(["--hf-model", str(export), "--tasks", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"error: {tmp_path / 'tiny_qa_train.jsonl'}:1: missing field 'context'" in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_unknown_task_name_says_the_close_ones(gpt2_export, capsys):
    _, _, export = gpt2_export
    rc, _ = run(["--hf-model", str(export), "--tasks", "pica"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tasks pica: no lm_eval task, group or tag of that name (did you mean" in err
    assert "piqa" in err and "Traceback" not in err


def test_lm_eval_model_is_an_entry_point_with_a_command():
    """pyproject.toml declares ``megaformer`` in the ``lm_eval.models`` group and the
    ``megaformer-lm-eval`` command (after ``pip install -e .``)."""
    import importlib.metadata as md

    (ep,) = [e for e in md.entry_points(group="lm_eval.models") if e.name == "megaformer"]
    assert ep.load() is zero_shot.MegaformerLM
    (script,) = [e for e in md.entry_points(group="console_scripts") if e.name == "megaformer-lm-eval"]
    assert script.value == "megaformer.tools.lm_eval_cli:main"


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_registering_megaformer_keeps_lm_evals_own_models():
    """Importing zero_shot first (which registers ``megaformer``) used to leave lm_eval's registry
    non-empty without its own models, so ``get_model('hf')`` failed; and registering over the
    entry-point placeholder lm_eval is materialising must not fail."""
    zero_shot_first = """
        import megaformer.tools.zero_shot as z
        from lm_eval.api.registry import get_model
        assert get_model("hf").__name__ == "HFLM"
        assert get_model("megaformer") is z.MegaformerLM
        from megaformer.tools.lm_eval_cli import register_entry_point_models
        assert register_entry_point_models() == []  # already there
        """
    entry_point_first = """
        from megaformer.tools.lm_eval_cli import register_entry_point_models
        assert register_entry_point_models() == ["megaformer"]
        from lm_eval.api.registry import get_model
        cls = get_model("megaformer")  # imports zero_shot, which registers it once more
        import megaformer.tools.zero_shot as z
        assert cls is z.MegaformerLM and get_model("hf").__name__ == "HFLM"
        """
    for code in (zero_shot_first, entry_point_first):
        cmd = [sys.executable, "-c", textwrap.dedent(code)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
