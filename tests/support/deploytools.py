"""Helpers for the deploy/ tests: read systemd unit and environment files, expand command
lines the way systemd does, and parse the argv of an xpuctl command with xpuctl's own parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer

from xpuctl.cli import app

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def read_unit(path: Path) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values in order (systemd keys may repeat)."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert not line.endswith("\\"), f"{path}: continuation lines are not expected: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line}"
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path}: bad line {line}"
        env[key] = value
    return env


def expand(command: str, env: dict[str, str], instance: str) -> list[str]:
    """systemd's ExecStart= expansion: `%i` the instance, `${VAR}` one word, `$VAR` split on
    whitespace (an unset variable is empty)."""
    words: list[str] = []
    for word in shlex.split(command.replace("%i", instance)):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            words += env.get(m.group(1), "").split()
            continue
        braced = r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}"
        words.append(re.sub(braced, lambda g: env.get(g.group(1), ""), word))
    return words


def seconds(value: str) -> float:
    """A systemd time span: `90`, `90s`, `2min`, `1h 30s`."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(num) * units[unit]
    return total


def parse_xpuctl(argv: list[str]) -> tuple[str, dict]:
    """Parse `xpuctl [global options] COMMAND ...` with xpuctl's own click command tree (no
    command runs). Returns (command, its parameters); an unknown option raises."""
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("xpuctl", list(argv), resilient_parsing=False)
    protected = getattr(ctx, "protected_args", None) or getattr(ctx, "_protected_args", [])
    words = list(protected) + ctx.args
    name, rest = words[0], words[1:]
    sub = cmd.get_command(ctx, name)
    assert sub is not None, f"unknown command {name}"
    sub_ctx = sub.make_context(name, rest, parent=ctx)
    params = dict(sub_ctx.params)
    params["_extra"] = list(sub_ctx.args)
    return name, params
