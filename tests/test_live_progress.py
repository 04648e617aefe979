"""Live progress while a stop or the collective check waits (issue 32 §5).

A flow tells what it waits for through a callback (`core.waits.Wait`: the stop ladder's
drain, teardown, escalation and release; the collective check's ranks); the command draws it
on stderr (output/progress.py): on a terminal one countdown line redrawn in place
(`\\r` + erase line, as serve's start status), elsewhere one plain line per phase. JSON on
stdout is never mixed with it. The terminal is a real pty (`os.openpty`); the stop is the
fake vLLM's (tests/fake_vllm/vllm: FAKE_VLLM_TEARDOWN_S makes its workers' teardown last),
the collective check the stand-in ranks' (tests/standins/collective: a card that hangs in
`init`).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import fakehost as fh
from proctools import free_port, read_pty

CLEAR = "\r\x1b[2K"
STANDINS = Path(__file__).parent / "standins" / "collective"
XPUCTL = [sys.executable, "-m", "xpuctl"]


def run_on_pty(cmd: list[str], env: dict[str, str], cwd: Path, popens: list,
               stdout: int | None = None, timeout: float = 120) -> tuple[int, str]:
    """`cmd` with stderr (and stdout, unless given) on a new pty: (exit code, what the
    terminal got)."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(cmd, env={**env, "COLUMNS": "80"}, stdin=subprocess.DEVNULL,
                                stdout=slave if stdout is None else stdout, stderr=slave,
                                cwd=cwd, start_new_session=True)
        popens.append(proc)
    finally:
        os.close(slave)
    out = read_pty(master)
    return proc.wait(timeout), out


def countdowns(out: str, lead: str) -> list[int]:
    """The seconds left of each countdown frame starting with `lead`, as drawn."""
    frames = [f.split("\r")[0].split("\n")[0] for f in out.split(CLEAR)]
    return [int(m.group(1)) for f in frames if f.startswith(lead)
            for m in [re.search(r", (\d+) s left$", f)] if m]


# -- the views, on their own ------------------------------------------------------------------


def test_a_countdown_on_a_terminal_is_redrawn_in_place_and_counts_down():
    from xpuctl.core import waits
    from xpuctl.core.waits import Wait
    from xpuctl.output import progress

    master, slave = os.openpty()
    err = os.fdopen(slave, "w")
    out = io.StringIO()
    view = progress.countdown(err)
    try:
        view.wait(Wait(waits.DRAIN, "vllm-8000", time.monotonic() + 3.6, 4, 3))
        time.sleep(0.5)
        view.above(out, "   0.50s  in-flight          3 request(s) running or waiting on :8000")
        time.sleep(1.2)  # the countdown moves by itself: no event came
        view.wait(Wait(waits.TEARDOWN, "vllm-8000", time.monotonic() + 8, 3))
        time.sleep(0.3)
        view.wait(None)
    finally:
        view.finish()
        err.close()
    # its thread is gone with it (a command's last thread exits without the teardown)
    assert not any(t.name == "xpuctl-countdown" for t in threading.enumerate())
    shown = read_pty(master)
    drain = countdowns(shown, "xpuctl: draining vllm-8000: 3 requests running")
    assert len(set(drain)) >= 2 and drain == sorted(drain, reverse=True), shown
    assert countdowns(shown, "xpuctl: teardown of vllm-8000: waiting for 3 processes"), shown
    assert shown.endswith(CLEAR), repr(shown)  # the line is gone once nothing is awaited
    assert "in-flight" in out.getvalue()  # the command's own line went to its stream


def test_without_a_terminal_each_phase_is_one_plain_line():
    from xpuctl.core import waits
    from xpuctl.core.waits import Wait
    from xpuctl.output import progress

    err = io.StringIO()
    view = progress.countdown(err)
    t = time.monotonic()
    for n in (4, 4, 3, 1):  # counts that move are not lines
        view.wait(Wait(waits.DRAIN, "vllm-8000", t + 30, n, n - 1))
    view.wait(None)
    view.wait(Wait(waits.ESCALATION, "vllm-8000", t + 40, 1))
    view.wait(Wait(waits.COLLECTIVE, "0,1", t + 30, step="import"))
    view.wait(Wait(waits.COLLECTIVE, "0,1", t + 30, step="init"))
    view.finish()
    lines = err.getvalue().splitlines()
    assert lines == [
        "xpuctl: draining vllm-8000: 3 requests running, up to 30 s",
        "xpuctl: SIGTERM to what is left of vllm-8000: waiting for 1 process, up to 40 s",
        "xpuctl: collective check on 0,1, up to 30 s",
    ], lines
    assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()


def test_quiet_shows_no_countdown():
    from xpuctl.core import waits
    from xpuctl.core.waits import Wait
    from xpuctl.output import progress

    err = io.StringIO()
    view = progress.countdown(err, quiet=True)
    view.wait(Wait(waits.TEARDOWN, "vllm-8000", time.monotonic() + 5, 2))
    view.finish()
    assert err.getvalue() == ""


# -- the stop ladder, through shutdown --------------------------------------------------------


def _slow_teardown_run(rig, name: str):
    """A ready run whose workers take 3 s to tear down once asked (its stop waits)."""
    from serverig import wait_ready

    fg = rig.serve_bg(name=name, detach=True, drain=5, teardown=10,
                      env={"FAKE_VLLM_TEARDOWN_S": "3"})
    wait_ready(rig, fg)
    return fg


def test_shutdown_on_a_terminal_counts_down_what_it_waits_for(rig):
    _slow_teardown_run(rig, "tty")
    cmd = [*XPUCTL, "--root", rig.root.root, "shutdown", "tty", "--state-dir", rig.state]
    rc, shown = run_on_pty(cmd, rig.env(), rig.tmp, rig.popens)
    assert rc == 0, shown
    left = countdowns(shown, "xpuctl: teardown of tty: waiting for ")
    assert len(set(left)) >= 2 and left == sorted(left, reverse=True), shown
    # the timeline is written above the countdown, each of its lines whole
    timeline = [f for f in shown.split(CLEAR) if "verdict" in f]
    assert timeline and re.search(r"^\s+\d+\.\d+s\s+verdict\s+clean", timeline[-1], re.M), shown
    rig.assert_clean()


def test_shutdown_without_a_terminal_says_each_phase_once_and_its_json_is_unchanged(rig):
    _slow_teardown_run(rig, "pipe")
    res = rig.shutdown("pipe", "--json")
    assert res.rc == 0, str(res)
    doc = json.loads(res.out)  # stdout is the document alone
    assert doc["schema"] == "xpuctl.shutdown/1" and doc["verdict"] == "clean", res.out
    said = [line for line in res.err.splitlines() if " of pipe" in line or "draining pipe" in line]
    phases = [line.split(":")[1].split()[0] for line in said]
    assert said and len(phases) == len(set(phases)), res.err  # one line per phase
    assert any(line.startswith("xpuctl: teardown of pipe: waiting for ") for line in said), said
    assert "s left" not in res.err and "\r" not in res.err, res.err
    rig.assert_clean()


# -- the collective check, through doctor -----------------------------------------------------


def _collective_env(tmp: Path) -> tuple[Path, dict[str, str]]:
    root = tmp / "root"
    fh.clean_host(root)  # two xe GPUs
    (tmp / "scenario.json").write_text(json.dumps({"collective": {"hang": {"1": "init"}}}))
    env = {**os.environ, "XPUCTL_STANDIN": str(tmp / "scenario.json"),
           "XPUCTL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(STANDINS)}
    env.pop("XPUCTL_TEST_COLLECTIVE_BACKEND", None)
    return root, env


def test_doctor_collective_on_a_terminal_counts_down_beside_its_json(tmp_path):
    root, env = _collective_env(tmp_path)
    popens: list = []
    with open(tmp_path / "out.json", "wb") as out:
        rc, shown = run_on_pty([*XPUCTL, "--root", str(root), "doctor", "--collective", "--json",
                                "--collective-timeout", "3"], env, tmp_path, popens,
                               stdout=out.fileno())
    doc = json.loads((tmp_path / "out.json").read_text())  # the JSON alone on stdout
    assert rc == 1 and doc["collective"]["verdict"] == "hung", shown
    group = countdowns(shown, "xpuctl: collective check on 0,1: init")
    assert len(set(group)) >= 2 and group == sorted(group, reverse=True), shown
    assert countdowns(shown, "xpuctl: collective check, each of 0,1 alone: "), shown


def test_doctor_collective_without_a_terminal_says_each_phase_once(tmp_path):
    root, env = _collective_env(tmp_path)
    p = subprocess.run([*XPUCTL, "--root", str(root), "doctor", "--collective", "--json",
                        "--collective-timeout", "2"], env=env, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["collective"]["verdict"] == "hung"
    assert p.stderr.splitlines() == ["xpuctl: collective check on 0,1, up to 2 s",
                                     "xpuctl: collective check, each of 0,1 alone, up to 2 s"]


# -- serve's own stop ---------------------------------------------------------------------


def test_serve_on_a_terminal_counts_down_its_stop_after_a_start_that_hung(rig):
    cmd = rig.serve_cmd(port=free_port(), opts=["--name", "hung", "--preflight", "fast"],
                        detach=False, ready=2, teardown=3)
    rc, shown = run_on_pty(cmd, rig.env(FAKE_VLLM_FAULTS="hang-startup"), rig.tmp, rig.popens)
    assert rc == 4, shown
    left = countdowns(shown, "xpuctl: teardown of hung: waiting for ")
    assert len(set(left)) >= 2 and left == sorted(left, reverse=True), shown
    rig.assert_clean()
