"""The GLUE reader (megaformer.data.glue) and the bundled GLUE data (data/glue, SOURCE.md): GLUE's
published sizes and label counts, the recorded hashes, and bad input refused with the file and line."""

from __future__ import annotations

import collections
import hashlib
import re
from pathlib import Path

import pytest

from megaformer.data.glue import (
    GLUE_TASKS,
    GlueDataError,
    glue_task,
    hashed_subset,
    read_glue_file,
    task_files,
)

GLUE_DIR = Path(__file__).resolve().parents[2] / "data" / "glue"

# GLUE's development sets: size (Wang et al. 2019) and label counts in class-index order.
BUNDLED = {
    "RTE": (277, [146, 131]),
    "MRPC": (408, [129, 279]),
    "CoLA": (1043, [322, 721]),
    "SST-2": (872, [428, 444]),
    "STS-B": (1500, None),
}


@pytest.mark.parametrize("name", list(BUNDLED))
def test_bundled_dev_sets_have_glue_s_sizes_and_label_counts(name):
    task = glue_task(name)
    valid = task_files(str(GLUE_DIR), task)[1]
    examples = read_glue_file(valid, task)
    size, counts = BUNDLED[name]
    assert len(examples) == size == task.dev_size
    assert all(len(e.texts) == len(task.text_columns) and all(e.texts) for e in examples)
    if counts is None:
        assert min(e.label for e in examples) == 0.0 and max(e.label for e in examples) == 5.0
    else:
        assert [collections.Counter(e.label for e in examples)[i] for i in range(len(counts))] == counts


def test_bundled_rte_training_set_and_first_rows():
    rte = glue_task("rte")
    train = read_glue_file(str(GLUE_DIR / "RTE" / "train.tsv"), rte)
    assert len(train) == 2490 and train[0].texts[0] == "No Weapons of Mass Destruction Found in Iraq Yet."
    dev = read_glue_file(str(GLUE_DIR / "RTE" / "dev.tsv"), rte)
    assert dev[0].texts[1] == "Christopher Reeve had an accident." and dev[0].label == 1  # not_entailment
    assert dev[0].line == 2 and dev[-1].line == 278
    mrpc = read_glue_file(str(GLUE_DIR / "MRPC" / "dev.tsv"), glue_task("mrpc"))  # UTF-8 BOM header
    assert mrpc[0].texts[0].startswith("He said the foodservice pie business doesn 't fit")
    cola = read_glue_file(str(GLUE_DIR / "CoLA" / "dev.tsv"), glue_task("cola"))  # no header
    assert cola[0].texts == ("The sailors rode the breeze clear of the rocks.",) and cola[0].line == 1


def test_bundled_sst2_training_subset_loads_with_its_documented_counts():
    """data/glue/SST-2/train.tsv: the 10,000-row subset SOURCE.md documents (5,582 positive)."""
    sst2 = glue_task("sst2")
    train_path, _ = task_files(str(GLUE_DIR), sst2)
    assert train_path == str(GLUE_DIR / "SST-2" / "train.tsv")
    train = read_glue_file(train_path, sst2)
    assert len(train) == 10_000 < sst2.train_size == 67_349
    assert collections.Counter(e.label for e in train) == {1: 5582, 0: 4418}
    assert (
        train[0].texts
        == ("that loves its characters and communicates something rather beautiful about human nature ",)
        and train[0].label == 1
    )  # full file's row 2
    assert train[-1].line == 10_001 and all(e.texts[0].strip() for e in train)
    dev = {e.texts[0].strip() for e in read_glue_file(str(GLUE_DIR / "SST-2" / "dev.tsv"), sst2)}
    assert not dev & {e.texts[0].strip() for e in train}  # no development sentence in training


def test_hashed_subset_is_the_documented_rule():
    # The rule, spelled out: the keep smallest sha256("<salt>:<i>") digests, in row order.
    import hashlib

    keys = sorted(range(50), key=lambda i: hashlib.sha256(f"s:{i}".encode()).digest())
    assert hashed_subset(50, 7, "s") == sorted(keys[:7])
    assert hashed_subset(50, 50, "s") == list(range(50))
    assert hashed_subset(50, 7, "t") != hashed_subset(50, 7, "s")  # the salt names the subset
    first = hashed_subset(67_349, 10_000, "glue-sst2-train-subset")
    assert first[:3] == [2, 30, 36] and first[-1] == 67_348 and len(first) == 10_000
    for bad in (0, 51):
        with pytest.raises(ValueError, match=f"keep={bad} rows of count=50"):
            hashed_subset(50, bad, "s")


def test_make_sst2_subset_script_writes_the_rule_s_rows(tmp_path):
    """The script that wrote the bundled subset: the rule's rows, bytes unchanged; GLUE's hash checked."""
    import subprocess
    import sys

    script = GLUE_DIR.parents[1] / "scripts" / "make_sst2_subset.py"
    rows = [f"phrase number {i} \t{i % 2}".encode() for i in range(40)]
    full = tmp_path / "train.tsv"
    full.write_bytes(b"sentence\tlabel\n" + b"\n".join(rows) + b"\n")
    out = tmp_path / "sub" / "train.tsv"
    cmd = [sys.executable, "-B", str(script), str(full), "--output", str(out), "--keep", "5"]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode == 2 and "not GLUE's SST-2 train.tsv" in refused.stderr
    assert "--any-input" in refused.stderr and not out.exists()
    done = subprocess.run([*cmd, "--any-input"], capture_output=True, text=True, check=True)
    assert "5 of 40 rows" in done.stdout
    chosen = hashed_subset(40, 5, "glue-sst2-train-subset")
    assert out.read_bytes() == b"sentence\tlabel\n" + b"".join(rows[i] + b"\n" for i in chosen)
    assert read_glue_file(str(out), glue_task("sst2"))[0].texts == (f"phrase number {chosen[0]} ",)


def test_source_md_hashes_match_the_files():
    text = (GLUE_DIR / "SOURCE.md").read_text()
    rows = re.findall(r"^\| (\S+\.(?:tsv|txt)) \|[^|]*\|[^|]*\| ([0-9a-f]{64}) \|", text, re.M)
    assert {name for name, _ in rows} == {
        p.relative_to(GLUE_DIR).as_posix() for p in GLUE_DIR.rglob("*") if p.suffix in (".tsv", ".txt")
    }
    for name, digest in rows:
        assert hashlib.sha256((GLUE_DIR / name).read_bytes()).hexdigest() == digest, name
    assert sum(p.stat().st_size for p in GLUE_DIR.rglob("*") if p.is_file()) < 3_000_000


# ---- task names and the data directory ----


def test_task_names_in_any_spelling_and_an_unknown_one():
    assert glue_task("sst2") is glue_task("SST-2") is GLUE_TASKS["SST-2"]
    assert glue_task("sts_b").is_regression and glue_task("stsb").num_outputs == 1
    assert glue_task("mnli").num_outputs == 3 and glue_task("mnli").valid_file == "dev_matched.tsv"
    with pytest.raises(GlueDataError, match="'rte2': not a GLUE task; choose one of cola, sst2, mrpc, stsb"):
        glue_task("rte2")


def test_the_data_directory_may_be_the_task_s_or_the_glue_root(tmp_path):
    rte = glue_task("rte")
    assert task_files(str(GLUE_DIR), rte) == (
        str(GLUE_DIR / "RTE" / "train.tsv"),
        str(GLUE_DIR / "RTE" / "dev.tsv"),
    )
    assert task_files(str(GLUE_DIR / "RTE"), rte)[1] == str(GLUE_DIR / "RTE" / "dev.tsv")
    with pytest.raises(
        GlueDataError, match=r"--data .*: no RTE validation file \(.*dev\.tsv or .*RTE/dev\.tsv\)"
    ):
        task_files(str(tmp_path), rte)


# ---- bad files: named with the line ----


def _write(tmp_path: Path, text: str, name: str = "dev.tsv") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_header_without_the_task_s_column_is_refused(tmp_path):
    path = _write(tmp_path, "index\tsentence1\tsentence2\n0\tA.\tB.\n")  # RTE's test.tsv: no labels
    with pytest.raises(GlueDataError, match=re.escape(f"{path}:1: no column 'label' in the header")):
        read_glue_file(path, glue_task("rte"))


def test_a_row_with_a_missing_column_is_refused_with_its_line(tmp_path):
    path = _write(tmp_path, "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tA only.\n")
    with pytest.raises(
        GlueDataError, match=re.escape(f"{path}:3: 2 tab-separated field(s); column 'sentence2'")
    ):
        read_glue_file(path, glue_task("rte"))
    cola = _write(tmp_path, "gj04\t1\t\tFine.\ngj04\t0\n", "cola.tsv")  # no header: line 2
    with pytest.raises(
        GlueDataError, match=re.escape(f"{cola}:2: 2 tab-separated field(s); column 3 (field 4)")
    ):
        read_glue_file(cola, glue_task("cola"))


@pytest.mark.parametrize(
    ("task", "text", "line", "needle"),
    [
        ("rte", "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tA.\tB.\tneutral\n", 3,
         "label 'neutral' is not one of RTE's labels ['entailment', 'not_entailment']"),
        ("sst2", "sentence\tlabel\ngood .\t1\nbad .\t2\n", 3,
         "label '2' is not one of SST-2's labels ['0', '1']"),
        ("cola", "gj04\t1\t\tFine.\ngj04\tyes\t\tFine.\n", 2, "label 'yes' is not one of CoLA's labels"),
        ("stsb", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
         "0\tg\tf\ty\to\ts\ts\tA.\tB.\t5.2\n", 2, "STS-B score '5.2' is not a number in [0, 5]"),
        ("stsb", "sentence1\tsentence2\tscore\nA.\tB.\tnan\n", 2,
         "STS-B score 'nan' is not a number in [0, 5]"),
    ],
)  # fmt: skip
def test_a_label_outside_the_task_s_set_is_refused_with_its_line(tmp_path, task, text, line, needle):
    path = _write(tmp_path, text)
    with pytest.raises(GlueDataError, match=re.escape(f"{path}:{line}: {needle}")):
        read_glue_file(path, glue_task(task))


def test_a_missing_or_empty_file_is_refused(tmp_path):
    with pytest.raises(GlueDataError, match=r"nothing\.tsv: no such file"):
        read_glue_file(str(tmp_path / "nothing.tsv"), glue_task("rte"))
    with pytest.raises(GlueDataError, match="no examples"):
        read_glue_file(_write(tmp_path, "sentence\tlabel\n"), glue_task("sst2"))


def test_windows_line_ends_and_a_limit(tmp_path):
    path = _write(tmp_path, "sentence\tlabel\r\ngood .\t1\r\nbad .\t0\r\nok .\t1\r\n")
    examples = read_glue_file(path, glue_task("sst2"), limit=2)
    assert [(e.texts, e.label, e.line) for e in examples] == [(("good .",), 1, 2), (("bad .",), 0, 3)]


def test_bundled_sst2_test_labels_are_glue_s_test_sentences_with_sst_s_counts():
    """SST-2/test_labelled.tsv: GLUE's 1,821 test sentences in GLUE's order (the unlabelled text of
    data/sst2-text), SST's published label counts (912 negative, 909 positive), read by the reader."""
    import json

    examples = read_glue_file(str(GLUE_DIR / "SST-2" / "test_labelled.tsv"), glue_task("sst2"))
    text_file = GLUE_DIR.parent / "sst2-text" / "sst2_test_sentences.jsonl"
    sentences = [json.loads(line)["text"] for line in text_file.read_text().splitlines()]
    assert [e.texts[0] for e in examples] == sentences
    assert collections.Counter(e.label for e in examples) == {0: 912, 1: 909}


def test_the_sst2_test_label_matcher_matches_exactly_then_by_similarity():
    """experiments/sst2-test-labels/make_labels.py's rule: letters and digits (PTB bracket words
    dropped) first, then the most similar line left, each line once; a sentence with no close
    line is refused."""
    import importlib.util

    path = GLUE_DIR.parents[1] / "experiments" / "sst2-test-labels" / "make_labels.py"
    spec = importlib.util.spec_from_file_location("make_labels", path)
    make_labels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_labels)
    rows = [("the thrill is lrb long rrb gone", 0), ("a witty take on humour", 1), ("fine", 1)]
    labels, ratios = make_labels.match(["a witty take on humor .", "The thrill is ( long ) gone ."], rows)
    assert labels == [1, 0] and len(ratios) == 1 and 0.85 <= ratios[0] < 1
    with pytest.raises(SystemExit, match="no line matches test sentence 1"):
        make_labels.match(["something else entirely"], rows[:1])
