"""An unclean end stays recorded (issue 31 §8): a run whose supervisor and API server were
SIGKILLed, whose orphans a later `shutdown` stopped, still needs the collective check before
the next launch on its devices, until a collective check that passes or a reset proves them
clean (xpuctl/state/lastrun.py, docs/collective.md).

Each scenario runs in a private PID namespace (`shutdown --all` and `reset` act on every vLLM
process and orphan of the host they see): a fake vLLM run under serve on a stand-in root, its
supervisor stopped (SIGSTOP, so it cannot clean up), its API server SIGKILLed, then the
supervisor SIGKILLed; EngineCore and the workers are left holding the devices, as in vLLM
#55510. The collective check runs on the collective stand-ins (tests/standins/collective).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from proctools import pidns_available

HERE = Path(__file__).resolve().parent

_DRIVER = r"""
import json, os, signal, subprocess, sys, time
support, standins, workdir, how, proof, reaped = sys.argv[1:7]
sys.path.insert(0, support)
from proctools import StandInRoot, free_port, is_gone, wait_for
from serverig import VLLM_CMD
from xpuctl.state.lastrun import unclean_run_on

def reap():
    while True:  # we are PID 1 here: the killed processes' zombies are ours to reap
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R, S = root.root, os.path.join(workdir, "state")
BDFS = [StandInRoot.bdf(0), StandInRoot.bdf(1)]
scenario = os.path.join(workdir, "scenario.json")
env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUCTL_", "ZE_", "ONEAPI_"))}
env.update(SPT_NOENV="1", PYTHONPATH=standins, XPUCTL_STANDIN=scenario)
xp = [sys.executable, "-m", "xpuctl", "--root", R]

def run(*args):
    p = subprocess.run(xp + list(args), capture_output=True, text=True, timeout=300, env=env,
                       stdin=subprocess.DEVNULL, cwd=workdir)
    reap()
    return [p.returncode, p.stdout, p.stderr]

def collective(**scen):
    with open(scenario, "w") as f:
        json.dump({"collective": scen}, f)

def serve(*opts):
    return run("serve", "--state-dir", S, "--collective-timeout", "5", *opts)

try:
    collective()
    out["serve"] = serve("--vllm", VLLM_CMD, "--drain-timeout", "2", "--teardown-timeout", "2",
                         "--ready-timeout", "60", "--kill-after", "1", "--detach", "--name",
                         "victim", "fake-model", "--port", str(free_port()), "-tp", "2")
    rec = json.load(open(os.path.join(S, "runs", "victim.json")))
    api, sup = rec["pid"], rec["supervisor_pid"]
    os.kill(sup, signal.SIGSTOP)  # it must not stop the orphans itself
    os.kill(api, signal.SIGKILL)
    time.sleep(0.5)
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: (reap(), is_gone(api) and is_gone(sup))[1], 30)
    if reaped == "reaped":  # as systemd would; else it stays a zombie, as under many containers' PID 1
        wait_for(lambda: (reap(), not os.path.exists(f"/proc/{sup}"))[1], 30)
    def title(pid):
        try:
            return open(f"/proc/{pid}/cmdline").read()
        except OSError:
            return ""
    out["orphans"] = sorted(p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                            if title(p).startswith("VLLM::") and not is_gone(p))
    out["unclean_before"] = unclean_run_on(S, BDFS)
    args = ["victim"] if how == "name" else ["--all", "--yes"]
    out["shutdown"] = run("shutdown", *args, "--json", "--state-dir", S, "--timeout", "2",
                          "--kill-after", "1", "--release-timeout", "10")
    out["left"] = [p for p in out["orphans"] if not is_gone(p)]
    out["record"] = json.load(open(os.path.join(S, "runs", "victim.json")))
    out["unclean_after_shutdown"] = unclean_run_on(S, BDFS)
    collective(crash={"0": "init"})  # the check it wants fails: the launch is refused
    out["next_serve"] = serve("--vllm", "/bin/false never-started", "fake-model", "--port", "1")
    out["unclean_after_refusal"] = unclean_run_on(S, BDFS)
    collective()
    if proof == "collective":
        out["proof"] = run("doctor", "--collective", "--json", "--state-dir", S,
                           "--collective-timeout", "30")
    else:
        out["proof"] = run("reset", "--yes", "--json", "--state-dir", S)
    out["unclean_after_proof"] = unclean_run_on(S, BDFS)
    out["last_serve"] = serve("--vllm", "/bin/false never-started", "fake-model", "--port", "1")
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
@pytest.mark.parametrize(("how", "proof", "reaped"), [("name", "collective", "reaped"),
                                                     ("all", "reset", "zombie")])
def test_a_shutdown_after_an_unclean_end_does_not_make_it_clean(tmp_path, proc_token, how,
                                                                 proof, reaped):
    """`reaped`: the killed supervisor is reaped by PID 1 (a host with systemd), or stays a
    zombie (a container whose PID 1 does not reap): gone either way."""
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                        str(driver), str(HERE / "support"), str(HERE / "standins" / "collective"),
                        str(tmp_path), how, proof, reaped],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "XPUCTL_TEST_TOKEN": proc_token})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1 and out["serve"][0] == 0, out["serve"]
    assert len(out["orphans"]) == 3, out  # EngineCore and two workers
    assert out["unclean_before"][0] == "victim", out["unclean_before"]

    rc, stdout, stderr = out["shutdown"]
    assert rc == 0, stderr
    assert sorted(p for t in json.loads(stdout)["targets"] for p in t["processes"]) == out["orphans"]
    assert out["left"] == []
    # the shutdown stopped what was left, and kept the run's end unclean
    rec = out["record"]
    assert rec["state"] == "failed", rec
    assert rec["reason"].startswith("ended uncleanly before the shutdown: "), rec
    assert out["unclean_after_shutdown"] == ["victim", out["unclean_after_shutdown"][1]]
    assert out["unclean_after_shutdown"][1].startswith("failed")

    # so the next serve runs the collective check first (here it fails: refused, no run)
    rc, _, stderr = out["next_serve"]
    assert rc == 1, stderr
    assert ("xpuctl: preflight: the last run on these devices (victim) failed" in stderr
            and "running the collective check first" in stderr), stderr
    assert "preflight fail collective" in stderr, stderr
    assert out["unclean_after_refusal"][0] == "victim"

    # a check that passes, or a reset, proves the devices clean
    rc, stdout, stderr = out["proof"]
    assert rc in (0, 1), stderr
    if proof == "collective":
        assert json.loads(stdout)["collective"]["verdict"] == "ok", stdout
    else:
        assert rc == 0, stdout + stderr
    assert out["unclean_after_proof"] is None
    assert "running the collective check first" not in out["last_serve"][2], out["last_serve"]


# -- the record and the proofs, without processes --------------------------------------------

BDF0, BDF1 = "0000:03:00.0", "0000:04:00.0"


def _record(sd: str, name: str, devices: list[str], state: str, at: float, **kw) -> None:
    from xpuctl.state.runs import RunRecord, write_record

    write_record(sd, RunRecord(name=name, run_id=name, pid=None, start_ticks=None, session=None,
                               command=["vllm"], devices=devices, port=8000, bind="127.0.0.1",
                               shutdown_timeout=None, drain_timeout=1, teardown_timeout=1,
                               log_path="", state=state, stopped_at=at, **kw))


def test_a_proof_after_the_end_clears_it_one_before_does_not(tmp_path, monkeypatch):
    import time

    from xpuctl.state import lastrun
    from xpuctl.state.runs import ensure_state_dir

    sd = ensure_state_dir(str(tmp_path / "s"))
    assert not lastrun.note_clean(str(tmp_path / "none"), [BDF0], "reset")  # no runs there
    _record(sd, "old", [BDF0, BDF1], "failed", time.time(), exit_code=-9)
    assert lastrun.unclean_run_on(sd, [BDF0])[0] == "old"
    # proved clean on one of the run's devices: a launch on that one needs no check
    monkeypatch.setattr(lastrun.time, "time", lambda: 2e9)
    assert lastrun.note_clean(sd, [BDF0], "collective check")
    assert lastrun.unclean_run_on(sd, [BDF0]) is None
    assert lastrun.unclean_run_on(sd, [BDF1])[0] == "old"
    assert lastrun.unclean_run_on(sd, [BDF0, BDF1])[0] == "old"  # one of them not proved
    assert lastrun.unclean_run_on(sd, [])[0] == "old"  # all of the run's devices
    # every device (a reset without --device); a run that ended after the proof is unclean
    assert lastrun.note_clean(sd, None, "reset")
    assert lastrun.unclean_run_on(sd, []) is None
    _record(sd, "later", [BDF1], "failed", 2e9 + 10)
    assert lastrun.unclean_run_on(sd, [BDF1])[0] == "later"
    assert lastrun.proved_clean(sd) == {BDF0: 2e9, "*": 2e9}
    (tmp_path / "s" / lastrun.PROOFS).write_text('{"devices": {"x": {"at": "soon"}, "y": 3}}')
    assert lastrun.proved_clean(sd) == {}  # not a proof: nothing is clean on its strength


def test_an_active_run_whose_supervisor_is_a_zombie_ended_uncleanly(tmp_path):
    """PID 1 in a container may never reap a killed supervisor: a zombie supervises nothing."""
    from proctools import proc_state, wait_for

    from xpuctl.state import lastrun
    from xpuctl.state.runs import RunRecord

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert wait_for(lambda: proc_state(child.pid) == "Z", 30)
        rec = RunRecord(name="r", run_id="r", pid=None, start_ticks=None, session=None,
                        command=["vllm"], devices=[BDF0], port=8000, bind="127.0.0.1",
                        shutdown_timeout=None, drain_timeout=1, teardown_timeout=1, log_path="",
                        state="ready", supervisor_pid=child.pid)
        assert lastrun.unclean_end(rec) == f"is recorded as ready but its supervisor {child.pid} is gone"
        assert lastrun.unclean_end(rec, top_alive=True) is None  # its own stop decides
    finally:
        child.wait()
