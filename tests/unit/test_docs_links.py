"""The Markdown docs point at things that exist (issue 23: docs by task, links checked by a test).

Checked in README.md, docs/*.md, BENCHMARKS.md and EXPERIMENTS.md:

* every relative link (``[text](path)``, ``![alt](path)``, ``[ref]: path``) names an existing file
  or directory, and a ``#fragment`` into a Markdown file names one of its headings (GitHub's slugs);
  a link that leaves the checkout (``../../shared/...``) is checked where that folder is beside it;
* every page of docs/ is linked from README.md;
* a code path quoted in backticks (``megaformer/training/trainer.py``, ``configs/x.yaml``,
  ``tests/unit/test_x.py::test_y``) exists, and a ``python -m megaformer...`` / ``data_tools...``
  command (or a ``bench/*.py`` script) names a module that exists, with flags its argument parser
  (or a project module it imports) spells out.

Each checker is also run on small broken examples (``tmp_path``), so none can pass by finding nothing.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Top-level folders whose paths, quoted in backticks, must exist.
CODE_DIRS = ("megaformer", "data_tools", "configs", "launch", "scripts", "bench", "tests", "data", "docs")
# Paths the docs name as outputs of a command (not in a clean checkout).
GENERATED = ("data/processed/", "bench/results/gpu_check.json", "bench/results/gpu_check.md")
# Packages whose ``python -m`` commands are checked against their argument parsers.
PACKAGES = ("megaformer", "data_tools")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
# A code span, not across a blank line.
_CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_CODE_PATH = re.compile(rf"(?:{'|'.join(CODE_DIRS)})/[\w.\-/]*")
_MODULE_CMD = re.compile(rf"-m\s+((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
_SCRIPT_CMD = re.compile(r"(?<![\w/])(bench/\w+\.py)")
_FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")


def doc_files(root: Path) -> list[Path]:
    """The Markdown files whose links are checked."""
    named = [root / "README.md", root / "BENCHMARKS.md", root / "EXPERIMENTS.md"]
    return [p for p in named if p.is_file()] + sorted((root / "docs").glob("*.md"))


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def fenced_blocks(text: str) -> Iterator[tuple[int, str]]:
    """``(first line number, text)`` of each fenced code block."""
    block: list[str] | None = None
    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            if block is None:
                block, start = [], number + 1
            else:
                yield start, "\n".join(block)
                block = None
        elif block is not None:
            block.append(line)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, content)`` of the inline code spans outside fenced blocks."""
    lines = text.splitlines()
    prose = dict(prose_lines(text))
    # Blank the fenced lines (keeping the numbering) so a span cannot start inside a block.
    blanked = "\n".join(prose.get(i + 1, "") for i in range(len(lines)))
    for m in _CODE_SPAN.finditer(blanked):
        yield blanked.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every ``#fragment`` that lands in ``path``: its headings' slugs (a repeated one gets ``-1``,
    ``-2``, ... as on GitHub) and explicit ``<a name=...>`` / ``<a id=...>`` anchors."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, target)`` of every link of ``path`` outside code."""
    text = path.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        line = _CODE_SPAN.sub("", line)
        for m in _INLINE_LINK.finditer(line):
            yield number, m.group(1)
        m = _REF_DEF.match(line)
        if m:
            yield number, m.group(1)


def _outside_checkout_absent(dest: Path, root: Path) -> bool:
    """Whether ``dest`` lies outside ``root`` in a folder this machine does not have (such as
    ``../shared`` on a clone without it): then the link cannot be checked here."""
    rel = Path(os.path.relpath(dest, root))
    ups = 0
    while ups < len(rel.parts) and rel.parts[ups] == "..":
        ups += 1
    if ups == 0:
        return False
    return not root.joinpath(*rel.parts[: ups + 1]).exists()


def broken_link(source: Path, target: str, root: Path) -> str | None:
    """Why ``target`` (a link of ``source``) is broken, or None when it is fine or not checkable."""
    if not target or _SCHEME.match(target):
        return None  # http:, https:, mailto:: not checked (no network in the tests)
    path_part, _, fragment = target.partition("#")
    path_part = urllib.parse.unquote(path_part)
    dest = source if path_part == "" else Path(os.path.normpath(source.parent / path_part))
    if not dest.exists():
        if _outside_checkout_absent(dest, root):
            return None
        return f"{target}: no such file or directory"
    if (
        fragment
        and dest.is_file()
        and dest.suffix == ".md"
        and urllib.parse.unquote(fragment) not in anchors(dest)
    ):
        return f"{target}: no heading with the anchor #{fragment} in {dest.name}"
    return None


def broken_links(root: Path, files: Iterable[Path]) -> list[str]:
    """``file:line: target: why`` for every broken relative link of ``files``."""
    out = []
    for path in files:
        for number, target in links(path):
            why = broken_link(path, target, root)
            if why:
                out.append(f"{path.relative_to(root)}:{number}: {why}")
    return out


def unlinked_pages(root: Path) -> list[str]:
    """The pages of ``docs/`` that README.md does not link to."""
    readme = root / "README.md"
    linked = set()
    for _, target in links(readme):
        path_part = urllib.parse.unquote(target.partition("#")[0])
        if path_part and not _SCHEME.match(target):
            linked.add(Path(os.path.normpath(root / path_part)))
    return [str(p.relative_to(root)) for p in sorted((root / "docs").glob("*.md")) if p not in linked]


def missing_code_paths(root: Path, files: Iterable[Path]) -> list[str]:
    """``file:line: path`` for every code path quoted in backticks that does not exist.

    Only a span that is one path (no spaces, placeholders or globs) is taken as one; a pytest node
    id's ``::name`` and a ``:line`` suffix are dropped.
    """
    out = []
    for path in files:
        for number, span in code_spans(path.read_text(encoding="utf-8")):
            candidate = re.sub(r"(::\S*|:\d+)$", "", span)
            if not _CODE_PATH.fullmatch(candidate) or candidate.startswith(GENERATED):
                continue
            if not (root / candidate).exists():
                out.append(f"{path.relative_to(root)}:{number}: {candidate}")
    return out


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parser_text(root: Path, source: Path) -> str:
    """The source of ``source`` and of the project modules it imports (flags may be added there)."""
    text = source.read_text(encoding="utf-8")
    imported = re.findall(rf"^\s*from\s+((?:{'|'.join(PACKAGES)})(?:\.\w+)*)\s+import", text, re.M)
    parts = [text]
    for module in sorted(set(imported)):
        found = _module_file(root, module)
        if found is not None and found != source:
            parts.append(found.read_text(encoding="utf-8"))
    return "\n".join(parts)


def commands(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, command)``: each inline code span and each logical line of a fenced block
    (``\\`` continuations joined), cut at ``|``, ``;``, ``&&`` and comments."""
    pieces: list[tuple[int, str]] = list(code_spans(text))
    for start, block in fenced_blocks(text):
        logical, first = "", start
        for offset, line in enumerate(block.splitlines()):
            if not logical:
                first = start + offset
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            pieces.append((first, logical + line))
            logical = ""
        if logical:
            pieces.append((first, logical))
    for number, piece in pieces:
        for command in re.split(r"\s(?:\||;|&&)\s|\s#\s", piece):
            yield number, command


def bad_commands(root: Path, files: Iterable[Path]) -> list[str]:
    """``file:line: problem`` for a ``python -m`` module of the project that does not exist, and for
    a flag of such a command (or of a ``bench/*.py`` script) that its parser does not spell out."""
    out = []
    for path in files:
        for number, command in commands(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(root)}:{number}"
            m = _MODULE_CMD.search(command)
            if m:
                source = _module_file(root, m.group(1))
                if source is None:
                    out.append(f"{where}: python -m {m.group(1)}: no such module")
                    continue
            else:
                m = _SCRIPT_CMD.search(command)
                if not m:
                    continue
                source = root / m.group(1)
                if not source.is_file():
                    out.append(f"{where}: {m.group(1)}: no such script")
                    continue
            parser = _parser_text(root, source)
            for flag in _FLAG.findall(command[m.end() :]):
                if f'"{flag}"' not in parser and f"'{flag}'" not in parser:
                    out.append(f"{where}: {m.group(1)} {flag}: no such flag in {source.relative_to(root)}")
    return out


# ---------------------------------------------------------------------------------------------
# The project's docs.


def test_every_relative_link_and_anchor_resolves():
    files = doc_files(REPO)
    assert sum(1 for path in files for _ in links(path)) > 50  # the checker reads the links at all
    assert broken_links(REPO, files) == []


def test_every_docs_page_is_linked_from_the_readme():
    assert sorted((REPO / "docs").glob("*.md")), "docs/ has no pages"
    assert unlinked_pages(REPO) == []


def test_code_paths_in_backticks_exist():
    assert missing_code_paths(REPO, doc_files(REPO)) == []


def test_commands_name_existing_modules_and_flags():
    files = doc_files(REPO)
    found = [c for path in files for _, c in commands(path.read_text(encoding="utf-8"))]
    assert sum(1 for c in found if _MODULE_CMD.search(c)) > 30  # the checker finds the commands at all
    assert bad_commands(REPO, files) == []


def test_the_readme_keeps_the_test_command_ci_runs():
    # CI and the README's "two commands" are one: `bash scripts/check.sh` (scripts/check.sh's header).
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "```bash\nbash scripts/check.sh\n```" in readme
    assert "```bash\nbash scripts/quickstart.sh\n```" in readme


# ---------------------------------------------------------------------------------------------
# The checkers themselves, on small broken examples.


@pytest.fixture()
def tiny_repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "megaformer" / "tools").mkdir(parents=True)
    (tmp_path / "megaformer" / "tools" / "plot.py").write_text(
        'p.add_argument("--output-dir")\nfrom megaformer.tools.common import x\n'
    )
    (tmp_path / "megaformer" / "tools" / "common.py").write_text('p.add_argument("--step")\n')
    (tmp_path / "docs" / "train.md").write_text(
        "# Train\n\n## Resume `auto` and extend\n\n## Resume `auto` and extend\n\n"
        "```bash\n# Not a heading\n```\n\n[up](../README.md#where-to-go-next)\n"
    )
    (tmp_path / "docs" / "orphan.md").write_text("# Not linked from the README\n")
    (tmp_path / "README.md").write_text(
        "# Project\n\n## Where to go next\n\n"
        "- [train](docs/train.md), [resume](docs/train.md#resume-auto-and-extend), "
        "[again](docs/train.md#resume-auto-and-extend-1)\n"
        "- [gone](docs/missing.md) and [bad anchor](docs/train.md#not-a-heading)\n"
        "- [self](#where-to-go-next), [bad self](#nowhere), [web](https://example.org/x.md)\n"
        "- `[in code](docs/ignored.md)` and [shared](../../nowhere-beside/x.md)\n"
        "\n[ref]: docs/also-missing.md\n\n"
        "Paths: `megaformer/tools/plot.py`, `megaformer/tools/gone.py`, `configs/missing.yaml`,\n"
        "`tests/unit/test_x.py::test_y`, `megaformer/tools/*.py`, `data/processed/`, `RUN/checkpoints`.\n\n"
        "```bash\npython -m megaformer.tools.plot RUN --output-dir D \\\n    --step 3 --no-such-flag\n"
        "python -m megaformer.tools.nothing --x\n```\n"
    )
    return tmp_path


def test_the_link_checker_finds_missing_files_and_anchors(tiny_repo: Path):
    found = broken_links(tiny_repo, doc_files(tiny_repo))
    assert found == [
        "README.md:6: docs/missing.md: no such file or directory",
        "README.md:6: docs/train.md#not-a-heading: no heading with the anchor #not-a-heading in train.md",
        "README.md:7: #nowhere: no heading with the anchor #nowhere in README.md",
        "README.md:10: docs/also-missing.md: no such file or directory",
    ]


def test_a_link_outside_the_checkout_is_checked_where_its_folder_exists(tmp_path: Path):
    root = tmp_path / "main"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "shared" / "docs").mkdir(parents=True)
    (tmp_path / "shared" / "docs" / "ARCHITECTURE.md").write_text("# Notes\n")
    page = root / "docs" / "architecture.md"
    assert broken_link(page, "../../shared/docs/ARCHITECTURE.md#notes", root) is None
    assert broken_link(page, "../../shared/docs/GONE.md", root) is not None
    assert broken_link(page, "../../elsewhere/docs/X.md", root) is None  # no ../elsewhere: not checkable


def test_github_slugs():
    assert github_slug("Run directories and `summary.json`") == "run-directories-and-summaryjson"
    assert github_slug("GPUs: planner, dry run, fake CUDA") == "gpus-planner-dry-run-fake-cuda"
    assert github_slug("The paper's setup, switchable and named") == "the-papers-setup-switchable-and-named"
    assert github_slug("Reading a dataset (`.bin/.idx`)") == "reading-a-dataset-binidx"
    assert github_slug("Issue 18: every shipped layout (no GPU)") == "issue-18-every-shipped-layout-no-gpu"
    assert github_slug("Fig. 3: FC2 gradient norm × layer") == "fig-3-fc2-gradient-norm--layer"


def test_an_unlinked_docs_page_is_reported(tiny_repo: Path):
    assert unlinked_pages(tiny_repo) == ["docs/orphan.md"]


def test_missing_code_paths_are_reported_and_placeholders_are_not(tiny_repo: Path):
    assert missing_code_paths(tiny_repo, [tiny_repo / "README.md"]) == [
        "README.md:12: megaformer/tools/gone.py",
        "README.md:12: configs/missing.yaml",
        "README.md:13: tests/unit/test_x.py",
    ]


def test_unknown_modules_and_flags_are_reported(tiny_repo: Path):
    # --step is added by a module plot.py imports: found there.
    assert bad_commands(tiny_repo, [tiny_repo / "README.md"]) == [
        "README.md:16: megaformer.tools.plot --no-such-flag: no such flag in megaformer/tools/plot.py",
        "README.md:18: python -m megaformer.tools.nothing: no such module",
    ]
