"""Help and plain output: defaults shown, whole sentences, one way to complete, no padding."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys

import fakehost
import pytest
import typer
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.cli.group import COMMANDS

runner = CliRunner()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True, text=True,
                          env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"}, timeout=60)


def test_the_command_list_line_is_the_commands_own_first_line():
    """cli/group.py's table shows each command without loading it: it must say what the
    command's own docstring says."""
    for name, (module, line) in COMMANDS.items():
        mod = importlib.import_module(module)
        fn = next(c.callback for c in mod.app.registered_commands)
        first = inspect.getdoc(fn).split("\n\n")[0]
        assert " ".join(first.split()) == line, name


def test_command_list_sentences_are_whole():
    out = run("--help").stdout
    listed = " ".join(out.split("Commands:")[1].split())
    for name, (_, line) in COMMANDS.items():
        assert f"{name} {line}" in listed, name
    assert "..." not in out.split("Commands:")[1]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_defaults_are_visible_and_no_markup_is_left_over(name):
    out = run(name, "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    cmd = typer.main.get_command(app).get_command(None, name)
    for p in cmd.params:
        if p.param_type_name != "option" or p.is_flag or p.hidden:
            continue
        if p.default is not None and p.show_default is not False:
            assert "default:" in text, (name, p.name)
    # what vanished markup used to leave: "locks ." and "check ." (a space before the end)
    assert not re.search(r" \.(\s|$)| \]|\[\]", text), text


def test_state_dir_default_is_shown():
    text = " ".join(run("doctor", "--help").stdout.split())
    assert "/run/xpuctl as root" in text and "XPUCTL_STATE_DIR" in text


def test_one_way_to_install_completions():
    out = run("--help").stdout
    assert "--install-completion" not in out and "--show-completion" not in out
    assert "completion" in out


def test_plain_doctor_output_has_no_trailing_spaces(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor"], env={"COLUMNS": "120"})
    assert res.exit_code == 1, res.stderr
    lines = res.stdout.splitlines()
    assert any("FAIL" in line for line in lines)
    padded = [line for line in lines if line != line.rstrip()]
    assert not padded, padded


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["doctor", "--help"]])
def test_start_up_loads_only_what_it_uses(args):
    """Lazy loading is live: --version and --help load no command, a command's --help only
    its own module, and none of them loads rich or a command's core."""
    code = (  # printed by an exit handler: the CLI leaves through os._exit (cli.leave)
        "import atexit, sys, runpy\n"
        "atexit.register(lambda: print(' '.join(sorted(m for m in sys.modules "
        "if m.startswith(('xpuctl', 'rich')))), file=sys.stderr))\n"
        f"sys.argv = ['xpuctl', *{args!r}]\n"
        "runpy.run_module('xpuctl', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    loaded = set(out.stderr.split())
    assert "xpuctl.cli.group" in loaded, out.stderr
    commands = {m for m in loaded if m.startswith("xpuctl.cli.") and m not in
                ("xpuctl.cli.group", "xpuctl.cli.guard", "xpuctl.cli.paramtypes")}
    assert commands == ({"xpuctl.cli.doctor", "xpuctl.cli.options", "xpuctl.cli.context"} & commands
                        if args[0] == "doctor" else set()), commands
    if args[0] == "doctor":
        assert "xpuctl.cli.doctor" in commands
    assert not any(m.startswith("rich") for m in loaded), loaded
    assert not any(m.startswith(("xpuctl.host.scan", "xpuctl.diagnosis", "xpuctl.core.checks")) for m in loaded), loaded


def test_json_help_says_how_it_meets_format(tmp_path):
    """doctor's --json is --format json: both may be given when they agree, a disagreement is
    a usage error (issue 32 §6); a command without --format does not name it."""
    doctor = " ".join(run("doctor", "--help").stdout.split())
    said = ("--json The same as --format json. Both may be given when they agree; --json with "
            "another --format is a usage error (exit 2).")
    assert said in doctor
    for name in ("ps", "devices", "shutdown", "reset", "health"):
        assert "--format" not in run(name, "--help").stdout, name
    root = tmp_path / "root"
    fakehost.clean_host(root)
    assert run("--root", str(root), "doctor", "--json", "--format", "json").returncode == 0
    refused = run("--root", str(root), "doctor", "--json", "--format", "table")
    assert refused.returncode == 2 and "--json and --format disagree" in refused.stderr
