"""One exit table (issue 32 §3): every code is a member of `errors.ExitCode`, one function
(`errors.exit_code`) maps what ends a command to its code, and the docs' tables are the
enum's. README's table and `xpuctl --help`'s epilog: tests/test_watch.py
(test_exit_codes_are_one_table)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer
from typer._click import exceptions as click_errors

from xpuctl.errors import (
    ExitCode,
    LockedError,
    NotFoundError,
    OutputLost,
    RayError,
    UsageError,
    XpuctlError,
    exit_code,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("end", "code"), [
    (SystemExit(), 0),
    (SystemExit(None), 0),
    (SystemExit(4), 4),
    (SystemExit(137), 137),  # serve passes vLLM's own code on
    (SystemExit(ExitCode.LOCKED), 5),
    (SystemExit("xpuctl: text"), 1),  # sys.exit("text"): the interpreter prints it, exits 1
    (XpuctlError("x"), 1),
    (XpuctlError("x", ExitCode.NOT_READY), 4),
    (UsageError("x"), 2),
    (NotFoundError("x"), 3),
    (LockedError("x"), 5),
    (RayError("x"), 6),
    (KeyboardInterrupt(), 130),
    (BrokenPipeError(), 1),  # `xpuctl ps | head`
    (OutputLost("flush"), 1),
    (EOFError(), 1),  # no answer at a prompt
    (typer.Exit(3), 3),
    (click_errors.UsageError("no such option"), 2),
    (RuntimeError("a bug"), 70),
    (ValueError("a bug"), 70),
    (OSError(5, "EIO"), 70),
])
def test_every_end_of_a_command_has_its_code_from_one_mapping(end, code):
    assert exit_code(end) == code


def test_every_code_it_gives_is_in_the_table():
    """The codes xpuctl decides itself are all ExitCode members (70 included)."""
    assert {exit_code(e) for e in (XpuctlError("x"), UsageError("x"), KeyboardInterrupt(),
                                   BrokenPipeError(), RuntimeError())} <= set(ExitCode)
    assert ExitCode.INTERNAL == 70


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "attr", None) == name or getattr(n.func, "id", None) == name)]


@pytest.mark.parametrize("module", ["xpuctl/cli/guard.py", "xpuctl/cli/__init__.py"])
def test_the_guard_and_the_exit_decide_no_code_themselves(module):
    """cli/guard.py (errors inside and around a command) and cli.leave (the process's exit)
    ask `errors.exit_code`: neither names a code nor writes a number as an exit status."""
    tree = ast.parse((REPO / module).read_text())
    assert not [n.lineno for n in ast.walk(tree)
                if isinstance(n, ast.Name) and n.id == "ExitCode"], "a code named here"
    assert _calls(tree, "exit_code"), "the one mapping is not asked"
    for call in _calls(tree, "Exit") + _calls(tree, "_exit") + _calls(tree, "fail"):
        status = call.args[-1] if call.args else None
        assert not isinstance(status, ast.Constant), f"{module}:{call.lineno}: a number"
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in ("group_exit_code", "leave"):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Assign | ast.Return)
                        and isinstance(node.value, ast.Constant)):
                    assert not isinstance(node.value.value, int), f"{module}:{node.lineno}"


def test_serve_exits_table_names_each_code_as_the_enum_does():
    """docs/serve-exits.md's table of how a run ends: each exit is `CODE NAME` as in
    errors.ExitCode (or N, vLLM's own code passed on)."""
    text = (REPO / "docs" / "serve-exits.md").read_text()
    table = text.split("## The table", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [r.rstrip(" |").rsplit("|", 1)[1].strip() for r in rows[1:]]
    assert len(cells) >= 7, cells
    named = set()
    for cell in cells:
        if cell.startswith("N,"):
            continue
        m = re.fullmatch(r"(\d+) `([A-Z_]+)`", cell)
        assert m, f"not `CODE NAME`: {cell!r}"
        assert ExitCode(int(m.group(1))).name == m.group(2), cell
        named.add(ExitCode(int(m.group(1))))
    assert {ExitCode.OK, ExitCode.PROBLEMS, ExitCode.NOT_READY, ExitCode.UNHEALTHY} <= named


@pytest.mark.parametrize(("end", "closed", "status", "said"), [
    ("SystemExit(None)", False, 0, ""),
    ("SystemExit(3)", False, 3, ""),
    ("SystemExit('xpuctl: said on the way out')", False, 1, "xpuctl: said on the way out"),
    ("SystemExit(0)", True, 1, ""),  # stdout's reader went away: the output is lost
    ("SystemExit(4)", True, 4, ""),  # a failing code stays
])
def test_leave_exits_with_the_mappings_status(end, closed, status, said):
    """cli.leave, the process's exit without the interpreter's teardown: its status is the
    one mapping's, output it can no longer write included."""
    import os
    import subprocess
    import sys

    code = f"import sys; from xpuctl.cli import leave; sys.stdout.write('x'); leave({end})"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # kept until leave
    r, w = os.pipe()
    if closed:
        os.close(r)
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=REPO, env=env)
    finally:
        os.close(w)
        if not closed:
            os.close(r)
    assert done.returncode == status, done.stderr
    assert done.stderr.strip() == said
