"""One parser (issue 32 §1): xpuctl's options are named only where they are declared, in the
command definitions (the group, `cli/options.py`, one module per command). A list of them
anywhere else is a second parser in disguise: it must be kept in step with the first by
hand (doctor's head start kept four such lists, with a test to catch a new option)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import typer

from xpuctl.cli.group import COMMANDS, app

SRC = Path(__file__).resolve().parent.parent / "xpuctl"


def option_names() -> set[str]:
    """Every option name and flag xpuctl's command line has, as click knows them."""
    group = typer.main.get_command(app)
    params = list(group.params)
    for module, _ in COMMANDS.values():
        params += typer.main.get_command(importlib.import_module(module).app).params
    return {n for p in params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")}


def definitions() -> set[Path]:
    """The modules that declare options: the group, the shared options, the commands."""
    modules = ["xpuctl.cli.group", "xpuctl.cli.options", *(m for m, _ in COMMANDS.values())]
    return {SRC.parent / (m.replace(".", "/") + ".py") for m in modules}


def option_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple, list or set literal made only of option-like strings
    ("-x", "--name"), one of which at least is an option of xpuctl's (a program's argv, with
    its arguments, is not one)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str)
                and e.value.startswith("-") for e in node.elts):
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if names & set(values):
                out.append((node.lineno, values))
    return out


def test_options_are_listed_only_where_they_are_declared():
    names = option_names()
    assert {"--root", "--read-timeout", "--from", "--ray", "--json"} <= names
    allowed = definitions()
    found = [f"{path.relative_to(SRC.parent)}:{line}: {values}"
             for path in sorted(SRC.rglob("*.py")) if path not in allowed
             for line, values in option_lists(ast.parse(path.read_text()), names)]
    assert not found, "option names listed outside the command definitions:\n" + "\n".join(found)


def test_the_checker_sees_a_list_of_options():
    tree = ast.parse('NOT_FIRST = ("--from", "--deep")\nARGV = ["python3", "-c", "pass"]\n')
    assert option_lists(tree, {"--from", "--deep", "-c"}) == [(1, ["--from", "--deep"])]
