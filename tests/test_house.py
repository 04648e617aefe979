"""The house's sizes (issue 38 §4): no module of xpuctl/ over 500 lines, no function over 60.

A function is counted from its first decorator to its last line, signature included: a typer
command whose options take 40 lines is a long function too (annotated aliases in
`cli/options.py` keep them short). One `/metrics` parser: only `parse/metrics.py` knows the
Prometheus text of vLLM's endpoint.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "xpuctl"
MODULE_LINES = 500
FUNCTION_LINES = 60


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(SRC.parent)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def function_sizes(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((node.name, (node.end_lineno or node.lineno) - first + 1))
    return out


def test_no_function_over_60_lines():
    long = [
        f"{p.relative_to(SRC.parent)}::{name} ({n})"
        for p in sources()
        for name, n in function_sizes(p)
        if n > FUNCTION_LINES
    ]
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"


def test_the_counter_counts():
    """The measure itself: a long function is seen (a test that could not fail is no test)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    tmp = ast.parse(f"@decorator(\n    1)\ndef f():\n{body}\n")
    node = tmp.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert node.end_lineno - min(d.lineno for d in node.decorator_list) + 1 == 73


def test_one_metrics_parser():
    """vLLM's Prometheus text is parsed in parse/metrics.py alone."""
    others = [
        str(p.relative_to(SRC.parent))
        for p in sources()
        if p.name != "metrics.py" and "num_requests_" in p.read_text()
    ]
    assert not others, f"a second /metrics parser: {others}"


def test_one_word_one_meaning_for_the_commands():
    """A command's module is cli/NAME.py; the work behind it has a name of its own
    (`diagnosis` behind doctor, `sweep` behind reset, `runlog` behind logs), so no module
    outside cli/ shares a command's name with it at the package's top."""
    commands = {p.stem for p in (SRC / "cli").glob("*.py")} - {"__init__"}
    clashes = sorted(p.name for p in SRC.glob("*.py") if p.stem in commands)
    assert not clashes, f"modules named like a command's module in cli/: {clashes}"
