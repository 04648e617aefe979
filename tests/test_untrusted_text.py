"""Host text other users control never reaches the operator's terminal raw (issue 13).

Hostile argv, comm, file names, sysfs strings and wchan (tests/support/hostile.py) go through every
read-only command and format on a fake host; real processes with hostile argv and comm go
through them on the live /proc. Every stream must be valid UTF-8 with no control byte but
newline (on a TTY: plus rich's own SGR styling); JSON must carry the exact text.
"""

from __future__ import annotations

import ast
import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import hostile
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proctools import (
    proc_token,  # noqa: F401  (fixture)
    standin_root,  # noqa: F401  (fixture)
    token_env,
)
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.output.safetext import (
    console,
    emit,
    neutral,
    neutral_lines,
    prom_label,
    safe,
)

runner = CliRunner()
PY = sys.executable
SRC = Path(__file__).resolve().parent.parent / "xpuctl"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return hostile.hostile_host(tmp_path_factory.mktemp("hostile"))


def invoke(root, *args: str, env: dict[str, str] | None = None):
    result = runner.invoke(app, ["--root", str(root), *args], env=env or hostile.hostile_env())
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: uncaught {result.exception!r}") from result.exception
    out = hostile.assert_terminal_safe(result.stdout_bytes, f"{args} stdout")
    err = hostile.assert_terminal_safe(result.stderr_bytes, f"{args} stderr")
    assert "Traceback" not in out + err
    assert result.exit_code not in (70,), (args, out, err)
    return result.exit_code, out, err


# --- the function and the sinks --------------------------------------------------------------


def test_safe_shows_every_kind_of_unsafe_text_as_an_escape():
    assert safe(hostile.OSC_CSI) == "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mRED"
    assert safe("a\nb\tc\rd\x00e\x7f\x9b") == "a\\nb\\tc\\rd\\x00e\\x7f\\u009b"
    assert safe("x\udcff\udc80") == "x\\xff\\x80"  # bytes that were not UTF-8
    assert safe(b"\xff\x1b") == "\\xff\\x1b"
    assert safe("\u202eabc\u2066\u2028") == "\\u202eabc\\u2066\\u2028"
    assert safe("café ✓ 日本 [bold]x[/bold]") == "café ✓ 日本 [bold]x[/bold]"  # printable stays
    assert safe(None) == "" and safe(42) == "42"
    assert safe("x" * 50, 10) == "x" * 9 + "…"


def test_escaped_text_is_unambiguous():
    """A string that really holds `\\x1b` never reads like an escaped ESC (issue 17 item 5);
    a C1 character never reads like a byte that was not UTF-8."""
    assert safe("\x1b") == "\\x1b"
    assert safe("\\x1b") == "\\\\x1b"
    assert safe("a\\b") == "a\\\\b" and safe("\\") == "\\\\"
    assert safe("\x9b") == "\\u009b" and safe(b"\x9b") == "\\x9b"
    assert len({safe("\x1b"), safe("\\x1b"), safe("\\\x1b"), safe("\\\\x1b")}) == 4
    # a cut never leaves half an escape (a lone backslash would escape the ellipsis)
    assert safe("\\" * 10, 6) == "\\\\" * 2 + "…"
    assert safe("ab\x1b", 5) == "ab…"
    # the sinks escape controls only: a field that went through `safe` is never doubled
    assert neutral_lines(safe("\\x1b\x1b")) == safe("\\x1b\x1b")
    assert neutral("a\\b\nc\x1b") == "a\\b\\nc\\x1b"

@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=())) | st.binary().map(  # + surrogates
    lambda b: b.decode("utf-8", "surrogateescape")))
def test_safe_output_is_always_printable_and_reads_back_exactly(text):
    out = safe(text, sys.maxsize)
    assert hostile._BAD.search(out) is None
    out.encode("utf-8")  # no surrogate left
    assert unescape(out) == text  # one reading only: a backslash is always an escape
    assert neutral_lines(out) == out  # field, then sink: an escape is never doubled
    cut = safe(text, 8)
    assert len(cut) <= 8 and (cut == out or unescape(cut[:-1]) == text[: len(unescape(cut[:-1]))])


_NAMED_BACK = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(shown: str) -> str:
    """The exact text back from what `safe` showed (the rule in docs/output.md, "JSON output and host text")."""
    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return _NAMED_BACK[m.group(1)]
        code = int(m.group(2) or m.group(3), 16)
        if m.group(2) and code >= 0x80:
            return chr(0xDC00 + code)  # a byte that was not UTF-8
        return chr(code)

    return re.sub(r"\\(?:([ntr\\])|x([0-9a-f]{2})|u([0-9a-f]{4}))", one, shown)


def _prom_unescape(value: str) -> str:
    return re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.text())
def test_prom_label_round_trips_what_the_format_can_carry(text):
    out = prom_label(text)
    assert hostile._BAD.search(out) is None
    assert re.search(r'(?<!\\)(\\\\)*"', out) is None  # no unescaped quote
    # backslash, quote, newline and printable text come back exact; what the format cannot
    # carry comes back as the visible escape `safe` shows
    assert _prom_unescape(out) == neutral_lines(text)


def test_console_escapes_what_skipped_safe_and_reads_no_markup():
    """The safety net: a field printed without `safe` is still escaped, after layout."""
    from rich.table import Table
    from rich.text import Text

    buf = io.StringIO()
    c = console(file=buf, force_terminal=True, color_system="standard", width=100)
    t = Table(title="t")
    t.add_column("raw")
    t.add_row("[bold]x[/bold] :skull: " + hostile.OSC_CSI + "\udcff")
    c.print(t)
    c.print(Text("plain \x1b[2J", style="red"))
    c.print("str [red]markup[/red] \x9b\u202e")
    text = hostile.assert_terminal_safe(buf.getvalue().encode(), "console", tty=True)
    assert "[bold]x[/bold] :skull: \\x1b]0;owned" in text  # (rich itself drops BEL)
    assert "\\xff" in text and "str [red]markup[/red] \\u009b\\u202e" in text
    assert "\x1b[31m" in text  # rich's own styling still reaches the terminal


def test_console_status_line_keeps_riches_controls_and_escapes_its_text():
    buf = io.StringIO()
    c = console(file=buf, force_terminal=True, width=80)
    with c.status("waiting \x1b]0;x\x07 [bold]y") as status:
        time.sleep(0.3)
        status.update("still \x1b[2J waiting")
        time.sleep(0.3)
    out = buf.getvalue()
    assert "\x1b[?25l" in out  # cursor hidden: a control segment of rich's own, kept
    assert "waiting \\x1b]0;x" in out and "[bold]y" in out and "\x1b]0;x" not in out
    assert "still \\x1b[2J waiting" in out and "\x1b[2J" not in out


def test_ps_table_styles_only_its_own_words(host):
    """Header bold, ORPHAN bold red; a hostile row carries no styling at all."""
    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host
    from xpuctl.output import tables

    snap = take_scan(Host(str(host.root)), port=None, artifacts=False)
    buf = io.StringIO()
    console(file=buf, force_terminal=True, width=300).print(
        tables.processes_table(snap, width=300), no_wrap=True, crop=True)
    lines = hostile.assert_terminal_safe(buf.getvalue().encode(), "ps table", tty=True).splitlines()
    orphans = [line for line in lines if "ORPHAN" in line]
    assert orphans and all("\x1b[1;31mORPHAN\x1b[0m" in line for line in orphans)
    assert lines[1].startswith("\x1b[1m PID")
    evil = next(line for line in lines if line.startswith(str(hostile.EVIL_PID)))
    assert "\x1b" not in evil.replace("\\x1b", "") and "[bold]x[/bold]" in evil


def test_emit_escapes_every_line():
    buf = io.StringIO()
    emit(buf, "one \x1b[2J\ntwo \udcff\x07")
    assert buf.getvalue() == "one \\x1b[2J\ntwo \\xff\\x07\n"


def test_no_output_path_bypasses_the_sinks():
    """Human output leaves only through safetext's sinks: no print(), no rich Console of
    its own, no markup parsing, and sys.stdout/stderr.write only for constant text, JSON
    (printable ASCII by construction) and Prometheus text (labels escaped)."""
    allowed_calls = {"to_json", "prometheus", "get_completion_script"}
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "safetext.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("print", "Console", "from_markup", "render_markup") and not (
                name == "print" and isinstance(f, ast.Attribute)  # console.print is the sink
            ):
                problems.append(f"{where}: {name}()")
            if name == "write" and "sys.std" in ast.unparse(f) and node.args:
                arg = node.args[0]
                inner = arg.left if isinstance(arg, ast.BinOp) else arg
                called = inner.func if isinstance(inner, ast.Call) else None
                cname = getattr(called, "attr", getattr(called, "id", None))
                if not isinstance(inner, ast.Constant) and cname not in allowed_calls:
                    problems.append(f"{where}: {ast.unparse(node)[:80]}")
    assert not problems, "host text could bypass safetext here:\n" + "\n".join(problems)


# --- every command and format on a hostile fake host -----------------------------------------

COMMANDS = [
    ("doctor",),
    ("doctor", "--strict"),
    ("doctor", "--json"),
    ("doctor", "--format", "prometheus"),
    ("ps",),
    ("ps", "-a"),
    ("ps", "-a", "--json"),
    ("devices",),
    ("devices", "--json"),
    ("reset", "--dry-run"),
    ("reset", "--dry-run", "--json"),
    ("shutdown", "--all", "--dry-run"),
    ("shutdown", "--all", "--dry-run", "--json"),
    # errors naming what the user or the host gave
    ("doctor", "--device", "\x1b[2J[bold]x\udcff"),
    ("ps", "--device", "9\x1b]0;t\x07"),
    ("shutdown", "--dry-run", "vllm-\x1b[2J"),
    ("serve", "--name", "a\x1b[2J", "m"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a).encode("ascii", "backslashreplace").decode())
def test_every_command_escapes_hostile_host_text(host, args):
    code, out, err = invoke(host.root, *args)
    assert code in (0, 1, 2, 3), (code, out, err)
    if "--json" in args:
        assert out.isascii()
        json.loads(out)
    elif "--device" in args or args[0] == "serve" or args[:2] == ("shutdown", "--dry-run"):
        assert code in (2, 3) and err.startswith("xpuctl: error: ") and err.count("\n") == 1, err
    if args[0] == "devices" and len(args) == 1:
        assert safe(hostile.VENDOR_BYTES.strip()) in out  # the fuzz finding: shown escaped
        assert safe(hostile.DRIVER) in out and safe(hostile.ODD_BDF) in out
    if args[:2] == ("ps", "-a") and len(args) == 2:
        assert "[bold]x[/bold] :skull:" in out  # markup and emoji codes printed literally
        assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mRED" in out
    if args == ("doctor",):
        for shown in (safe(hostile.SHM_NAME), safe(hostile.TMP_NAME), "wait\\x1b[2J[bold]x[/bold]",
                      "ZE_AFFINITY_MASK='0,\\x1b[2J[bold]x[/bold]'"):
            assert shown in out, shown
    if args == ("reset", "--dry-run"):
        assert f"remove {safe(hostile.TMP_NAME)} (" in out
    if args == ("shutdown", "--all", "--dry-run"):
        assert f"would stop pid {hostile.EVIL_API}" in out


def test_bad_root_path_is_escaped_in_the_error():
    result = runner.invoke(app, ["--root", "/nonexistent/\x1b]0;owned\x07\udcff", "ps"])
    err = hostile.assert_terminal_safe(result.stderr_bytes, "stderr")
    assert result.exit_code == 2
    assert err == "xpuctl: error: --root /nonexistent/\\x1b]0;owned\\x07\\xff: not a directory\n"


def test_json_carries_the_exact_host_text(host):
    _, out, _ = invoke(host.root, "doctor", "--json")
    data = json.loads(out)
    procs = {p["pid"]: p for p in data["processes"]}
    evil = procs[hostile.EVIL_PID]
    assert evil["argv"] == hostile.EVIL_ARGV and evil["comm"] == hostile.EVIL_COMM
    assert evil["cmdline"] == " ".join(hostile.EVIL_ARGV)
    # reversible: the bytes that were not UTF-8 come back as they were
    raw = b"\0".join(a.encode("utf-8", "surrogateescape") for a in evil["argv"]) + b"\0"
    assert raw == hostile.EVIL_ARGV_BYTES
    assert hostile.MODEL in procs[hostile.EVIL_API]["argv"]
    assert procs[hostile.EVIL_STUCK]["wchan"] == "wait\x1b[2J" + hostile.MARKUP
    devs = {d["bdf"]: d for d in data["devices"]}
    odd = devs["0000:09:00.0"]
    assert odd["vendor_id"].encode("utf-8", "surrogateescape") == hostile.VENDOR_BYTES.strip()
    assert odd["device_id"].encode("utf-8", "surrogateescape") == hostile.DEVICE_BYTES
    assert odd["driver"] == hostile.DRIVER and hostile.ODD_BDF in devs
    paths = {a["path"] for a in data["artifacts"]}
    assert {hostile.SHM_NAME, hostile.TMP_NAME} <= paths
    mask = hostile.hostile_env()["ZE_AFFINITY_MASK"]  # the exact value, not a repr of it
    assert any(f"ZE_AFFINITY_MASK='{mask}'" in f["message"] for f in data["findings"])
    # every JSON output is printable ASCII: \\u escapes, \\udcXX for stray bytes
    assert out.isascii() and "\\udcff" in out
    _, ps_out, _ = invoke(host.root, "ps", "-a", "--json")
    assert {p["pid"]: p for p in json.loads(ps_out)["processes"]}[hostile.EVIL_PID]["argv"] == hostile.EVIL_ARGV


def test_prometheus_labels_use_the_exposition_escapes(host):
    _, out, _ = invoke(host.root, "doctor", "--format", "prometheus")
    label = prom_label(hostile.ODD_BDF)
    assert label == '0000:0a:00.0\\"\\\\\\\\x1b[2J'
    assert f'xpuctl_device_holder_processes{{device="{label}"}} 0' in out
    # what a parser reads back: the quote and backslash exact, the ESC as a visible escape
    assert _prom_unescape(label) == hostile.ODD_BDF.replace("\x1b", "\\x1b")
    for line in out.splitlines():
        assert re.fullmatch(r'(# (HELP|TYPE) \w+ .+|\w+(\{(\w+="([^"\\]|\\.)*",?)*\})? \S+)', line), line
    # Prometheus' own parser reads the same value back, from stdout and from --textfile
    from prometheus_client.parser import text_string_to_metric_families

    path = host.root.parent / "hostile.prom"
    code, _, _ = invoke(host.root, "doctor", "--textfile", str(path))
    assert code in (0, 1)
    for text in (out, path.read_text()):
        devices = {s.labels["device"] for fam in text_string_to_metric_families(text)
                   for s in fam.samples if "device" in s.labels}
        assert hostile.ODD_BDF.replace("\x1b", "\\x1b") in devices, devices


# --- on a terminal, and through the real streams ---------------------------------------------


def _run_pty(args: list[str], env: dict[str, str], cols: int = 220) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, cols, 0, 0))
    proc = subprocess.Popen([PY, "-m", "xpuctl", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, cwd=SRC.parent)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        code = proc.wait(60)
    return code, b"".join(chunks)


def _tty_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "XPUCTL_ROOT")}
    env.update(hostile.hostile_env(), TERM="xterm-256color")
    return env


@pytest.mark.parametrize("args", [["doctor"], ["ps", "-a"], ["devices"], ["reset", "--dry-run"],
                                  ["doctor", "--device", "\x1b[2J"]], ids=" ".join)
def test_on_a_terminal_only_riches_styling_is_raw(host, args):
    code, data = _run_pty(["--root", str(host.root), *args], _tty_env())
    text = hostile.assert_terminal_safe(data, f"{args} on a pty", tty=True)
    assert code in (0, 1, 2), text
    if args[0] != "reset" and "--device" not in args:
        assert hostile.SGR.search(text), "no styling: not a terminal?"


@pytest.mark.parametrize("lang", ["C", "C.UTF-8"])
def test_real_streams_in_any_locale(host, lang):
    """Python's stdout in a C/UTF-8-mode locale writes a stray surrogate as a raw byte: the
    sinks must have escaped it before (the fuzz finding, `devices` with a garbage vendor)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIO", "XPUCTL_"))}
    env.update(LANG=lang, LC_ALL=lang)
    for args in (["devices"], ["ps", "-a"], ["doctor"], ["doctor", "--json"]):
        p = subprocess.run([PY, "-m", "xpuctl", "--root", str(host.root), *args], env=env,
                           capture_output=True, timeout=120, cwd=SRC.parent)
        hostile.assert_terminal_safe(p.stdout, f"{args} {lang} stdout")
        hostile.assert_terminal_safe(p.stderr, f"{args} {lang} stderr")
        assert p.returncode in (0, 1), p.stderr


# --- real processes with hostile argv and comm ------------------------------------------------

_HOLDER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
with open("/proc/self/comm", "wb") as f:
    f.write(bytes.fromhex(sys.argv[2]))
print("ready", flush=True)
time.sleep(60)
"""


def test_real_process_with_hostile_argv_and_comm(standin_root, proc_token):
    root = standin_root
    comm = b"\x1b[31m\xff[b]x\x07"
    argv = [PY.encode(), b"-c", _HOLDER.encode(), root.node(0).encode(), comm.hex().encode(),
            hostile.OSC_CSI.encode(), hostile.MARKUP.encode(), b"\xff\xfe\x9b", "\u202e\u2028".encode(), b"\t\r\n"]
    shm = Path(root.root, "dev/shm", "torch_" + "\x1b[2J\x07[bold]q\udcff")
    shm.write_bytes(b"x")
    p = subprocess.Popen(argv, env=token_env(proc_token), stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline().strip() == b"ready"
        env = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
        env["COLUMNS"] = "3000"  # the whole command line in the table
        for args in (["doctor"], ["ps", "-a"], ["devices"], ["doctor", "--json"],
                     ["ps", "-a", "--json"], ["doctor", "--format", "prometheus"],
                     ["reset", "--dry-run"]):
            r = subprocess.run([PY, "-m", "xpuctl", "--root", root.root, *args], env=env,
                               capture_output=True, timeout=120, cwd=SRC.parent)
            out = hostile.assert_terminal_safe(r.stdout, f"{args} stdout")
            hostile.assert_terminal_safe(r.stderr, f"{args} stderr")
            assert r.returncode in (0, 1), r.stderr
            if args == ["ps", "-a", "--json"]:
                mine = {q["pid"]: q for q in json.loads(out)["processes"]}[p.pid]
                assert [a.encode("utf-8", "surrogateescape") for a in mine["argv"]] == argv
                assert mine["comm"].encode("utf-8", "surrogateescape") == comm
            if args == ["ps", "-a"]:
                assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mRED [bold]x[/bold] \\xff\\xfe\\x9b" in out
            if args == ["doctor"]:
                assert safe(str(shm)[len(root.root):]) in out
        _, data = _run_pty(["--root", root.root, "ps", "-a"], _tty_env())
        hostile.assert_terminal_safe(data, "ps -a on a pty", tty=True)
    finally:
        p.kill()
        p.wait()
