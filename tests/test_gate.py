"""The gate: .ci/run runs exactly the README's test command, and that command lints and
type-checks before it tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    commands = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0].strip()


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert _readme_test_command() in ci


def test_the_test_command_lints_and_type_checks_before_the_tests():
    cmd = _readme_test_command()
    assert cmd.index("ruff check") < cmd.index("mypy") < cmd.index("pytest")


def test_every_ignored_rule_says_why():
    """Each entry of ruff's ignore list has a comment above it (the reason)."""
    text = (REPO / "pyproject.toml").read_text()
    ignore = re.search(r"^ignore = \[\n(.*?)^\]", text, re.S | re.M)
    assert ignore, "pyproject has no [tool.ruff.lint] ignore list"
    lines = ignore.group(1).splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith('"'):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith(("#", '"')), f"no reason for {line.strip()}"
    assert lines[0].strip().startswith("#")


def test_every_inline_ignore_names_its_code():
    bare = []
    for path in [*REPO.glob("xpuctl/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("bench/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*type:\s*ignore(?!\[)", line) or re.search(r"#\s*noqa(?!:)", line):
                bare.append(f"{path.relative_to(REPO)}:{n}")
    assert not bare, bare
