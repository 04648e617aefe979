"""A run is proved by its record, never by a variable (issue 29 §11).

`serve` tags what it starts with XPUCTL_RUN_ID, but any process can put that variable in its
environment. A tag counts only when a live run's record names the process (pid and start
ticks), or the process descends from the recorded one or from its supervisor (a process that
left the run's tree is reparented to the supervisor, a subreaper). Before, a GPU holder that
led its own session with `XPUCTL_RUN_ID=<anything>` was taken for a live run's top and kept
by `reset --kill-holders`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from proctools import pidns_available
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()
PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"


def test_a_run_leader_needs_a_record(tmp_path):
    """The i915 host's API server carries XPUCTL_RUN_ID (fakehost.i915_host): shown, but not
    proven without a record naming it; with one (pid and start ticks) it is."""
    from xpuctl.state.runs import RunRecord, write_record

    h = fh.i915_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--state-dir",
                              str(tmp_path / "none")])
    procs = {p["pid"]: p for p in json.loads(res.stdout)["processes"]}
    assert procs[h.api]["run_id"] == fh.RUN_ID and procs[h.api]["run_proven"] is False
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    for sub in ("runs", "locks", "logs"):
        (state / sub).mkdir(mode=0o700)
    ticks = h.ticks(4000)  # the API server's start (fakehost.i915_host)
    for name, start in (("other-start", ticks + 1), ("r", ticks)):
        write_record(str(state), RunRecord(
            name=name, run_id=fh.RUN_ID, pid=h.api, start_ticks=start, session=h.api,
            command=[], devices=[], port=8001, bind="127.0.0.1", shutdown_timeout=30,
            drain_timeout=30.0, teardown_timeout=10.0, log_path="", state="ready"))
        res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--state-dir",
                                  str(state)])
        procs = {p["pid"]: p for p in json.loads(res.stdout)["processes"]}
        # a record naming the pid with another start time is some other process's
        assert procs[h.api]["run_proven"] is (name == "r"), name
        assert procs[h.worker]["run_proven"] is (name == "r"), name  # a descendant


def _record_i915_run(h, state: Path) -> None:
    from xpuctl.state.runs import RunRecord, write_record

    state.mkdir(mode=0o700)
    for sub in ("runs", "locks", "logs"):
        (state / sub).mkdir(mode=0o700)
    write_record(str(state), RunRecord(
        name="r", run_id=fh.RUN_ID, pid=h.api, start_ticks=h.ticks(4000), session=h.api,
        command=[], devices=[fh.A770_BDF], port=8001, bind="127.0.0.1", shutdown_timeout=30,
        drain_timeout=30.0, teardown_timeout=10.0, log_path="", state="ready"))


def test_a_copied_tag_never_ties_a_process_to_a_live_run(tmp_path):
    """An orphaned `VLLM::EngineCore` that carries a live run's id, copied (its environ
    readable), started before the run: stopping it by pid plans it alone, never the run (the
    record's tree is another one) nor the run's processes (tagged, and younger than it)."""
    h = fh.i915_host(tmp_path / "root")
    forger = 3900
    h.add_process(forger, 1, ["python3", "-c", "pass"], title="VLLM::EngineCore",
                  start_ticks=h.ticks(3000), uid=1000, pgrp=3900, session=3900,
                  environ=dict(fh.ALICE_ENV, XPUCTL_RUN_ID=fh.RUN_ID, SPT_NOENV="1"))
    _record_i915_run(h, tmp_path / "state")
    res = runner.invoke(app, ["--root", str(h.root), "shutdown", "--pid", str(forger),
                              "--dry-run", "--json", "--state-dir", str(tmp_path / "state")])
    assert res.exit_code == 0, res.output
    targets = json.loads(res.stdout)["targets"]
    assert [(t["top"], t["processes"], t["run_id"]) for t in targets] == [(forger, [forger], None)]


# The run's vLLM command: a wrapper that leaves behind, outside the run's tree, a process of
# the run holding device 1 (double fork and setsid: reparented to the supervisor, the
# subreaper), then becomes the fake vLLM.
_WRAPPER = r"""
import os, sys, time
node = os.path.join(os.environ["XPUCTL_ROOT"], "dev/dri/renderD129")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.open(node, os.O_RDWR)
        with open(os.path.join(os.path.dirname(__file__), "left.pid"), "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(3600)
    os._exit(0)
os.wait()
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""

_DRIVER = r"""
import json, os, subprocess, sys
support, token, workdir, state, fake = sys.argv[1:6]
sys.path.insert(0, support)
from proctools import StandInRoot, free_port, holders, is_gone, token_env, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
env = token_env(token, SPT_NOENV="1", XPUCTL_ROOT=R,
                FAKE_VLLM_EVENTS=os.path.join(workdir, "events.jsonl"))
def xp(*args):
    p = subprocess.run([sys.executable, "-m", "xpuctl", "--root", R, *args], capture_output=True,
                       text=True, timeout=180, stdin=subprocess.DEVNULL, env=env)
    return {"code": p.returncode, "out": p.stdout, "err": p.stderr}
HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_RDWR); time.sleep(3600)"
def holder(run_id, node):
    # leads its own session, as serve's launched top does, and claims a run
    p = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(R, "dev/dri", node)],
                         env={**env, "XPUCTL_RUN_ID": run_id}, start_new_session=True,
                         stdin=subprocess.DEVNULL)
    wait_for(lambda: p.pid in holders(os.path.join(R, "dev/dri", node)), 30)
    return p.pid
try:
    out["serve"] = xp("serve", "--detach", "--quiet", "--name", "real", "--state-dir", state,
                      "--vllm",
                      f"{sys.executable} {os.path.join(workdir, 'wrapper.py')} {fake} serve",
                      "--ready-timeout", "60", "--drain-timeout", "2", "--teardown-timeout", "2",
                      "--port", str(free_port()), "fake-model", "-tp", "1")
    rec = json.load(open(os.path.join(state, "runs", "real.json")))
    out["run_id"] = rec["run_id"]
    left = os.path.join(workdir, "left.pid")
    wait_for(lambda: os.path.exists(left), 30)
    out["left"] = int(open(left).read())
    out["forged"] = holder("forged-0001", "renderD128")
    out["copied"] = holder(rec["run_id"], "renderD128")  # a live run's id, copied
    out["reset"] = xp("reset", "--yes", "--kill-holders", "--json", "--state-dir", state,
                      "--kill-after", "1", "--timeout", "5")
    out["forged_gone"] = wait_for(lambda: is_gone(out["forged"]) and is_gone(out["copied"]), 30)
    out["left_alive"] = not is_gone(out["left"])
    out["top_alive"] = not is_gone(rec["pid"])
    out["shutdown"] = xp("shutdown", "real", "--state-dir", state, "--kill-after", "1")
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_kill_holders_stops_a_forged_tag_and_keeps_a_real_runs_process(tmp_path, proc_token):
    """In a private PID namespace (reset stops what it sees): a real `serve --detach` run
    whose wrapper left a process of the run holding device 1 outside the run's tree, and two
    holders of device 0 that lead their own session with a forged tag (one made up, one a copy
    of the live run's id). `reset --yes --kill-holders` stops both forgers and keeps the run's
    process and the run."""
    from proctools import FAKE_VLLM

    (tmp_path / "wrapper.py").write_text(_WRAPPER)
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), proc_token, str(tmp_path), str(tmp_path / "state"),
                        str(FAKE_VLLM)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1 and out["serve"]["code"] == 0, out
    reset = out["reset"]
    assert reset["code"] == 0, reset
    holders = {h["pid"]: h for h in json.loads(reset["out"])["plan"]["holders"]}
    for forger in (out["forged"], out["copied"]):
        assert forger in holders, f"a forged tag hid holder {forger}: {holders}"
        assert holders[forger]["stop"], holders
    assert not holders[out["left"]]["stop"], holders
    assert holders[out["left"]]["why_not"] == "it belongs to a live xpuctl run", holders
    assert out["forged_gone"] and out["left_alive"] and out["top_alive"], out
    assert out["shutdown"]["code"] == 0, out["shutdown"]
