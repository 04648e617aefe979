"""An exit nobody asked for is a failure (issue 23 §3): vLLM can exit 0 after its engine died
(vLLM #48966: "Worker proc VllmWorker-0 died unexpectedly", "EngineCore encountered a fatal
error", then uvicorn's "Application shutdown complete." and status 0, so systemd's
`Restart=on-failure` never fired). serve then records `failed` with the reason and vLLM's
last lines and exits 1, in the foreground and in the detached supervisor.

The stand-in is the fake vLLM's `crash-engine` + `exit-0-on-engine-death` faults: EngineCore
dies, the API server logs "Engine core proc EngineCore_0 died unexpectedly, shutting down
client." (vLLM's core_client.py line, as quoted in vLLM #32468 and #27549) and uvicorn's
shutdown lines (as in vLLM #51013), and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from proctools import free_port, wait_for
from serverig import Rig

pytestmark = pytest.mark.slow

EXIT_0 = {"FAKE_VLLM_FAULTS": "crash-engine,exit-0-on-engine-death",
          "FAKE_VLLM_ENGINE_DEAD_EXIT_S": "0.3"}
# the watch would stop a ready run whose engine died (exit 7, test_serve_watch.py): report
# leaves the exit to vLLM, which is what these tests are about
REPORT = ["--on-unhealthy", "report"]


def _state(rig: Rig, name: str) -> str | None:
    try:
        return rig.record(name)["state"]
    except (OSError, ValueError):
        return None


def _api_exits(rig: Rig, rec: dict) -> list[int]:
    return rig.exits(rec["pid"])


def _assert_failed_record(rig: Rig, name: str, what: str) -> dict:
    rec = rig.record(name)
    assert rec["state"] == "failed" and rec["exit_code"] == 0, rec
    assert _api_exits(rig, rec) == [0]  # the stand-in really exited 0
    assert "nobody asked" in rec["reason"] and what in rec["reason"], rec["reason"]
    assert any("died unexpectedly" in line for line in rec["last_lines"]), rec["last_lines"]
    assert 0 < len(rec["last_lines"]) <= 20
    return rec


def test_foreground_exit_0_after_the_engine_died_is_a_failure(rig):
    crash = rig.tmp / "crash-now"
    fg = rig.serve_bg(opts=REPORT, env={**EXIT_0, "FAKE_VLLM_CRASH_FILE": str(crash)})
    assert wait_for(lambda: _state(rig, fg.name) == "ready", 60, 0.1), str(fg)
    crash.touch()
    assert fg.proc.wait(120) == 1, str(fg)
    err = fg.err()
    assert "xpuctl: vLLM exited with code 0" in err, str(fg)
    assert "serve exits 1" in err, str(fg)
    rec = _assert_failed_record(rig, fg.name, "EngineCore failed")
    assert any("Application shutdown complete." in line for line in rec["last_lines"])
    rig.assert_clean()


# Runs `serve --detach` as the child of a subreaper, so that the detached supervisor (the
# serve's child, orphaned when serve returns) is reparented here and its status can be read.
_REAPER = r"""
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
cmd = json.loads(sys.argv[1])
serve = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
print(json.dumps({"serve": serve.returncode}), flush=True)
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def test_detached_supervisor_exit_0_after_the_engine_died_is_a_failure(rig):
    crash = rig.tmp / "crash-now"
    name = "detached-exit0"
    cmd = rig.serve_cmd(port=free_port(), opts=["--name", name, "--force", *REPORT])
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, json.dumps(cmd)],
                              env=rig.env(**EXIT_0, FAKE_VLLM_CRASH_FILE=str(crash)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, cwd=rig.tmp, start_new_session=True)
    rig.popens.append(reaper)
    assert wait_for(lambda: _state(rig, name) in ("ready", "failed", "stopped")
                    or reaper.poll() is not None, 90, 0.1)
    assert _state(rig, name) == "ready", rig.run_log(name)
    crash.touch()
    out, err = reaper.communicate(timeout=120)
    reaped = [json.loads(line) for line in out.splitlines()]
    assert reaped[0] == {"serve": 0}, (out, err)  # serve --detach returned once ready
    supervisor = rig.record(name)["supervisor_pid"]
    assert {"pid": supervisor, "code": 1} in reaped[1:], (out, err, rig.run_log(name))
    _assert_failed_record(rig, name, "EngineCore failed")
    log = rig.run_log(name)
    assert "nobody asked" in log and "serve exits 1" in log, log
    rig.assert_clean()


def test_detached_exit_0_before_ready_after_the_engine_was_killed_is_a_failure(rig):
    """The engine dies during start-up (killed by someone who is not xpuctl) and vLLM exits 0:
    `serve --detach` exits 1 and the record says why."""
    fg = rig.serve_bg(detach=True, env={"FAKE_VLLM_FAULTS": "hang-startup,exit-0-on-engine-death"})

    def engine_core() -> int | None:
        starts = [e for e in rig.events() if e["event"] == "start" and e["role"] == "engine-core"]
        return starts[0]["pid"] if starts else None

    assert wait_for(lambda: engine_core() is not None, 60, 0.1), str(fg)
    core = engine_core()
    assert core is not None
    rig.kill_mine(core)
    assert fg.proc.wait(120) == 1, str(fg)
    assert "exited before it was ready (code 0)" in fg.err(), str(fg)
    _assert_failed_record(rig, fg.name, "EngineCore died")
    rig.assert_clean()


def test_a_requested_stop_is_still_a_success(rig):
    """The other side: `xpuctl shutdown` asked for the exit, so the run is stopped, not failed,
    and its record carries no reason."""
    res = rig.serve(name="asked")
    assert res.rc == 0, str(res)
    assert rig.shutdown("asked").rc == 0
    rec = rig.record("asked")
    assert rec["state"] == "stopped" and rec["reason"] is None and rec["last_lines"] == [], rec
    rig.assert_clean()
