"""`shutdown --all` asks, like reset (issue 29 §12).

It stops every vLLM server of the host, so it shows its plan and asks "Proceed? [y/N]" on a
terminal; without one it refuses (exit 2, one line) unless --yes; --dry-run lists without
asking; nothing to stop exits 0. At the prompt: "n" exits 1, Ctrl-C 130, end of input 1,
and nothing is signalled; "y" stops. Everything runs in a private PID namespace, where the
only vLLM is ours (`--all` sees every one of the host), on a real terminal (a pty that is
xpuctl's controlling terminal, as in test_prompt_interrupt.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from proctools import pidns_available

PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"

_DRIVER = r"""
import json, os, pty, select, signal, subprocess, sys, time
support, state, token, workdir = sys.argv[1:5]
sys.path.insert(0, support)
from proctools import StandInRoot, is_gone, start_fake_vllm, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
XP = [sys.executable, "-m", "xpuctl", "--root", R, "shutdown", "--state-dir", state]
def run(*args):
    p = subprocess.run(XP + list(args), capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    return {"code": p.returncode, "out": p.stdout, "err": p.stderr}
def at_prompt(keys, *args):
    pid, master = pty.fork()
    if pid == 0:  # xpuctl, its terminal the pty; ^C interrupts as at an operator's terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, XP + ["--all", "--kill-after", "1", *args])
    seen = b""
    deadline = time.monotonic() + 120
    while b"Proceed?" not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    prompted = b"Proceed?" in seen
    time.sleep(0.2)  # at the prompt, reading
    os.write(master, keys.encode("latin-1"))
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last user is gone
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    return {"code": os.waitstatus_to_exitcode(status), "prompted": prompted,
            "output": seen.decode("utf-8", "replace")}
def signals(fv):
    return [e for e in fv.events() if e["event"] == "signal"]
try:
    out["empty"] = run("--all")
    fv = start_fake_vllm(token, R, tp=1, shutdown_timeout=5, workdir=workdir)
    out["ready"] = fv.wait_ready(60)
    out["top"], out["tree"] = fv.pid, fv.tree()
    out["no_tty"] = run("--all")
    out["dry"] = run("--all", "--dry-run")
    out["no"] = at_prompt("n\r")
    out["ctrl_c"] = at_prompt("\x03")
    out["eof"] = at_prompt("\x04")
    time.sleep(0.3)
    out["alive"] = [not is_gone(p) for p in out["tree"]]
    out["signals_before_yes"] = signals(fv)
    out["audit_before_yes"] = os.path.exists(os.path.join(state, "audit.jsonl"))
    out["yes_at_prompt"] = at_prompt("y\r")
    out["gone_after_y"] = wait_for(lambda: all(is_gone(p) for p in out["tree"]), 30)
    fv2 = start_fake_vllm(token, R, tp=1, shutdown_timeout=5, workdir=workdir)
    out["ready2"] = fv2.wait_ready(60)
    out["tree2"] = fv2.tree()
    out["yes"] = run("--all", "--yes", "--kill-after", "1")
    out["gone_after_yes"] = wait_for(lambda: all(is_gone(p) for p in out["tree2"]), 30)
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_shutdown_all_shows_its_plan_and_asks(tmp_path, proc_token):
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), str(tmp_path / "state"), proc_token, str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1 and out["ready"] and out["ready2"], out
    top = out["top"]

    # nothing to stop: exit 0, no question, even without a terminal
    assert out["empty"]["code"] == 0 and "nothing to stop" in out["empty"]["out"], out["empty"]
    # no terminal, no --yes: the plan, then one line and exit 2
    no_tty = out["no_tty"]
    assert no_tty["code"] == 2, no_tty
    refusal = ("xpuctl: error: refusing to stop every server without confirmation: pass --yes "
               "(no terminal to ask)")
    assert no_tty["err"].strip().splitlines() == [refusal], no_tty
    assert f"SIGTERM api-server {top}" in no_tty["out"], no_tty
    # --dry-run: listed, never asked
    assert out["dry"]["code"] == 0 and f"SIGTERM api-server {top}" in out["dry"]["out"]
    assert "Proceed?" not in out["dry"]["out"] + out["dry"]["err"]
    # on a terminal: the plan, then the question; every way out but "y" sends nothing
    for key, code in (("no", 1), ("ctrl_c", 130), ("eof", 1)):
        r = out[key]
        assert r["prompted"] and r["code"] == code, (key, r)
        plan, _, after = r["output"].partition("Proceed?")
        assert f"SIGTERM api-server {top}" in plan, (key, r["output"])
        assert "Traceback" not in after and "SIGTERM" not in after, (key, after)
    assert "xpuctl: interrupted" in out["ctrl_c"]["output"]
    assert out["alive"] == [True] * len(out["tree"]), out
    assert out["signals_before_yes"] == [] and not out["audit_before_yes"], out
    # "y" stops it; --yes stops without asking
    assert out["yes_at_prompt"]["code"] == 0 and out["gone_after_y"], out["yes_at_prompt"]
    assert out["yes"]["code"] == 0 and "Proceed?" not in out["yes"]["out"], out["yes"]
    assert out["gone_after_yes"], out
