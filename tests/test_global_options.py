"""The group's options in either place (issue 32 §6): `xpuctl doctor --root X`, `xpuctl ps
--debug`, `xpuctl doctor --read-timeout 3` are `xpuctl --root X doctor` and so on, as kubectl
takes its global flags. The options moved are the group's own params (Group.globals_first);
after the command a value is never read as an option, `--` ends the options, a command's own
option of the same name is the command's, and after serve's MODEL everything is vLLM's.
Fake hosts: tests/support/fakehost.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fakehost as fh
import pytest
import typer

from xpuctl.cli.group import app

XPUCTL = [sys.executable, "-m", "xpuctl"]


def run(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("XPUCTL_ROOT", "XPUCTL_DEBUG")}
    return subprocess.run([*XPUCTL, *args], capture_output=True, text=True, timeout=120,
                          env={**full, **(env or {})}, stdin=subprocess.DEVNULL, cwd=cwd)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("host")
    fh.orphan_host(r)
    return str(r)


def _doc(res: subprocess.CompletedProcess) -> dict:
    """What doctor found (ages and times aside: they move between two runs)."""
    doc = json.loads(res.stdout)
    return {"root": doc["root"], "status": doc["status"], "devices": doc["devices"],
            "findings": [(f["check"], f["severity"]) for f in doc["findings"]]}


def test_root_and_read_timeout_after_the_command(root):
    before = run("--root", root, "--read-timeout", "3", "doctor", "--json")
    for args in (("doctor", "--root", root, "--read-timeout", "3", "--json"),
                 ("doctor", "--json", f"--root={root}", "--read-timeout=3"),
                 ("--read-timeout", "3", "doctor", "-d", "0,1", "--root", root, "--json")):
        after = run(*args)
        assert after.returncode == before.returncode == 1, after.stderr
        doc = _doc(after)
        assert doc["root"] == root, args
        if "-d" not in args:
            assert doc == _doc(before), args


def test_debug_after_the_command(root):
    res = run("ps", "--debug", "--root", root)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("vLLM processes"), res.stdout


def test_a_value_is_not_an_option_and_a_missing_one_is_said(root, tmp_path):
    # a value of the command's option may look like an option name of the group's
    res = run("ps", "--root", root, "--state-dir", "--debug", cwd=tmp_path)
    assert "no such option" not in res.stderr
    missing = run("doctor", "--root")
    assert missing.returncode == 2
    assert missing.stderr == "xpuctl: error: option '--root' requires an argument\n"


def _moved(args: list[str]) -> list[str]:
    group = typer.main.get_command(app)
    ctx = group.make_context("xpuctl", ["ps"])
    return group.globals_first(ctx, args)


def test_what_is_moved_and_what_is_left():
    # serve: before MODEL the group's, after it vLLM's (its own --debug, its own --root)
    assert _moved(["serve", "--root", "/r", "--name", "a", "m", "--debug", "--root", "/v"]) == [
        "--root", "/r", "serve", "--name", "a", "m", "--debug", "--root", "/v"]
    # a command's option's value is skipped, even one spelled like a global option
    assert _moved(["logs", "-n", "5", "--state-dir", "--debug", "x", "--debug"]) == [
        "--debug", "logs", "-n", "5", "--state-dir", "--debug", "x"]
    # `--` ends the options
    assert _moved(["logs", "--debug", "--", "--root", "/x"]) == [
        "--debug", "logs", "--", "--root", "/x"]
    # no command, or an unknown option first: left for click to judge
    assert _moved(["--root", "/r"]) == ["--root", "/r"]
    assert _moved(["--bogus", "doctor", "--debug"]) == ["--bogus", "doctor", "--debug"]
    assert _moved(["nope", "--debug"]) == ["nope", "--debug"]


def test_a_commands_own_option_of_the_same_name_wins(monkeypatch):
    """No command has one today; one that did would keep it."""
    group = typer.main.get_command(app)
    mine = typer.Typer()

    @mine.command()
    def own(debug: bool = typer.Option(False, "--debug"), root: str = typer.Option("", "--root")):
        pass

    monkeypatch.setattr(type(group), "get_command",
                        lambda self, ctx, name: typer.main.get_command(mine))
    ctx = group.make_context("xpuctl", ["ps"])
    assert group.globals_first(ctx, ["own", "--debug", "--root", "x", "--read-timeout", "2"]) == [
        "--read-timeout", "2", "own", "--debug", "--root", "x"]


def test_completion_reads_a_root_given_after_the_command(tmp_path):
    h = fh.clean_host(tmp_path / "root")
    base = {"_XPUCTL_COMPLETE": "complete_bash"}
    out = run(env={**base, "COMP_WORDS": f"xpuctl doctor --root {h.root} --device 0000:04",
                   "COMP_CWORD": "5"})
    assert out.stdout.split() == ["0000:04:00.0"], out.stderr
    out = run(env={**base, "COMP_WORDS": f"xpuctl ps --root {h.root} --", "COMP_CWORD": "4"})
    assert "--all" in out.stdout.split(), out.stderr


@pytest.mark.parametrize("argv, traced", [
    (["serve", "/models/m", "--port", "8000", "--debug"], False),  # vLLM's --debug
    (["serve", "/models/m", "--", "--debug"], False),
    (["serve", "--debug", "/models/m", "--port", "8000"], True),  # before MODEL: xpuctl's
    (["--debug", "serve", "/models/m"], True),
])
def test_debug_after_serves_model_is_vllms_not_xpuctls(tmp_path, monkeypatch, argv, traced):
    """Issue 38 §6: `--debug` counts only where it is xpuctl's (before the command's arguments
    end). An internal error in serve is one line and exit 70 when --debug follows MODEL (it is
    passed on to vLLM), a traceback when it is serve's own. sys.argv is the command line, as
    it is for the installed entry point."""
    from typer.testing import CliRunner

    import xpuctl.serve.start

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(xpuctl.serve.start, "serve", boom)
    monkeypatch.setattr(sys, "argv", ["xpuctl", *argv])
    monkeypatch.delenv("XPUCTL_DEBUG", raising=False)
    monkeypatch.setenv("XPUCTL_STATE_DIR", str(tmp_path / "state"))
    res = CliRunner().invoke(app, argv)
    if traced:
        assert isinstance(res.exception, RuntimeError), res.output
    else:
        assert res.exit_code == 70, (res.exit_code, res.output, res.exception)
        assert "internal error: RuntimeError: kaboom (run with --debug" in res.stderr
