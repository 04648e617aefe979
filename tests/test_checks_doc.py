"""docs/checks.md against the registry of finding ids (issue 32 §6): its table names every
check id doctor can report, in `CHECKS` order, none that is unknown, each with the
severities its code can give. The severities are read from the code itself: the severity
words in each check function and in the functions of its module that it calls."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

from xpuctl.core.checks import CHECKS, REGISTRY

DOC = Path(__file__).resolve().parent.parent / "docs" / "checks.md"
SEVERITIES = ("fail", "warn", "info")


def documented() -> dict[str, set[str]]:
    """id -> severities, from the table's rows (`| \\`id\\` | severities |`), in order."""
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (.+) \|$", DOC.read_text(), re.M)
    return {check: set(re.findall(r"\b(fail|warn|info)\b", cell)) for check, cell in rows}


def table_ids() -> list[str]:
    return re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), re.M)


def severities(check_id: str) -> set[str]:
    """The severity words the check's function, and the module's functions it calls, hold."""
    fn = REGISTRY[check_id]
    tree = ast.parse(inspect.getsource(sys.modules[fn.__module__]))
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    seen: set[str] = set()
    found: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in defs:
            return
        seen.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Constant) and node.value in SEVERITIES:
                found.add(node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                visit(node.func.id)

    visit(fn.__name__)
    return found


def test_the_table_names_every_check_id_in_order_and_no_other():
    assert set(CHECKS) == set(REGISTRY)  # every registered check has its place
    assert table_ids() == list(CHECKS)


def test_each_id_is_documented_with_the_severities_its_code_gives():
    doc = documented()
    wrong = {c: (sorted(doc.get(c, ())), sorted(severities(c))) for c in CHECKS
             if doc.get(c) != severities(c)}
    assert not wrong, wrong  # id: (documented, in the code)


def test_every_check_says_at_least_one_severity():
    assert all(severities(c) for c in CHECKS)
