"""The package's layers, checked on its source: DeepSpeed is reached through one adapter, nothing
below ``megaformer/tools`` imports the tools (issue 22), no two packages import each other, and no
package imports another's private names (issue 38).

Read with :mod:`ast` (imports inside functions included, strings and comments not), so a lazy import
that hides a cycle is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("megaformer", "data_tools")
# The adapter; DeepSpeed's checkpoint format (the checkpoint package's); the pipeline module, whose
# classes are DeepSpeed's (LayerSpec, PipelineModule); the tools, which read DeepSpeed's checkpoints.
DEEPSPEED_ALLOWED = (
    "megaformer/training/ds_adapter.py",
    "megaformer/checkpoint/formats.py",  # lists the classes DeepSpeed pickles into its checkpoints
    "megaformer/pipeline/module.py",
    "megaformer/tools/",
    "megaformer/perf/plan.py",  # DeepSpeed's own stage partitioning, so the plan splits as it does
    "megaformer/perf/optrace.py",  # the traced block's activation checkpointing asks deepspeed.comm
)
# DeepSpeed's own attributes on its objects: read or written by the adapter only.
DEEPSPEED_ATTRIBUTES = {
    "ds_pipe_replicated",
    "_INSTRUCTION_MAP",
    "_global_grad_norm",
    "_take_model_step",
    "clip_fp32_gradients",
    "allreduce_gradients",
    "enable_backward_allreduce",
    "_get_optimizer_loss_scale",
    "__compatible_ops__",
}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, relative ones resolved by name only."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
    return found


def _attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of attribute accesses and ``getattr``/``setattr``/``hasattr`` string names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def violations(root: Path) -> list[str]:
    """Every breach of the layering under ``root`` (a checkout), as ``path:line: what``."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            ds_ok = rel.startswith(DEEPSPEED_ALLOWED)
            in_tools = rel.startswith("megaformer/tools/")
            for line, module in _imports(tree):
                if not ds_ok and (module == "deepspeed" or module.startswith("deepspeed.")):
                    out.append(f"{rel}:{line}: imports {module} (go through megaformer.training.ds_adapter)")
                if not in_tools and module.startswith("megaformer.tools"):
                    out.append(f"{rel}:{line}: imports {module} (a layer below the tools imports them)")
            if not rel.startswith("megaformer/training/ds_adapter.py"):
                for line, name in _attributes(tree):
                    if name in DEEPSPEED_ATTRIBUTES:
                        out.append(f"{rel}:{line}: uses DeepSpeed's attribute {name} (the adapter's)")
    return out


def test_deepspeed_is_reached_through_the_adapter_and_tools_sit_on_top():
    assert violations(REPO) == []


@pytest.mark.parametrize(
    ("rel", "source", "needle"),
    [
        (
            "megaformer/model/x.py",
            "def f():\n    from deepspeed.utils import safe_get_full_grad\n",
            "deepspeed.utils",
        ),
        ("megaformer/training/x.py", "import megaformer.tools.reshard\n", "megaformer.tools.reshard"),
        ("data_tools/x.py", "ok = getattr(p, 'ds_pipe_replicated', False)\n", "ds_pipe_replicated"),
    ],
)
def test_the_check_catches_a_breach(tmp_path, rel, source, needle):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(source)
    (tmp_path / "megaformer/tools").mkdir()
    (tmp_path / "megaformer/tools/ok.py").write_text("import deepspeed\nimport megaformer.tools.plan\n")
    found = violations(tmp_path)
    assert len(found) == 1 and rel in found[0] and needle in found[0], found


MAX_FUNCTION_LINES = 80
LENGTH_CHECKED = ("megaformer", "data_tools", "bench", "scripts")


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (and methods) longer than ``limit`` lines, ``def`` to last line, docstring included."""
    out = []
    for folder in LENGTH_CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out.append(
                            f"{path.relative_to(root).as_posix()}:{node.lineno}: {node.name}, {lines} lines"
                        )
    return out


def test_no_function_is_longer_than_80_lines(tmp_path):
    assert long_functions(REPO) == []
    (tmp_path / "megaformer").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (tmp_path / "megaformer" / "long.py").write_text(f"def f():\n{body}")  # 81 lines: caught
    assert long_functions(tmp_path) == ["megaformer/long.py:1: f, 81 lines"]


def package_of(module: str) -> str | None:
    """The package a module belongs to for the layering: ``data_tools``, or ``megaformer.<sub>``
    (``megaformer.training``, ``megaformer.checkpoint``, ...); None outside the project."""
    parts = module.split(".")
    if parts[0] == "data_tools":
        return "data_tools"
    if parts[0] == "megaformer":
        return ".".join(parts[:2])
    return None


def _module_name(root: Path, path: Path) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def package_imports(root: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``(edges, private)``: ``edges[a][b]`` the first ``path:line`` where package ``a`` imports
    package ``b`` (imports inside functions counted); ``private`` every import of another
    package's private name (``from x import _name``), as ``path:line: x._name``."""
    edges: dict[str, dict[str, str]] = {}
    private = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            source = package_of(_module_name(root, path))
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Import):
                    targets = [(alias.name, []) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    targets = [(node.module, [alias.name for alias in node.names])]
                else:
                    continue
                for module, names in targets:
                    target = package_of(module)
                    if target is None or target == source:
                        continue
                    edges.setdefault(source, {}).setdefault(target, f"{rel}:{node.lineno}")
                    private += [f"{rel}:{node.lineno}: {module}.{n}" for n in names if n.startswith("_")]
    return edges, private


def package_cycles(root: Path) -> list[str]:
    """Every import cycle between packages, as ``a -> b -> a`` with where each step is imported."""
    edges, _ = package_imports(root)

    def reaches(start: str, goal: str) -> list[str] | None:
        seen, stack = {start}, [[start]]
        while stack:
            route = stack.pop()
            for nxt in sorted(edges.get(route[-1], {})):
                if nxt == goal:
                    return [*route, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append([*route, nxt])
        return None

    cycles = set()
    for package in sorted(edges):
        route = reaches(package, package)
        if route:
            start = route.index(min(route[:-1]))  # one name per cycle, whichever package it is found from
            route = route[start:-1] + route[:start] + [route[start]]
            steps = [f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(route)]
            cycles.add("; ".join(steps))
    return sorted(cycles)


def test_no_import_cycle_between_packages_and_no_private_name_imported_across():
    assert package_cycles(REPO) == []
    assert package_imports(REPO)[1] == []


# What each lower room may not import (inside functions too): checkpoints sit below training and
# the tools (the trainer and the tools both use them); the performance model below the commands.
BELOW = {
    "megaformer.config": ("*",),  # the config imports nothing else of the project
    "megaformer.checkpoint": ("megaformer.training", "megaformer.tools", "megaformer.experiments"),
    "megaformer.parallel": ("megaformer.training", "megaformer.checkpoint", "megaformer.tools"),
}


def rooms_breached(root: Path) -> list[str]:
    """Every import of a room above by a room below (:data:`BELOW`), as ``below -> above (path:line)``."""
    edges, _ = package_imports(root)
    return [
        f"{low} -> {high} ({where})"
        for low, highs in BELOW.items()
        for high, where in sorted(edges.get(low, {}).items())
        if high in highs or "*" in highs
    ]


def module_cycles(root: Path, package: str) -> list[str]:
    """Import cycles between the modules directly in ``package`` (a folder under ``root``; imports
    inside functions counted), as ``a -> b -> a``."""
    here = root / package.replace(".", "/")
    names = {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        for node in ast.walk(ast.parse((here / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                edges[name] |= {alias.name for alias in node.names if alias.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
                target = node.module[len(package) + 1 :].split(".")[0]
                if target in names:
                    edges[name].add(target)
    found = set()
    for start in sorted(names):
        stack = [[start]]
        while stack:
            route = stack.pop()
            for nxt in sorted(edges[route[-1]]):
                if nxt == start:
                    found.add(" -> ".join([*route, nxt]))
                elif nxt not in route:
                    stack.append([*route, nxt])
    return sorted(found)


def test_the_performance_model_imports_in_one_direction():
    assert module_cycles(REPO, "megaformer.perf") == []


def test_the_module_cycle_check_catches_a_planted_circle(tmp_path):
    (tmp_path / "megaformer/perf").mkdir(parents=True)
    (tmp_path / "megaformer/perf/a.py").write_text("from megaformer.perf.b import x\n")
    (tmp_path / "megaformer/perf/b.py").write_text("def f():\n    from megaformer.perf import a\n")
    assert module_cycles(tmp_path, "megaformer.perf") == ["a -> b -> a", "b -> a -> b"]


def test_the_config_and_checkpoint_packages_import_nothing_above_them():
    assert rooms_breached(REPO) == []


def test_the_rooms_check_catches_a_planted_import(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "megaformer/checkpoint").mkdir()
    (tmp_path / "megaformer/checkpoint/m.py").write_text(
        "def f():\n    from megaformer.training.builders import log\n"
    )
    assert rooms_breached(tmp_path) == [
        "megaformer.checkpoint -> megaformer.training (megaformer/checkpoint/m.py:2)"
    ]


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        (  # a cycle hidden in a function
            {
                "megaformer/checkpoint/a.py": "from megaformer.config import X\n",
                "megaformer/config/b.py": "def f():\n    from megaformer.checkpoint.a import Y\n",
            },
            "megaformer.checkpoint -> megaformer.config (megaformer/checkpoint/a.py:1); "
            "megaformer.config -> megaformer.checkpoint (megaformer/config/b.py:2)",
        ),
        (
            {"megaformer/perf/fakecuda/s.py": "from megaformer.training.trainer import _build_engine\n"},
            "megaformer/perf/fakecuda/s.py:1: megaformer.training.trainer._build_engine",
        ),
    ],
)
def test_the_check_catches_a_cycle_and_a_private_import(tmp_path, files, needle):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    (tmp_path / "megaformer/training").mkdir(exist_ok=True)
    (tmp_path / "megaformer/training/ok.py").write_text("from megaformer.training.trainer import _own\n")
    found = package_cycles(tmp_path) + package_imports(tmp_path)[1]
    assert found == [needle], found


# Packages whose project imports sit at the top of the module, so that the dependency graph reads
# off the first lines; an import inside a function says why in a `# lazy:` comment (start-up time of
# a path that must not import torch, an optional dependency). Not yet: perf/, tools/, experiments/.
TOP_IMPORTS = (
    "config", "parallel", "model", "pipeline", "data", "checkpoint", "training",
    "perf", "perf/fakecuda", "tools", "tools/hf_remote", "experiments",
)  # fmt: skip


def hidden_imports(root: Path, packages: tuple[str, ...] = TOP_IMPORTS) -> list[str]:
    """Every import of a project module inside a function of ``megaformer.<package>`` without a
    ``# lazy:`` comment on its line or in the comment block above, as ``path:line: module``."""
    out = []
    for package in packages:
        for path in sorted((root / "megaformer" / package).glob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            lines = text.splitlines()
            tree = ast.parse(text, filename=rel)
            top = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top:
                    continue
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if not module or not module.startswith(("megaformer", "data_tools")):
                    continue
                said = "# lazy:" in lines[node.lineno - 1]
                above = node.lineno - 2
                while not said and above >= 0 and lines[above].strip().startswith(("#", "from ", "import ")):
                    said = "# lazy:" in lines[above]
                    above -= 1
                if not said:
                    out.append(f"{rel}:{node.lineno}: {module}")
    return out


def test_project_imports_sit_at_the_top_unless_a_comment_says_why():
    assert hidden_imports(REPO) == []


def test_the_top_import_check_catches_a_hidden_import(tmp_path):
    (tmp_path / "megaformer/training").mkdir(parents=True)
    (tmp_path / "megaformer/training/m.py").write_text(
        "import os\n\n\ndef f():\n    from megaformer.config import load_config\n\n\n"
        "def g():\n    # lazy: imports torch\n    from megaformer.model import kernels\n"
    )
    assert hidden_imports(tmp_path, ("training",)) == ["megaformer/training/m.py:5: megaformer.config"]


REPLACED_METHODS = ("forward", "backward", "step")
REACH_IN_ALLOWED = ("megaformer/training/ds_adapter.py",)  # DeepSpeed's privates: the adapter's job


def _reach_in_said(lines: list[str], lineno: int) -> bool:
    """Whether line ``lineno`` (1-based) or the comment block right above it says ``# reach-in:``."""
    if "# reach-in:" in lines[lineno - 1]:
        return True
    above = lineno - 2
    while above >= 0 and lines[above].strip().startswith("#"):
        if "# reach-in:" in lines[above]:
            return True
        above -= 1
    return False


def _reached(node: ast.AST) -> list[tuple[int, str]]:
    """``(line, target)`` of an assignment to another object's private attribute or its
    forward/backward/step (``x._a = ...``, ``x.forward = ...``, ``setattr(x, "_a", ...)``)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found = []
        for target in targets:
            for part in ast.walk(target):
                if not (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)):
                    continue
                own = isinstance(part.value, ast.Name) and part.value.id in ("self", "cls")
                private = part.attr.startswith("_") and not part.attr.startswith("__")
                if (private or part.attr in REPLACED_METHODS) and not own:
                    found.append((node.lineno, ast.unparse(part)))
        return found
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        name = node.args[1] if len(node.args) > 1 else None
        value = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else ""
        if (value.startswith("_") and not value.startswith("__")) or value in REPLACED_METHODS:
            return [(node.lineno, f"setattr(..., {value!r})")]
    return []


def reach_ins(root: Path) -> list[str]:
    """Every unannounced reach-in under ``root``: an assignment to another object's private
    attribute, or replacing its forward/backward/step, outside the DeepSpeed adapter and without a
    ``# reach-in:`` comment saying why (no public door), as ``path:line: target``."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(REACH_IN_ALLOWED):
                continue
            text = path.read_text()
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text, filename=rel)):
                out += [f"{rel}:{n}: {t}" for n, t in _reached(node) if not _reach_in_said(lines, n)]
    return sorted(out)


def test_nothing_replaces_another_objects_private_parts_or_methods_unannounced():
    assert reach_ins(REPO) == []


def test_the_reach_in_check_catches_a_planted_patch(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "megaformer/perf/fakecuda").mkdir(parents=True)
    (tmp_path / "megaformer/perf/fakecuda/s.py").write_text(
        "def f(engine, loop, audit, m, k):\n"
        "    engine.forward = lambda x: x\n"
        "    loop._batches = iter\n"
        "    setattr(m, '_last_lr', [1.0])\n"
        "    audit.step += 1\n"  # a counter, not a replaced method
        "    # reach-in: torch has no public door\n"
        "    k._compiled_call_impl = None\n"
    )
    assert reach_ins(tmp_path) == [
        "megaformer/perf/fakecuda/s.py:2: engine.forward",
        "megaformer/perf/fakecuda/s.py:3: loop._batches",
        "megaformer/perf/fakecuda/s.py:4: setattr(..., '_last_lr')",
    ]
