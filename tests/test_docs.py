"""The README and docs/ point at what is there: the files they name, the modules their examples
import, and a layout that names every module of the project's root and of training/."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


@functools.cache  # one `git ls-files` for every doc
def tracked() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    except OSError as e:  # no git here
        pytest.skip(f"cannot run git: {e}")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return done.stdout.split()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_files_that_are_there(doc: Path) -> None:
    """`train.py`, `training/step.py`, `configs/tiny.toml`: each a file of the project (a bare
    name anywhere in it), not one that moved or went."""
    files = tracked()
    named = set(re.findall(r"`([\w/.-]+\.(?:py|toml|sh|md))`", doc.read_text()))
    missing = [n for n in named if not any(f == n or f.endswith("/" + n) for f in files)]
    assert not missing, f"{doc.name} names files that are not in the project: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_python_examples_import_what_they_say(doc: Path) -> None:
    """A ```python example's imports run as written (the rest may use names it leaves out)."""
    for language, code in FENCE.findall(doc.read_text()):
        if language != "python":
            continue
        imports = [n for n in ast.parse(code).body if isinstance(n, ast.Import | ast.ImportFrom)]
        exec(compile(ast.Module(imports, type_ignores=[]), doc.name, "exec"), {})


def test_readme_model_example_runs() -> None:
    """The README's first example, whole: the variants its comment lists are this CPU's, and the
    model it builds trains on the tokens it makes."""
    code = next(
        c for lang, c in FENCE.findall((ROOT / "README.md").read_text()) if lang == "python"
    )
    listed = re.search(r"available_variants\(.*# (\[.*\])", code)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["available_variants"]("cpu", scope["torch"].float32) == ast.literal_eval(listed[1])
    scope["loss"].backward()
    assert scope["logits"].shape == (2, 16, 2048)


def test_readme_layout_names_every_module() -> None:
    """The README's layout: each entry is there, and each module of the root and of training/
    has an entry (a package's files are indented under its folder's line)."""
    layout = next(
        code for _, code in FENCE.findall((ROOT / "README.md").read_text()) if "model/" in code
    )
    entries, folder = set(), ""
    for line in layout.splitlines():
        match = re.match(r"^(  )?(\S+)\s", line + " ")  # an entry; a description's lines go deeper
        if not match or not re.search(r"\.\w+$|/$", match[2]):
            continue  # not a path
        name = match[2]
        if match[1]:
            entries.add(folder + name)
        else:
            entries.add(name)
            folder = name if name.endswith("/") else ""
    missing = sorted(e for e in entries if not (ROOT / e).exists())
    assert not missing, f"the README's layout names what is not there: {missing}"
    modules = {p.name for p in ROOT.glob("*.py")}
    modules |= {f"training/{p.name}" for p in (ROOT / "training").glob("*.py")} - {
        "training/__init__.py"
    }
    unnamed = sorted(modules - entries)
    assert not unnamed, f"the README's layout does not name {unnamed}"
