"""No dead names in xpuctl/ (issue 32 §4): every property of a record is read somewhere, and
every function and class at a module's top is named somewhere in the package (a decorated one
is registered by its decorator: a command, a check). Found from the source, so a name left
behind when its last reader goes (`Process.is_vllm`, `Fdinfo.is_drm`) fails here.

Re-exports kept for another module (`host/scan.py`'s CLK_TCK) are mypy's: it is strict for
every package (no implicit re-export); comments naming modules that are gone are
tests/test_repo_paths.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "xpuctl"

#: Helpers only tests call, each with the test that does.
FOR_TESTS = {
    "supported": "tests/test_records.py holds RunRecord's annotations to what the reader reads",
    "close_all": "tests/conftest.py ends the readers a test started",
    "markdown": "tests/test_known_issues.py holds docs/known-issues.md equal to the table",
}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def _named(modules: list[tuple[Path, ast.Module]]) -> set[str]:
    """Every name the package reads: as a name, an attribute or an imported name."""
    out: set[str] = set()
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                out.add(node.id)
            elif isinstance(node, ast.Attribute):
                out.add(node.attr)
            elif isinstance(node, ast.alias):
                out.add(node.name.rsplit(".", 1)[-1])
    return out


def _defined_names(tree: ast.Module) -> set[str]:
    """The functions and classes a module defines (not those it only imports)."""
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def test_every_property_is_read():
    modules = _modules()
    read = {node.attr for _, tree in modules for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)}
    unread = [f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.name}"
              for path, tree in modules for node in ast.walk(tree)
              if isinstance(node, ast.FunctionDef)
              and any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
              and node.name not in read]
    assert not unread, "properties nothing reads:\n" + "\n".join(unread)


def test_every_top_level_function_and_class_is_named():
    modules = _modules()
    named = _named(modules)
    unnamed = [f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.name}"
               for path, tree in modules for node in tree.body
               if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.decorator_list
               and not node.name.startswith("__") and node.name not in named
               and node.name not in FOR_TESTS]
    assert not unnamed, "defined, never named in xpuctl/:\n" + "\n".join(unnamed)
    defined = set().union(*(_defined_names(tree) for _, tree in modules))
    assert set(FOR_TESTS) <= defined, "a helper for tests is gone: drop it from FOR_TESTS"
