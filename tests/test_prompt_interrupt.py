"""Ctrl-C at a prompt exits 130 and changes nothing (issue 17 item 2).

reset's "Proceed?" runs on a real terminal (a pty that is xpuctl's controlling terminal, so
^C is the terminal's interrupt, delivered as SIGINT by the line discipline) in a private PID
namespace with real orphans and a stale file. After the ^C: exit 130, one line on stderr,
no signal reached the orphans, the file is still there, the audit log is empty.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from proctools import pidns_available

PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"  # the helpers, for the driver scripts

_DRIVER = r"""
import json, os, pty, select, signal, sys, time
support, state, token, workdir, keys = sys.argv[1:6]
sys.path.insert(0, support)
from proctools import StandInRoot, is_gone, start_fake_vllm, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
try:
    fv = start_fake_vllm(token, R, tp=2, shutdown_timeout=5, workdir=workdir)
    out["ready"] = fv.wait_ready(60)
    tree = fv.tree()
    fv.proc.kill()
    fv.proc.wait()
    out["orphans"] = [p for p in tree if p != fv.pid]
    stale = os.path.join(R, "dev/shm/psm_deadbeef")
    with open(stale, "wb") as fh:
        fh.write(b"x")
    pid, master = pty.fork()
    if pid == 0:  # xpuctl, its terminal the pty
        # as at an operator's terminal: ^C interrupts (a suite started in the background by a
        # non-interactive shell, as CI may be, inherits SIGINT ignored, and exec keeps that)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "xpuctl", "--root", R, "reset",
                                  "--state-dir", state])
    seen = b""
    deadline = time.monotonic() + 120
    while b"Proceed?" not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    out["prompted"] = b"Proceed?" in seen
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
    out["code"] = os.waitstatus_to_exitcode(status)
    out["output"] = seen.decode("utf-8", "replace")
    time.sleep(0.3)
    out["alive"] = [p for p in out["orphans"] if not is_gone(p)]
    out["signals"] = [e for e in fv.events() if e["event"] == "signal"]
    out["stale_there"] = os.path.exists(stale)
    log = os.path.join(state, "audit.jsonl")
    out["audit"] = open(log).read() if os.path.exists(log) else ""
finally:
    root.close()
print(json.dumps(out))
"""




def _at_the_prompt(tmp_path: Path, token: str, keys: str) -> dict:
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), str(tmp_path / "state"), token, str(tmp_path), keys],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1 and out["ready"] and len(out["orphans"]) == 3, out
    assert out["prompted"], out["output"]
    return out


@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_ctrl_c_at_resets_prompt_exits_130_and_changes_nothing(tmp_path, proc_token):
    out = _at_the_prompt(tmp_path, proc_token, "\x03")
    assert out["code"] == 130, out["output"]
    after = out["output"].split("Proceed?", 1)[1]
    assert "xpuctl: interrupted" in after and "Traceback" not in after, after
    assert "removed" not in after and "SIGTERM" not in after, after
    assert sorted(out["alive"]) == sorted(out["orphans"]), out  # nothing stopped
    assert out["signals"] == [], out["signals"]  # not even a signal they ignored
    assert out["stale_there"] and out["audit"] == "", out


@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_answering_no_or_eof_at_the_prompt_changes_nothing_either(tmp_path, proc_token):
    """The other ways out of the prompt: "n" (exit 1, as before) and end of input (^D: the
    operator gave no answer; exit 1 with one line), never 130."""
    for keys in ("n\r", "\x04"):
        sub = tmp_path / f"k{ord(keys[0])}"
        sub.mkdir()
        out = _at_the_prompt(sub, proc_token, keys)
        assert out["code"] == 1, (keys, out["output"])
        assert "Traceback" not in out["output"]
        assert sorted(out["alive"]) == sorted(out["orphans"]) and out["signals"] == []
        assert out["stale_there"] and out["audit"] == ""
