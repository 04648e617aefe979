"""xpuctl itself SIGKILLed at each step of reset and shutdown (issue 17 item 6): nothing it
leaves behind is misread by the next run. Run records stay whole (atomic.replace), the audit
log has no torn line, the next doctor tells the truth, and the next run finishes the job.

Each kill is deterministic: XPUCTL_TEST_PAUSE_AT makes xpuctl stop at one named step
(xpuctl/pausepoint.py, read only by tests), the test waits for its marker and SIGKILLs the
process it started. reset sees every orphan on the host, so its runs happen in a private PID
namespace, where the only processes are this test's (and all of them die with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from proctools import is_gone, pause_env, pidns_available, wait_for
from serverig import XPUCTL

from xpuctl.host.reads.protocol import COMM

PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"  # the helpers, for the driver scripts




def assert_audit_whole(path: Path) -> list[dict]:
    """Every line of the audit log (and its rotations) is whole JSON; none is torn."""
    out = []
    for f in sorted(path.parent.glob(path.name + "*")):
        data = f.read_bytes()
        assert data == b"" or data.endswith(b"\n"), f"{f}: torn last line: {data[-80:]!r}"
        out += [json.loads(line) for line in data.decode().splitlines()]
    return out


# ---------------------------------------------------------------------------------------------
# reset


_RESET_DRIVER = r"""
import json, os, signal, subprocess, sys, time
support, state, token, workdir, step = sys.argv[1:6]
sys.path.insert(0, support)
from proctools import StandInRoot, holders, is_gone, pause_env, start_fake_vllm, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
xp = [sys.executable, "-m", "xpuctl", "--root", R]
def run(*args):
    p = subprocess.run(xp + list(args), capture_output=True, text=True, timeout=300)
    return [p.returncode, p.stdout, p.stderr]
try:
    # orphans that need the whole ladder: workers hung in oneCCL init ignore SIGTERM, so
    # reset sends SIGTERM to EngineCore, then SIGTERM to the survivors, then SIGKILL
    fv = start_fake_vllm(token, R, tp=2, shutdown_timeout=5, workdir=workdir,
                         env={"FAKE_VLLM_FAULTS": "hang-startup"})
    out["ready"] = wait_for(lambda: fv.log().count("backend=xccl") == 2, 60)
    tree = fv.tree()
    fv.proc.kill()
    fv.proc.wait()
    out["orphans"] = [p for p in tree if p != fv.pid]
    extra = os.path.join(R, "dev/shm/psm_deadbeef")  # stale from the start: nobody has it
    with open(extra, "wb") as fh:
        fh.write(b"x" * 64)
    out["shm_before"] = root.shm()
    marker = os.path.join(workdir, "paused")
    env = dict(os.environ, **pause_env(marker, step))
    reset = xp + ["reset", "--yes", "--json", "--timeout", "1", "--kill-after", "1",
                  "--state-dir", state]
    p = subprocess.Popen(reset, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out["paused"] = wait_for(lambda: os.path.exists(marker) or p.poll() is not None, 120)
    out["paused_at"] = open(marker).read() if os.path.exists(marker) else None
    p.kill()
    p.wait()
    out["killed_rc"] = p.returncode
    out["alive_after_kill"] = [q for q in out["orphans"] if not is_gone(q)]
    out["shm_after_kill"] = root.shm()
    log = os.path.join(state, "audit.jsonl")
    out["audit_after_kill"] = open(log).read() if os.path.exists(log) else ""
    out["doctor"] = run("doctor", "--json", "--state-dir", state)
    # processes exit and files go by themselves while doctor runs: what it reports must lie
    # between what was there just before it and what is there just after it
    out["alive_after_doctor"] = [q for q in out["orphans"] if not is_gone(q)]
    out["shm_after_doctor"] = root.shm()
    out["reset"] = run("reset", "--yes", "--json", "--timeout", "1", "--kill-after", "1",
                       "--state-dir", state)
    out["alive_at_end"] = [q for q in out["orphans"] if not is_gone(q)]
    out["held"] = holders(root.node(0)) + holders(root.node(1))
    out["shm_at_end"] = root.shm()
    out["doctor_end"] = run("doctor", "--json", "--state-dir", state)
finally:
    root.close()
print(json.dumps(out))
"""

RESET_STEPS = [
    "reset-execute",    # after the plan (shown and confirmed), before anything
    "signal-sent",      # after the first signal
    "signal-sent:2",    # between signals
    "reset-removing",   # between the signals and the deletions
    "file-removed",     # between deletions
    "audit-locked",     # inside an audit append (its lock held)
]


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
@pytest.mark.parametrize("step", RESET_STEPS)
def test_reset_killed_at_each_step(tmp_path, proc_token, step):
    driver = tmp_path / "driver.py"
    driver.write_text(_RESET_DRIVER)
    state = tmp_path / "state"
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), str(state), proc_token, str(tmp_path), step],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1 and out["ready"] and len(out["orphans"]) == 3, out
    assert out["paused"] and out["paused_at"].startswith(step + " "), out
    assert out["killed_rc"] == -signal.SIGKILL

    # the audit log as the kill left it: whole lines, one per signal sent so far
    text = out["audit_after_kill"]
    assert text == "" or text.endswith("\n"), text[-200:]
    lines = [json.loads(line) for line in text.splitlines()]
    sent = [e for e in lines if e["action"] == "signal" and e["result"] == "sent"]
    if step.startswith("signal-sent"):
        assert len(sent) == int(step.partition(":")[2] or 1), lines
    if step == "reset-execute":
        assert lines == []
    removed = [e for e in lines if e["action"] == "delete" and e["result"] == "removed"]
    if step == "file-removed":  # each deletion is audited before the next one (issue 29 §9)
        assert len(removed) == 1, lines
    if step in ("reset-execute", "reset-removing") or step.startswith("signal-sent"):
        assert removed == [], lines

    # the next doctor tells the truth: the orphans alive, exactly, and the files on disk
    rc, stdout, stderr = out["doctor"]
    assert rc in (0, 1), stderr
    doc = json.loads(stdout)
    orphans = {q["pid"] for q in doc["processes"] if q["orphan"] and q["state"] != "Z"}
    assert set(out["alive_after_doctor"]) <= orphans <= set(out["alive_after_kill"]), (orphans, out)
    if out["alive_after_doctor"]:
        assert any(f["check"] == "orphans" and f["severity"] == "fail" for f in doc["findings"])
    listed = {Path(a["path"]).name for a in doc["artifacts"] if a["path"].startswith("/dev/shm/")}
    assert set(out["shm_after_doctor"]) <= listed <= set(out["shm_after_kill"]), (listed, out)
    if "psm_deadbeef" in out["shm_after_kill"]:  # never open: stale, and said so
        assert any(a["path"] == "/dev/shm/psm_deadbeef" and a["stale"] for a in doc["artifacts"])

    # the next reset finishes the job
    rc, stdout, stderr = out["reset"]
    assert rc == 0, (stdout, stderr)
    assert out["alive_at_end"] == [] and out["held"] == [], out
    assert out["shm_at_end"] == [], out
    end = json.loads(out["doctor_end"][1])
    assert not [q for q in end["processes"] if q["orphan"] and q["state"] != "Z"], end
    assert not [a for a in end["artifacts"] if a["stale"]], end
    assert_audit_whole(state / "audit.jsonl")


# ---------------------------------------------------------------------------------------------
# shutdown


SHUTDOWN_STEPS = [
    "shutdown-found",   # the trees found and the record says "stopping"; nothing signalled
    "record-rename",    # the "stopping" record written to its temporary file, not renamed
    "signal-sent",      # after the SIGTERM to the API server
    "audit-locked",     # the SIGTERM sent, its audit line about to be written
    "record-rename:2",  # the final record update ("stopped") half done
]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _mine(rig, doc: dict) -> dict[int, dict]:
    started = {e["pid"] for e in rig.events() if e["event"] == "start"}
    return {q["pid"]: q for q in doc["processes"] if q["pid"] in started and q["state"] != "Z"}


@pytest.mark.slow
@pytest.mark.parametrize("step", SHUTDOWN_STEPS)
def test_shutdown_killed_at_each_step(rig, step):
    res = rig.serve(name="victim")
    assert res.rc == 0, str(res)
    rec = rig.record("victim")
    marker = rig.tmp / "paused"
    cmd = [*XPUCTL, "--root", rig.root.root, "shutdown", "victim", "--json", "--kill-after", "1",
           "--release-timeout", "5", "--state-dir", rig.state]
    env = rig.env(**pause_env(marker, step))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: marker.exists() or p.poll() is not None, 120), "never paused"
        assert marker.read_text().startswith(step + " "), marker.read_text()
    finally:
        p.kill()
        p.wait()

    # records stay whole: the record parses, the temporary file is not a run
    runs_dir = Path(rig.state, "runs")
    after = rig.record("victim")
    assert after["run_id"] == rec["run_id"] and after["pid"] == rec["pid"], after
    leftovers = [n for n in os.listdir(runs_dir) if n.endswith(".tmp")]
    assert leftovers == ([] if not step.startswith("record-rename") else leftovers)
    ps = rig.xpuctl("ps", "--json", "--state-dir", rig.state)
    assert ps.rc == 0, str(ps)
    assert [r["name"] for r in ps.json["runs"] if r["name"] == "victim"] in ([], ["victim"])
    assert_audit_whole(Path(rig.state, "audit.jsonl"))

    # the next doctor tells the truth about this run's processes
    # doctor lists vLLM: not the supervisor, nor its readers (xpuctl/host/reads/)
    def vllm() -> set[int]:
        return {p for p in rig.alive() if _comm(p) != COMM} - {rec["supervisor_pid"]}
    before = vllm()
    doc = rig.xpuctl("doctor", "--json", "--state-dir", rig.state)
    after_doc = vllm()
    assert doc.rc in (0, 1), str(doc)
    mine = _mine(rig, doc.json)
    assert after_doc <= set(mine) <= before, (mine.keys(), before, after_doc)
    if not is_gone(rec["pid"]):  # the API server lives: a server, not orphans
        assert not [q for q in mine.values() if q["orphan"]], mine

    # the next shutdown finishes the job (or finds nothing left to stop)
    nxt = rig.shutdown("victim", "--json", "--kill-after", "1", "--release-timeout", "5")
    assert nxt.rc in (0, 3), str(nxt)
    rig.assert_clean()
    assert wait_for(lambda: is_gone(rec["supervisor_pid"]), 60)
    final = rig.record("victim")
    assert final["state"] == "stopped", final
    assert_audit_whole(Path(rig.state, "audit.jsonl"))


@pytest.mark.slow
def test_a_killed_shutdown_does_not_leave_its_stopping_state_to_be_believed(rig):
    """A shutdown SIGKILLed after it marked the run "stopping" is stopping nothing. ps must
    not keep saying "stopping", and when vLLM later crashes by itself the supervisor must
    not take the crash for a requested stop (it would record "stopped", not "failed")."""
    crash = rig.tmp / "crash-now"
    # report: the watch would stop the crashed run itself (exit 7, test_serve_watch.py)
    res = rig.serve(name="orphaned-stop", opts=["--on-unhealthy", "report"],
                    env={"FAKE_VLLM_FAULTS": "crash-engine", "FAKE_VLLM_CRASH_FILE": str(crash),
                         "FAKE_VLLM_ENGINE_DEAD_EXIT_S": "0.5"})
    assert res.rc == 0, str(res)
    rec = rig.record("orphaned-stop")
    marker = rig.tmp / "paused"
    cmd = [*XPUCTL, "--root", rig.root.root, "shutdown", "orphaned-stop", "--state-dir", rig.state]
    env = rig.env(**pause_env(marker, "shutdown-found"))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: marker.exists() or p.poll() is not None, 120), "never paused"
    finally:
        p.kill()
        p.wait()
    assert rig.record("orphaned-stop")["state"] == "stopping"  # what the killed run wrote
    ps = rig.xpuctl("ps", "--json", "--state-dir", rig.state)
    assert [r["state"] for r in ps.json["runs"] if r["name"] == "orphaned-stop"] == ["ready"], ps.out

    crash.touch()  # vLLM now fails on its own
    assert wait_for(lambda: is_gone(rec["supervisor_pid"]), 60)
    rig.assert_clean()
    final = rig.record("orphaned-stop")
    assert final["state"] == "failed" and final["exit_code"] == 1, final
