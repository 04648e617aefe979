"""vLLM's own text (log lines, a hostile model name in argv) through serve and shutdown.

The fake vLLM appends FAKE_VLLM_LOG_SUFFIX to every log line; the [shutdown] phase lines
reach shutdown's timeline, serve's echo of vLLM's output, and serve's readiness diagnosis.
"""

from __future__ import annotations

import json
import subprocess

import hostile
import pytest
from proctools import free_port
from serverig import XPUCTL, wait_ready

from xpuctl.output.safetext import safe

pytestmark = pytest.mark.slow

# (a CR would split the line: the log tail reads lines as vLLM's progress bars need)
SUFFIX = " \x1b]0;owned\x07\t\x1b[2J[bold]x[/bold] :skull: \udcff\u202e\x9b1m|"
MODEL = "m\x1b[31m[bold]odel\x07"


def _run(rig, *args: str, timeout: float = 90) -> tuple[int, str, str]:
    p = subprocess.run([*XPUCTL, "--root", rig.root.root, *args], env=rig.env(),
                       capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=rig.tmp)
    out = hostile.assert_terminal_safe(p.stdout, f"{args} stdout")
    err = hostile.assert_terminal_safe(p.stderr, f"{args} stderr")
    return p.returncode, out, err


def test_detached_serve_ps_and_shutdown_timeline_escape_vllm_text(rig):
    port = free_port()
    cmd = rig.serve_cmd(port=port, model=MODEL)
    p = subprocess.run(cmd, env=rig.env(FAKE_VLLM_LOG_SUFFIX=SUFFIX), capture_output=True,
                       timeout=90, stdin=subprocess.DEVNULL, cwd=rig.tmp)
    hostile.assert_terminal_safe(p.stdout, "serve stdout")
    err = hostile.assert_terminal_safe(p.stderr, "serve stderr")
    assert p.returncode == 0, err
    name = f"vllm-{port}"
    code, out, _ = _run(rig, "ps")
    assert code == 0 and "m\\x1b[31m[bold]odel\\x07" in out, out
    code, out, _ = _run(rig, "ps", "--json")
    assert any(MODEL in q["argv"] for q in json.loads(out)["processes"])
    code, out, err = _run(rig, "shutdown", name, "--state-dir", rig.state, "--kill-after", "1")
    assert code == 0, out + err
    vllm_lines = [line for line in out.splitlines() if " vllm " in line]
    assert vllm_lines and all(line.endswith(safe(SUFFIX)) for line in vllm_lines), out
    rig.assert_clean()


def test_foreground_serve_echo_and_shutdown_json_keep_exact_text(rig):
    fg = rig.serve_bg(model=MODEL, env={"FAKE_VLLM_LOG_SUFFIX": SUFFIX})
    wait_ready(rig, fg)
    code, out, err = _run(rig, "shutdown", fg.name, "--state-dir", rig.state, "--json",
                          "--kill-after", "1")
    assert code == 0, out + err
    events = json.loads(out)["events"]
    vllm = [e["detail"] for e in events if e["phase"] == "vllm"]
    assert vllm and all(d.endswith(SUFFIX) for d in vllm), vllm  # exact, stray byte included
    assert out.isascii() and "\\udcff" in out
    fg.proc.wait(30)
    echo = hostile.assert_terminal_safe(fg.out_path.read_bytes(), "serve stdout (vLLM's output)")
    hostile.assert_terminal_safe(fg.err_path.read_bytes(), "serve stderr")
    assert safe(SUFFIX) in echo
    rig.assert_clean()


def test_not_ready_diagnosis_escapes_the_log_tail(rig):
    # --detach: the diagnosis quotes vLLM's last lines (in the foreground they are on the
    # terminal already, echoed as they came)
    cmd = rig.serve_cmd(port=free_port(), ready=3, detach=True)
    p = subprocess.run(cmd, env=rig.env(FAKE_VLLM_LOG_SUFFIX=SUFFIX, FAKE_VLLM_FAULTS="hang-startup"),
                       capture_output=True, timeout=90, stdin=subprocess.DEVNULL, cwd=rig.tmp)
    hostile.assert_terminal_safe(p.stdout, "serve stdout")
    err = hostile.assert_terminal_safe(p.stderr, "serve stderr")
    assert p.returncode == 4, err
    tail = [line for line in err.splitlines() if line.startswith("xpuctl:   | ")]
    assert tail and all(line.endswith(safe(SUFFIX)) for line in tail), err
    rig.assert_clean()
