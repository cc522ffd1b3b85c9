"""Which lm-evaluation-harness tasks ``zero_shot`` runs, and checks of the files that define them.

``--tasks`` takes what lm_eval's own ``--tasks`` takes: task, group and tag names (``lm_eval ls
tasks``; glob patterns such as ``arc_*``), paths to task YAML files, and a directory (every ``*.yaml``
in it, the directory also searched for the names they refer to, as ``--include_path``).
:func:`resolve_task_specs` sorts them into what :class:`lm_eval.tasks.TaskManager` loads.

Before anything runs, each task YAML and each local data file is read here, so that a wrong file ends
in a :class:`TaskFileError` naming the file, the line and the missing field, not a ``KeyError`` from
inside lm_eval (issue 23 item 4):

- a task YAML (its ``include`` chain merged as lm_eval merges it): valid YAML (else the line of the
  syntax error), a mapping, with ``task`` (or ``group``), ``dataset_path`` and the ``doc_to_*``
  fields its ``output_type`` needs (``multiple_choice``: ``doc_to_text``, ``doc_to_target``,
  ``doc_to_choice``; ``generate_until`` and ``loglikelihood``: ``doc_to_text``, ``doc_to_target``;
  ``loglikelihood_rolling``: ``doc_to_target``);
- its local data (``dataset_path: json`` with ``dataset_kwargs.data_files``): each file present and,
  for JSON lines, each line one JSON object holding every field its templates read (Jinja variables of
  ``doc_to_text`` / ``doc_to_target`` / ``doc_to_choice``, or a bare column name; not checked where
  ``process_docs`` rewrites the records first);
- a paper task's JSON-lines file (``--task NAME=FILE``): every line holds the columns of the hub
  dataset that lm_eval's configuration of the task reads (:data:`PAPER_COLUMNS`).

A field still missing at run time (a ``KeyError`` or Jinja ``UndefinedError`` raised inside lm_eval)
is traced back to the first record without it by :func:`explain_missing_field`.
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Columns each paper task's lm_eval configuration reads from a record (tests/fixtures/zero_shot/SOURCE.md).
PAPER_COLUMNS: dict[str, tuple[str, ...]] = {
    "hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
    "piqa": ("goal", "sol1", "sol2", "label"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
    "storycloze": (
        "input_sentence_1",
        "input_sentence_2",
        "input_sentence_3",
        "input_sentence_4",
        "sentence_quiz1",
        "sentence_quiz2",
        "answer_right_ending",
    ),
    "openbookqa": ("question_stem", "choices", "answerKey"),
}

# The doc_to_* fields lm_eval 0.4 needs per output_type (its ConfigurableTask raises a bare TypeError
# or KeyError without them).
NEEDED_FIELDS: dict[str, tuple[str, ...]] = {
    "multiple_choice": ("doc_to_text", "doc_to_target", "doc_to_choice"),
    "generate_until": ("doc_to_text", "doc_to_target"),
    "loglikelihood": ("doc_to_text", "doc_to_target"),
    "loglikelihood_rolling": ("doc_to_target",),
}
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' builders reading data_files
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TaskFileError(ValueError):
    """A task YAML or data file lm_eval cannot use: the message names the file (with ``:LINE`` where
    a line is at fault), the missing or wrong field, and the fix."""


@dataclass(frozen=True)
class _Function:
    """A ``!function module.name`` value of a task YAML (code; its reads are not checked)."""

    name: str


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    return Loader


def load_task_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A task YAML with its ``include`` chain merged as lm_eval merges it (included files first,
    relative to the including file; the file's own keys win). ``!function`` values load as markers.

    Raises:
        TaskFileError: no such file, a YAML syntax error (with its line), not a mapping, an include
            cycle.
    """
    import yaml

    path = Path(path).expanduser().resolve()
    if not path.is_file():
        via = f" (included from {_seen[-1]})" if _seen else ""
        raise TaskFileError(f"{path}: no such task YAML{via}")
    if path in _seen:
        raise TaskFileError(f"{path}: include cycle ({' -> '.join(map(str, (*_seen, path)))})")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.load(f, Loader=_yaml_loader())  # a SafeLoader with one more tag
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise TaskFileError(f"{path}{line}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise TaskFileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise TaskFileError(
            f"{path}: a task YAML is a mapping (task: NAME, dataset_path: ..., ...), not {type(cfg).__name__}"
        )
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / inc
        merged.update(load_task_yaml(inc_path, (*_seen, path)))
    merged.pop("task_list", None)
    merged.update(cfg)
    return merged


def check_task_yaml(path: str | Path) -> dict:
    """Check one task (or group) YAML and its local data before lm_eval reads them (module docstring).

    Returns:
        The merged configuration (``include`` resolved).

    Raises:
        TaskFileError: what is wrong, naming the file, the line (for syntax and data errors) and the
            field, with the fix.
    """
    path = Path(path).expanduser().resolve()
    cfg = load_task_yaml(path)
    if "class" in cfg:
        return cfg  # a Python task: its code defines what it reads
    if "task" not in cfg and "group" not in cfg:
        raise TaskFileError(
            f"{path}: missing field 'task': a task YAML names its task (task: my_task) or, for a group, "
            f"its group and member tasks (group: my_group, task: [a, b]); it has {sorted(cfg) or 'no fields'}"
        )
    if "group" in cfg:
        if not cfg.get("task"):
            raise TaskFileError(f"{path}: group {cfg['group']!r} has no 'task' field listing its tasks")
        return cfg
    name = cfg["task"]
    if not cfg.get("dataset_path"):
        raise TaskFileError(
            f"{path}: task {name!r} has no field 'dataset_path': name a hub dataset, or read local files "
            "with dataset_path: json and dataset_kwargs: {data_files: {validation: /abs/path.jsonl}}"
        )
    output_type = cfg.get("output_type", "generate_until")
    if output_type not in NEEDED_FIELDS:
        raise TaskFileError(
            f"{path}: task {name!r}: output_type {output_type!r} is not one of {sorted(NEEDED_FIELDS)}"
        )
    if cfg.get("use_prompt") is None:
        for key in NEEDED_FIELDS[output_type]:
            if cfg.get(key) is None:
                raise TaskFileError(
                    f"{path}: task {name!r} (output_type {output_type}) has no field {key!r}; lm_eval needs "
                    f"{', '.join(NEEDED_FIELDS[output_type])} (a Jinja template such as '{{{{question}}}}', "
                    "a column name, or !function module.name)"
                )
    for data_path in _local_data_files(cfg, path):
        check_records(data_path, _template_fields(cfg, data_path), f"task {name!r} ({path})")
    return cfg


def _local_data_files(cfg: dict, yaml_path: Path) -> list[str]:
    """The files of a ``dataset_path: json|csv|...`` task's ``dataset_kwargs.data_files``.

    Raises:
        TaskFileError: a file is missing (says where datasets looks: the working directory).
    """
    if cfg.get("dataset_path") not in LOCAL_LOADERS:
        return []
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if files is None and kwargs.get("data_dir"):
        return []  # datasets finds the files in the directory
    if files is None:
        raise TaskFileError(
            f"{yaml_path}: task {cfg.get('task')!r}: dataset_path {cfg['dataset_path']!r} reads local files; "
            "add dataset_kwargs: {data_files: {validation: /abs/path.jsonl}}"
        )
    values = files.values() if isinstance(files, dict) else [files]
    out: list[str] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            matches = sorted(glob.glob(os.path.expanduser(str(item))))
            if not matches:
                beside = yaml_path.parent / str(item)
                hint = (
                    f"; {beside} exists, but datasets reads data_files relative to the working directory "
                    "(not the YAML's): write the absolute path"
                    if beside.exists()
                    else ""
                )
                raise TaskFileError(
                    f"{yaml_path}: task {cfg.get('task')!r}: data file {item} not found "
                    f"(from {os.getcwd()}){hint}"
                )
            out.extend(matches)
    return out


def _template_fields(cfg: dict, data_path: str) -> tuple[str, ...]:
    """Record fields the task's ``doc_to_text`` / ``doc_to_target`` / ``doc_to_choice`` read: the
    undeclared variables of Jinja templates, and a bare name that is a column of the first record
    (lm_eval reads such a name as the column; as literal text otherwise). None where ``process_docs``
    rewrites the records first, or for code (``!function``)."""
    if cfg.get("process_docs") is not None:
        return ()
    import jinja2
    import jinja2.meta

    env = jinja2.Environment()
    first = _first_record(data_path)
    fields: list[str] = []
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        value = cfg.get(key)
        if not isinstance(value, str):
            continue
        if "{{" in value or "{%" in value:
            try:
                names = jinja2.meta.find_undeclared_variables(env.parse(value))
            except jinja2.TemplateSyntaxError:
                continue  # lm_eval will say; not a field problem
            fields += sorted(n for n in names if n not in env.globals)
        elif _IDENTIFIER.match(value) and first is not None and value in first:
            fields.append(value)
    return tuple(dict.fromkeys(fields))


def _first_record(path: str) -> dict | None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return None
                return record if isinstance(record, dict) else None
    return None


def _is_json_lines(path: str) -> bool:
    """JSON lines (one object a line) rather than one JSON document (an array), which datasets also
    reads from a .json file and which has no per-record lines to check."""
    if not path.endswith((".jsonl", ".json")):
        return False
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 16).lstrip()
    return not head.startswith("[")


def check_records(path: str, fields: Sequence[str], what: str, *, formats: dict | None = None) -> int | None:
    """Every line of a JSON-lines file is a JSON object holding ``fields``.

    Args:
        path: the file (blank lines are skipped; a non-JSON-lines file is not checked).
        fields: the fields each record needs.
        what: the task it serves, for the message (``"hellaswag"``, ``"task 'x' (file.yaml)"``).
        formats: ``{task: fields}`` of other tasks, to say whose records the file holds when it is not
            ``what``'s.

    Returns:
        The number of records checked; None for a file that is not JSON lines (not checked).

    Raises:
        TaskFileError: ``PATH:LINE`` with the missing field (or the JSON error) and the fix.
    """
    if not _is_json_lines(path):
        return None
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(
                    f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno}); each line holds one record "
                    f"of {what} as a JSON object"
                ) from None
            if not isinstance(record, dict):
                raise TaskFileError(
                    f"{path}:{lineno}: a {type(record).__name__}, not a JSON object; each line holds one "
                    f"record of {what} as a JSON object"
                )
            missing = [k for k in fields if k not in record]
            if missing:
                others = [t for t, cols in (formats or {}).items() if all(c in record for c in cols)]
                hint = f" (the fields of {others[0]}: is this {others[0]}'s file?)" if others else ""
                raise TaskFileError(
                    f"{path}:{lineno}: missing field {missing[0]!r}: {what} reads {', '.join(fields)} from "
                    f"each record; this one has {', '.join(record) or 'none'}{hint}"
                )
            n += 1
    return n


def explain_missing_field(error: BaseException, data_files: Iterable[str]) -> TaskFileError | None:
    """A ``KeyError`` or Jinja ``UndefinedError`` lm_eval raised while reading records, traced to the
    first record of ``data_files`` without that field; None when it cannot be traced (then the error
    is not a data file's)."""
    name = None
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], str):
        name = error.args[0]
    elif type(error).__name__ == "UndefinedError":
        m = re.search(r"'([^']+)' is undefined|has no attribute '([^']+)'", str(error))
        name = m and (m.group(1) or m.group(2))
    if not name:
        return None
    for path in data_files:
        if not _is_json_lines(path):
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and name not in record:
                    return TaskFileError(
                        f"{path}:{lineno}: missing field {name!r}, which the task reads (lm_eval: "
                        f"{type(error).__name__}: {error}); this record has {', '.join(record) or 'none'}"
                    )
    return None


@dataclass
class TaskSelection:
    """What ``--tasks`` asked for, sorted for :class:`lm_eval.tasks.TaskManager`.

    Attributes:
        specs: lm_eval task / group / tag names and absolute YAML paths, in the order given.
        include_paths: directories for ``TaskManager(include_path=...)``.
        names: the specs that are names (checked against lm_eval's index by :func:`check_names`).
        data_files: the local data files of the YAML tasks (for :func:`explain_missing_field`).
        needs_defaults: lm_eval's own tasks must be indexed (a name, or a group YAML naming tasks).
    """

    specs: list[str] = field(default_factory=list)
    include_paths: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    data_files: list[str] = field(default_factory=list)
    needs_defaults: bool = False


def resolve_task_specs(specs: Iterable[str], include_paths: Iterable[str] = ()) -> TaskSelection:
    """Sort ``--tasks`` values (each may be comma-separated) into names, YAML files and directories,
    checking every YAML file (:func:`check_task_yaml`).

    A value is a directory if one exists at that path, a YAML file if it ends in ``.yaml`` / ``.yml``
    or names an existing file, else an lm_eval name or glob pattern. A directory runs each ``*.yaml``
    in it that names a task or group (others are templates for ``include``), a group once for its
    members (a member's own file is checked, not run twice), and is searched for the names they use
    (as ``--include_path``). A group YAML is run by its group name, its directory searched for its
    members (lm_eval 0.4.13 cannot load a group by its path).

    Raises:
        TaskFileError: a YAML file or directory that is missing or wrong (see :func:`check_task_yaml`).
    """
    sel = TaskSelection(include_paths=[str(Path(p).expanduser().resolve()) for p in include_paths])
    for p in sel.include_paths:
        if not os.path.isdir(p):
            raise TaskFileError(f"--include-path {p}: not a directory (of lm_eval task YAMLs)")
    for value in specs:
        for spec in (s.strip() for s in value.split(",")):
            if not spec:
                continue
            path = Path(spec).expanduser()
            if path.is_dir():
                files = sorted(glob.glob(str(path.resolve() / "*.yaml")))
                if not files:
                    raise TaskFileError(f"--tasks {spec}: a directory without *.yaml task files")
                # A YAML naming neither task nor group is a template the others include.
                named = [f for f in files if {"task", "group", "class"} & set(load_task_yaml(f))]
                configs = {f: check_task_yaml(f) for f in named}
                members = {m for c in configs.values() if "group" in c for m in _members(c)}
                for f, cfg in configs.items():
                    _add_yaml(sel, f, cfg, run="group" in cfg or cfg.get("task") not in members)
            elif spec.endswith((".yaml", ".yml")) or path.is_file():
                if not path.is_file():
                    raise TaskFileError(f"--tasks {spec}: no such task YAML file")
                _add_yaml(sel, str(path.resolve()), check_task_yaml(path))
            else:
                sel.specs.append(spec)
                sel.names.append(spec)
                sel.needs_defaults = True
    return sel


def _members(cfg: dict) -> list[str]:
    tasks = cfg.get("task")
    return [t for t in (tasks if isinstance(tasks, list) else [tasks]) if isinstance(t, str)]


def _add_yaml(sel: TaskSelection, path: str, cfg: dict, run: bool = True) -> None:
    if "group" in cfg:
        # By name, with its directory searched for the members; its members may be lm_eval's own.
        sel.specs.append(cfg["group"])
        sel.names.append(cfg["group"])
        sel.include_paths.append(str(Path(path).parent))
        sel.needs_defaults = True
        return
    sel.data_files += _local_data_files(cfg, Path(path))
    if run:
        sel.specs.append(path)


def check_names(names: Sequence[str], task_manager) -> list[str]:
    """``names`` expanded where they are glob patterns, each known to ``task_manager``.

    Raises:
        TaskFileError: an unknown name, with the closest known ones.
    """
    out: list[str] = []
    known = task_manager.all_tasks
    for name in names:
        matched = task_manager.match_tasks([name]) if any(c in name for c in "*?[") else []
        if matched:
            out += matched
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            maybe = f" (did you mean {', '.join(close)}?)" if close else ""
            raise TaskFileError(
                f"--tasks {name}: no lm_eval task, group or tag of that name{maybe}; `lm_eval ls tasks` "
                "lists them, a task YAML is given by its path (ending in .yaml), and --include-path DIR "
                "adds a directory of task YAMLs"
            )
        out.append(name)
    return out
