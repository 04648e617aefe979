"""End-to-end tests of `xpuctl serve` against the fake vLLM: what vLLM gets, preflight and
locks, readiness, the foreground run, the start as it happens.

Everything runs for real (the rig: tests/support/serverig.py, its fixture in
tests/support/proc_fixtures.py). Nothing here signals a process the test did not start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from proctools import (
    FAKE_VLLM,
    TOKEN_VAR,
    cmdline,
    free_port,
    holders,
    http_get,
    is_gone,
    pids_with_token,
    port_listening,
    read_pty,
    sid_of,
    wait_for,
)
from serverig import (
    BDF0,
    BDF1,
    PY,
    VLLM_CMD,
    XPUCTL,
    assert_subsequence,
    audit_lines,
    event_of,
    phases,
    pids_in,
    proc_env,
    running,
    start_ticks,
    wait_ready,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# serve: what vLLM gets


def test_serve_launch_contract(rig):
    """--shutdown-timeout = drain + teardown, the tagged environment, --devices, --env,
    the run record and the state directory."""
    res = rig.serve("--max-model-len", "256", name="contract", drain=3, teardown=4,
                    opts=["--devices", "1", "--env", "FOO=bar baz", "--env", "XPT_EMPTY="],
                    spt_noenv=False)  # SPT_NOENV=1 must come from xpuctl here
    assert res.rc == 0, str(res)
    assert "contract is ready on port" in res.err, str(res)

    # the state dir was missing: created 0700, with runs/ logs/ locks/
    st = os.stat(rig.state)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert sorted(os.listdir(rig.state)) == ["locks", "logs", "runs"]

    rec = rig.record("contract")
    for key in ("name", "run_id", "pid", "start_ticks", "session", "command", "devices", "port",
                "shutdown_timeout", "log_path", "state", "exit_code"):
        assert key in rec, f"run record lacks {key}: {rec}"
    api = rec["pid"]
    assert rec["name"] == "contract"
    assert re.fullmatch(r"[0-9a-f]{16}", rec["run_id"]), rec
    assert rec["start_ticks"] == start_ticks(api)
    assert rec["session"] == api == sid_of(api)  # vLLM runs in a new session
    assert rec["command"] == cmdline(api)
    assert rec["command"][:3] == [PY, str(FAKE_VLLM), "serve"]
    assert rec["command"][3:] == ["fake-model", "--port", str(res.port), "-tp", "2",
                                  "--max-model-len", "256", "--shutdown-timeout", "7"]
    assert rec["devices"] == [BDF1]
    assert rec["port"] == res.port and rec["shutdown_timeout"] == 7
    assert rec["state"] == "ready" and rec["exit_code"] is None
    assert rec["log_path"] == os.path.join(rig.state, "logs", "contract.log")
    log = rig.run_log("contract")
    assert "non-default args: {" in log and "'shutdown_timeout': 7" in log, log
    assert "shutdown_timeout=7" in log  # what EngineCore was configured with

    # the supervisor: a session leader carrying our token
    sup = rec["supervisor_pid"]
    assert sup in rig.alive() and sid_of(sup) == sup

    # every vLLM process carries the tag and the environment xpuctl promised
    core, workers = rig.tree(api)
    assert len(workers) == 2
    assert cmdline(core)[0] == "VLLM::EngineCore"
    assert [cmdline(w)[0] for w in workers] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    for pid in (api, core, *workers):
        env = proc_env(pid)
        assert env.get("XPUCTL_RUN_ID") == rec["run_id"], (pid, env)
        assert env.get("SPT_NOENV") == "1", pid
        assert env.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn", pid
        assert env.get("ZE_AFFINITY_MASK") == "1", pid
        assert env.get("FOO") == "bar baz" and env.get("XPT_EMPTY") == "", pid
        assert env.get(TOKEN_VAR) == rig.token, pid  # the caller's environment passes through
    # ZE_AFFINITY_MASK=1: the workers use the second device only
    assert holders(rig.root.node(0)) == []
    assert sorted(holders(rig.root.node(1))) == sorted(workers)

    res = rig.shutdown("contract", "--json", "--kill-after", "1", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    assert res.json["verdict"] == "clean", str(res)
    assert res.json["targets"][0]["devices"] == [BDF1]
    # xpuctl's start to its SIGTERM: within the command's own run (an outcome, not a speed)
    resolve_s = res.json["resolve_seconds"]
    assert 0 < resolve_s <= res.elapsed, (resolve_s, res.elapsed)
    rig.assert_clean()
    rec = rig.record("contract")
    # exit_code: see test_shutdown_keeps_the_exit_code_the_supervisor_recorded (a lost update)
    assert rec["state"] == "stopped" and rec["stopped_at"] >= rec["started_at"], rec


@pytest.mark.parametrize(
    "args,allow_abort,drain,teardown,expected,note",
    [
        ([], False, 1, 1, 5, None),  # drain + teardown = 2: never below 5
        (["--shutdown-timeout", "0"], False, 2, 2, 5, "replaced --shutdown-timeout 0 (abort) with 5s"),
        (["--shutdown-timeout=0"], True, 2, 2, 0, "--shutdown-timeout 0 kept (--allow-abort)"),
        (["--shutdown-timeout", "3"], False, 2, 2, 5, "raised --shutdown-timeout 3 to the 5s minimum"),
        # an explicit timeout replacing serve's drain + teardown is said, not silent
        (["--shutdown_timeout", "9"], False, 2, 2, 9,
         ("--shutdown-timeout 9 given to vLLM replaces serve's 5s (--drain-timeout 2 + "
          "--teardown-timeout 2): vLLM drains and tears down within 9s")),
    ],
    ids=["floor", "zero-replaced", "zero-allowed", "raised", "explicit"],
)
def test_serve_shutdown_timeout_flag(rig, args, allow_abort, drain, teardown, expected, note):
    opts = ["--allow-abort"] if allow_abort else []
    res = rig.serve(*args, opts=opts, drain=drain, teardown=teardown)
    assert res.rc == 0, str(res)
    if note:
        assert f"xpuctl: note: {note}" in res.err, str(res)
    else:
        assert "note:" not in res.err, str(res)
    rec = rig.record(res.name)
    argv = cmdline(rec["pid"])
    flags = [a for a in argv if a.startswith("--shutdown")]
    assert flags == ["--shutdown-timeout"], argv  # the caller's spelling is replaced, not kept
    assert argv[-2:] == ["--shutdown-timeout", str(expected)], argv
    assert rec["shutdown_timeout"] == expected
    assert f"shutdown_timeout={expected}" in rig.run_log(res.name)  # EngineCore's config line
    res2 = rig.shutdown(res.name, "--kill-after", "1", "--release-timeout", "5")
    assert res2.rc == 0, str(res2)
    mode = "abort" if expected == 0 else "drain"
    assert f"[shutdown] API server: stopping engine client mode={mode} timeout={expected}s" \
        in res2.out, str(res2)
    rig.assert_clean()


def test_serve_usage_errors(rig):
    """Exit 2 with one line on stderr, before anything is started."""
    # unknown device: names the devices that exist
    res = rig.serve(opts=["--devices", "7"])
    assert res.rc == 2, str(res)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, str(res)
    assert "unknown device '7'" in lines[0] and BDF0 in lines[0] and BDF1 in lines[0], str(res)
    assert "renderD128" in lines[0] and "renderD129" in lines[0], str(res)

    # an xpuctl option after MODEL
    port = free_port()
    cmd = rig.serve_cmd(["--detach"], port=port, detach=False)
    p = subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=120, cwd=rig.tmp)
    assert p.returncode == 2 and "--detach comes after MODEL" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr
    # --port on both sides of MODEL, with different values
    cmd = rig.serve_cmd(["--port", str(port + 1)], port=port, port_before=True)
    p = subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=120, cwd=rig.tmp)
    assert p.returncode == 2, p.stderr
    assert p.stderr == (f"xpuctl: error: --port {port} before MODEL and --port {port + 1} after it "
                        "disagree: give it once\n"), p.stderr

    # unsafe state directories
    bad = rig.tmp / "bad-state"
    bad.mkdir(mode=0o700)
    def serve_in(state_dir: Path) -> subprocess.CompletedProcess:
        cmd = [*XPUCTL, "--root", rig.root.root, "serve", "--vllm", VLLM_CMD, "--state-dir",
               str(state_dir), "--detach", "fake-model", "--port", str(free_port())]
        return subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=120,
                              cwd=rig.tmp)

    for mode in (0o770, 0o702):
        os.chmod(bad, mode)
        p = serve_in(bad)
        assert p.returncode == 2, p.stderr
        assert f"writable by others (mode {mode:o})" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    if os.geteuid() == 0:
        os.chmod(bad, 0o700)
        os.chown(bad, 65534, 65534)
        p = serve_in(bad)
        assert p.returncode == 2, p.stderr
        assert "owned by uid 65534" in p.stderr, p.stderr
        assert not os.path.exists(bad / "runs")  # refused before anything is written
    assert rig.events() == []  # no vLLM was started
    rig.assert_clean()


def test_port_and_host_before_model_are_read_and_passed_to_vllm_once(rig):
    """`serve --port N --detach MODEL`: the run name, the lock, the readiness URL and vLLM's
    argv all use N, and vLLM gets it exactly once; given on both sides (same value) too."""
    res = rig.serve(port_before=True, opts=["--host", "127.0.0.1"])
    assert res.rc == 0, str(res)
    port = res.port
    assert f"vllm-{port} is ready on port {port}" in res.err, str(res)
    rec = rig.record(f"vllm-{port}")
    assert rec["port"] == port and rec["bind"] == "127.0.0.1"
    argv = cmdline(rec["pid"])
    assert argv[3:] == ["fake-model", "--host", "127.0.0.1", "--port", str(port), "-tp", "2",
                        "--shutdown-timeout", "5"], argv
    assert os.path.exists(os.path.join(rig.state, "locks", f"port-{port}.lock"))
    assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
    assert "'port': " + str(port) in rig.run_log(f"vllm-{port}")  # what vLLM parsed

    supervisor = rec["supervisor_pid"]
    down = rig.shutdown(f"vllm-{port}", "--kill-after", "1", "--release-timeout", "5")
    assert down.rc == 0
    # shutdown returns once the run's supervisor is gone too: its device and port locks are
    # free for the next serve (it used to return first, and the next serve got exit 5)
    assert not running(supervisor), down
    assert f"supervisor {supervisor} exited" in down.out, down

    # both sides, same value: once, in the caller's place after MODEL
    port2 = free_port()
    cmd = rig.serve_cmd(["--port", str(port2)], port=port2, port_before=True)
    p = subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=60, cwd=rig.tmp)
    if rig.foreign_preflight(p.returncode, p.stderr):
        pytest.skip("preflight refused because of another user's processes")
    assert p.returncode == 0, p.stderr
    argv2 = cmdline(rig.record(f"vllm-{port2}")["pid"])
    assert argv2.count("--port") == 1 and argv2[3:6] == ["fake-model", "-tp", "2"], argv2
    assert argv2[argv2.index("--port") + 1] == str(port2)
    assert rig.shutdown(f"vllm-{port2}", "--kill-after", "1", "--release-timeout", "5").rc == 0
    rig.assert_clean()


def test_logs_of_a_detached_run_and_follow_until_shutdown(rig):
    res = rig.serve(name="logged")
    assert res.rc == 0, str(res)
    out = rig.xpuctl("logs", "logged", "--state-dir", rig.state)
    assert out.rc == 0, str(out)
    assert out.out == rig.run_log("logged") and "non-default args" in out.out
    last = rig.xpuctl("logs", "logged", "-n", "1", "--state-dir", rig.state)
    assert last.out == rig.run_log("logged").splitlines(keepends=True)[-1]
    missing = rig.xpuctl("logs", "nobody", "--state-dir", rig.state)
    assert missing.rc == 3 and "no run named 'nobody'" in missing.err and "logged" in missing.err
    out_path = rig.tmp / "follow.out"
    with open(out_path, "wb") as fh:
        follower = subprocess.Popen([*XPUCTL, "--root", rig.root.root, "logs", "logged", "-f",
                                     "--state-dir", rig.state], stdout=fh,
                                    stderr=subprocess.DEVNULL, env=rig.env(), cwd=rig.tmp)
    rig.popens.append(follower)
    assert wait_for(lambda: "non-default args" in out_path.read_text(errors="replace"), 30)
    assert follower.poll() is None
    assert rig.shutdown("logged", "--kill-after", "1", "--release-timeout", "5").rc == 0
    # the supervisor sees vLLM exit, records it and leaves: the follower ends by itself
    assert follower.wait(60) == 0
    assert "[shutdown]" in out_path.read_text(errors="replace")
    rig.assert_clean()


def test_shutdown_writes_one_audit_line_per_signal_and_survives_an_unwritable_log(rig):
    res = rig.serve(name="audited")
    assert res.rc == 0, str(res)
    rec = rig.record("audited")
    out = rig.shutdown("audited", "--json", "--kill-after", "1", "--release-timeout", "5")
    assert out.rc == 0, str(out)
    path = Path(rig.state, "audit.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    e = lines[0]  # the drain: SIGTERM to the top only
    assert (e["action"], e["signal"], e["result"]) == ("signal", "SIGTERM", "sent"), lines
    assert e["target"]["pid"] == rec["pid"] and e["target"]["start_ticks"] == rec["start_ticks"]
    assert all(x["command"] == "shutdown" and x["uid"] == os.getuid() for x in lines)
    # one line per signal the timeline reports (a loaded machine may escalate: more lines)
    sent = [(ev["phase"].split("-")[0].upper(), pid)
            for ev in out.json["events"] if ev["phase"] in ("sigterm", "sigterm-survivors", "sigkill")
            for pid in pids_in(ev["detail"])]
    assert [(x["signal"], x["target"]["pid"]) for x in lines if x["result"] == "sent"] == sent, lines
    assert out.json["audit"] == {"path": str(path), "lines": len(lines), "lost": 0, "error": None}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    # the log cannot be written (a directory in its place): the shutdown goes ahead, and says so
    res = rig.serve(name="audited2")
    assert res.rc == 0, str(res)
    path.unlink()
    path.mkdir()
    out = rig.shutdown("audited2", "--kill-after", "1", "--release-timeout", "5")
    assert out.rc == 0, str(out)
    assert f"xpuctl: warning: audit log {path}: 1 line(s) not written" in out.err, str(out)
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# preflight, locks


def test_preflight_refuses_orphans_force_starts_and_device_shutdown_stops_both(rig):
    # an orphaned fake tree: API server SIGKILLed, EngineCore + workers keep the nodes
    from proctools import start_fake_vllm

    fv = start_fake_vllm(rig.token, rig.root, tp=2, shutdown_timeout=5, workdir=rig.tmp,
                         env={"FAKE_VLLM_EVENTS": str(rig.events_path)})
    rig.popens.append(fv.proc)
    assert fv.wait_ready(), fv.log()
    core, workers = rig.tree(fv.pid)
    fv.proc.kill()
    fv.proc.wait(30)
    time.sleep(0.2)
    assert not is_gone(core) and all(not is_gone(w) for w in workers)
    assert sorted(holders(rig.root.node(0)) + holders(rig.root.node(1))) == sorted(workers)

    res = rig.serve(name="refused", retry_foreign=False)
    assert res.rc == 1, str(res)
    assert "xpuctl: preflight fail orphans: orphaned vLLM processes" in res.err, str(res)
    assert str(core) in res.err and all(str(w) in res.err for w in workers), str(res)
    assert f"xpuctl:   fix: xpuctl shutdown --pid {core}" in res.err, str(res)
    assert "preflight failed" in res.err and "--force" in res.err, str(res)
    assert not os.path.exists(os.path.join(rig.state, "runs", "refused.json"))
    assert sorted(rig.alive()) == sorted([core, *workers])  # nothing new started

    res = rig.serve(name="forced", opts=["--force"])
    assert res.rc == 0, str(res)
    api = rig.record("forced")["pid"]

    # --device of our own root: finds the orphans and the forced run (never others' servers)
    res = rig.shutdown("--device", "0", "--device", "1", "--json", "--kill-after", "1",
                       "--release-timeout", "5")
    assert res.rc == 0, str(res)
    data = res.json
    tops = {t["top"]: t for t in data["targets"]}
    assert set(tops) == {core, api}, data["targets"]
    assert tops[core]["orphan"] is True and tops[core]["role"] == "engine-core"
    assert sorted(tops[core]["processes"]) == sorted([core, *workers])
    assert tops[api]["name"] == "forced" and tops[api]["orphan"] is False
    assert data["verdict"] == "clean", data
    assert f"{BDF0}, {BDF1} released" in event_of(res, "released")["detail"]
    # the orphaned EngineCore got one SIGTERM (from xpuctl), its workers none: the death pipe
    assert rig.signals(core) == ["SIGTERM"]
    assert all(rig.signals(w) == [] and rig.exits(w) == [0] for w in workers)
    rig.assert_clean()


_FOREIGN_ORPHAN = r"""
import os, socket, sys, time
node, out = sys.argv[1:3]
if os.fork():
    os._exit(0)  # the parent exits at once: the child is an orphan, like a left-over EngineCore
import setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
fd = os.open(node, os.O_RDWR)
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(4)  # real vLLM orphans keep their ZMQ/gloo TCP listeners
with open(out + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {s.getsockname()[1]}")
os.rename(out + ".tmp", out)
time.sleep(120)
"""


def test_preflight_ignores_orphan_listeners_off_the_requested_device_and_port(rig):
    """An orphaned EngineCore on device 1 that listens on some TCP port must not block a
    server on device 0 and another port (a multi-GPU host after a crash on one GPU).

    Regression: the preflight 'ports' check failed on every orphaned tree's TCP listeners,
    whatever devices it held and whatever port it listened on, while the 'orphans' check
    already scoped the same tree to the requested devices."""
    out = rig.tmp / "orphan.info"
    helper = subprocess.Popen([PY, "-c", _FOREIGN_ORPHAN, rig.root.node(1), str(out)],
                              env=rig.env(), start_new_session=True, stdin=subprocess.DEVNULL)
    rig.popens.append(helper)
    helper.wait(60)  # deadlines for a machine three times slower than this one, loaded
    assert wait_for(out.exists, 60)
    orphan, orphan_port = map(int, out.read_text().split())
    try:
        assert cmdline(orphan)[0] == "VLLM::EngineCore" and holders(rig.root.node(1)) == [orphan]
        assert port_listening(orphan_port)
        doc = rig.xpuctl("doctor", "--device", "1", "--json")
        assert any(f["check"] == "orphans" and orphan in f["pids"] for f in doc.json["findings"]), str(doc)

        res = rig.serve(name="gpu0", opts=["--devices", "0"], retry_foreign=False)
        if res.rc == 0:
            assert rig.shutdown("gpu0", "--release-timeout", "5").rc == 0
    finally:
        rig.kill_mine(orphan)
        assert wait_for(lambda: is_gone(orphan), 5)
    refused = [line for line in res.err.splitlines()
               if line.startswith("xpuctl: preflight fail") and str(orphan) in line]
    # was: "xpuctl: preflight fail ports: orphaned vLLM processes of tree N still listen on
    # port(s) Q" and exit 1
    assert refused == [], str(res)
    assert res.rc == 0, str(res)
    rig.assert_clean()


def test_locks_refuse_a_second_run_on_the_same_device_or_port(rig):
    a = rig.serve(name="a", opts=["--devices", "0"])
    assert a.rc == 0, str(a)
    n_started = len([e for e in rig.events() if e["event"] == "start"])
    assert n_started == 4

    b = rig.serve(name="b", opts=["--devices", "0"])  # another port, same device
    assert b.rc == 5, str(b)
    assert f"device-{BDF0} is already claimed by another xpuctl run" in b.err, str(b)
    c = rig.serve(name="c", port=a.port, opts=["--devices", "1"])  # same port, other device
    assert c.rc == 5, str(c)
    assert f"port-{a.port} is already claimed" in c.err, str(c)
    d = rig.serve(name="a", opts=["--devices", "1"])  # same name
    assert d.rc == 5 and "run-a is already claimed" in d.err, str(d)
    assert len([e for e in rig.events() if e["event"] == "start"]) == n_started  # none started
    assert rig.record("a")["state"] == "ready"

    res = rig.shutdown("a", "--kill-after", "1", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    rig.assert_clean()
    # the locks die with the supervisor: the device is free to claim again
    b = rig.serve(name="b", opts=["--devices", "0"])
    assert b.rc == 0, str(b)
    assert rig.shutdown("b", "--release-timeout", "5").rc == 0
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# readiness


def test_ready_timeout_hang_startup(rig):
    """Issue 10: a start hung after backend=xccl, short budgets. Exit 4, the diagnosis and
    the advice on the terminal (not only in the log), stopped with the teardown budget only
    (no drain wait), nothing left behind, and doctor's `last-run` advice afterwards."""
    # the deadline must leave the hung workers time to reach oneCCL init (about a second
    # here) on a slow, loaded machine, or the diagnosis names an earlier stage
    ready, teardown, kill_after = 15, 4, 2
    # vLLM's own grace for its workers (serve would pass 1 s for this budget) kept long, so
    # that xpuctl's ladder, not EngineCore's, is what stops the hung workers here
    res = rig.serve(name="hung", ready=ready, teardown=teardown, kill_after=kill_after,
                    drain=30, env={"FAKE_VLLM_FAULTS": "hang-startup",
                                   "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"})
    assert res.rc == 4, str(res)
    # the bound: ready + teardown + kill-after, plus a generous slack for start-up, the
    # diagnosis and a loaded machine (the drain budget, 30 s here, is never waited)
    assert ready <= res.elapsed < ready + teardown + kill_after + 25, res.elapsed
    assert "not ready in time" in res.err, str(res)
    err = res.err
    assert f"not ready after {ready}s; stuck in: oneCCL init (xccl)" in err, str(res)
    assert "| " in err and "backend=xccl" in err, str(res)  # the last log lines
    assert "before the next launch, try" in err and "CCL_ALLREDUCE=ring" in err, str(res)
    assert re.search(r"teardown +never ready, nothing to drain: waiting up to 4s", err), str(res)
    assert not re.search(r"\bdrain +waiting", err), str(res)
    log = rig.run_log("hung")
    assert "backend=xccl" in log
    assert f"not ready after {ready}s; stuck in: oneCCL init (xccl)" in log, log
    rec = rig.record("hung")
    assert rec["state"] == "failed" and rec["exit_code"] == 4, rec
    assert any("oneCCL init" in n for n in rec["notes"]), rec
    _core, workers = rig.tree(rec["pid"])
    assert len(workers) == 2
    # the hung workers never got ready and never exited by themselves: they were SIGKILLed
    ev = rig.events()
    assert not [e for e in ev if e["event"] == "ready"]
    assert all(rig.exits(w) == [] for w in workers)
    rig.assert_clean()
    assert http_get(f"http://127.0.0.1:{res.port}/health", 0.5)[0] is None

    # the relaunch advice: doctor and reset find the run in the state directory
    doc = rig.xpuctl("doctor", "--json", "--state-dir", rig.state)
    found = [f for f in doc.json["findings"] if f["check"] == "last-run"]
    assert len(found) == 1 and found[0]["severity"] == "warn", doc.out
    assert "hung was not ready in time (stuck in: oneCCL init (xccl))" in found[0]["message"]
    assert "CCL_ZE_IPC_EXCHANGE=drmfd|sockets" in found[0]["remedy"]
    plan = rig.xpuctl("reset", "--dry-run", "--state-dir", rig.state)
    assert "warn last-run: the last run hung" in plan.out, str(plan)

    # issue 17 item 3: the hung start's stop is in the audit log, every signal the timeline
    # shows, sent by the --detach supervisor (its own pid) under the command "serve"
    lines = audit_lines(rig)
    assert lines and all(e["command"] == "serve" for e in lines), lines
    assert {e["xpuctl_pid"] for e in lines} == {rec["supervisor_pid"]}, lines
    sent = [(e["signal"], e["target"]["pid"]) for e in lines if e["result"] == "sent"]
    assert sent[0] == ("SIGTERM", rec["pid"]), lines  # the top first
    assert {pid for sig, pid in sent if sig == "SIGKILL"} >= set(workers), lines
    shown = [(ph.split("-")[0].upper(), pid) for ph, detail in
             re.findall(r"^xpuctl: +\d+\.\d+s +(sigterm|sigterm-survivors|sigkill) +(.*)$", log, re.M)
             for pid in pids_in(detail)]
    assert sorted(sent) == sorted(shown), (sent, shown)  # one line per signal shown

    # issue 17 item 4: the next serve shows that advice, with costs, before it launches
    nxt = rig.serve(name="next")
    assert nxt.rc == 0, str(nxt)
    err = nxt.err
    advice_at = err.find("xpuctl: preflight warn last-run: the last run hung was not ready in time")
    assert advice_at >= 0, str(nxt)
    assert advice_at < err.find("xpuctl: next: supervisor"), str(nxt)
    for setting in ("xpuctl reset", "CCL_ZE_CACHE_OPEN_IPC_HANDLES=0", "CCL_ALLREDUCE=ring"):
        assert re.search(rf"^xpuctl:   - {re.escape(setting)}: .*\(cost: .+\)$", err, re.M), str(nxt)
    assert rig.shutdown("next", "--release-timeout", "5").rc == 0
    rig.assert_clean()
    # a run that went well leaves no advice for the one after it
    again = rig.serve(name="again")
    assert again.rc == 0 and "last-run" not in again.err, str(again)
    assert rig.shutdown("again", "--release-timeout", "5").rc == 0
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# foreground serve


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_foreground_signal_stops_cleanly(rig, sig):
    fg = rig.serve_bg()
    wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    core, workers = rig.tree(api)
    assert "Application startup complete." in fg.out()  # vLLM's output is streamed
    fg.proc.send_signal(sig)
    assert fg.proc.wait(60) == 0, str(fg)
    err = fg.err()
    assert "stopping (signal received" in err and "xpuctl: stopped: clean" in err, str(fg)
    # vLLM's own lines once: echoed on stdout, left out of the timeline on stderr (issue 32)
    assert "[shutdown] EngineCore: shutdown complete" in fg.out(), str(fg)
    assert "[shutdown]" not in err, str(fg)
    assert rig.signals(api) == ["SIGTERM"]  # the signal became one SIGTERM to the top
    assert rig.signals(core) == ["SIGTERM"] and all(rig.signals(w) == [] for w in workers)
    rec = rig.record(fg.name)
    assert rec["state"] == "stopped" and rec["exit_code"] == 0, rec
    # serve's own stop is audited (issue 17 item 3): the one SIGTERM, by the foreground serve
    sent = [(e["command"], e["xpuctl_pid"], e["signal"], e["target"]["pid"])
            for e in audit_lines(rig) if e["result"] == "sent"]
    assert sent == [("serve", fg.proc.pid, "SIGTERM", api)], sent
    rig.assert_clean()


def test_foreground_second_sigint_skips_to_kill(rig):
    # a drain of 600 s: without the skip the supervisor would still be waiting when the
    # wait below gives up, so an exit at all proves the second Ctrl-C skipped the wait
    fg = rig.serve_bg(drain=600, env={"FAKE_VLLM_FAULTS": "ignore-sigterm"})
    wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    fg.proc.send_signal(signal.SIGINT)
    assert wait_for(lambda: rig.signals(api) == ["SIGTERM"], 30), str(fg)
    time.sleep(0.5)
    assert fg.proc.poll() is None and not is_gone(api)  # waiting for the drain
    fg.proc.send_signal(signal.SIGINT)
    rc = fg.proc.wait(120)
    assert rc == 0, str(fg)
    err = fg.err()
    assert "second interrupt: killing the tree now" in err, str(fg)
    # the kill came from the second interrupt, not from the ladder running out of time
    assert not re.search(r"\d\.\d+s\s+(timeout|sigterm-survivors)\s", err), str(fg)
    assert re.search(rf"sigkill\s+SIGKILL to .*\b{api} \(", err), str(fg)
    assert rig.signals(api) == ["SIGTERM"] and rig.exits(api) == []
    rig.assert_clean()


def test_foreground_crash_engine_exit_code(rig):
    # report: the watch would stop the run whose engine died (exit 7, test_serve_watch.py)
    fg = rig.serve_bg(opts=["--on-unhealthy", "report"],
                      env={"FAKE_VLLM_FAULTS": "crash-engine", "FAKE_VLLM_CRASH_AFTER": "0.5",
                           "FAKE_VLLM_ENGINE_DEAD_EXIT_S": "0.5"})
    rc = fg.proc.wait(120)
    assert rc == 1, str(fg)
    assert "xpuctl: vLLM exited with code 1" in fg.err(), str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] == "failed" and rec["exit_code"] == 1, rec
    core, workers = rig.tree(rec["pid"])
    assert rig.exits(core) == [1] and all(rig.exits(w) == [0] for w in workers)
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# the start as it happens (issue 12)

FAKE_PHASES = ["engine start", "oneCCL init (xccl)", "loading model", "KV cache + warm-up",
               "API server start"]


def test_serve_detach_not_a_terminal_one_line_per_phase(rig):
    res = rig.serve(name="phases", env={"FAKE_VLLM_PHASE_S": "0.3"})
    assert res.rc == 0, str(res)
    assert "\x1b" not in res.err and "\r" not in res.err, repr(res.err)
    lines = [ln for ln in res.err.splitlines() if ln.startswith("xpuctl: phases: ")
             and re.match(r"xpuctl: phases: +\d+\.\d+s ", ln)]
    names = [re.sub(r"^xpuctl: phases: +\d+\.\d+s ", "", ln) for ln in lines]
    assert names == FAKE_PHASES, str(res)  # each phase once, in order
    secs = [float(re.search(r"(\d+\.\d+)s", ln).group(1)) for ln in lines]
    assert secs == sorted(secs), lines
    ready = [ln for ln in res.err.splitlines() if "phases is ready on port" in ln]
    assert len(ready) == 1, str(res)
    summary = ready[0].split(": ", 2)[-1]
    for label in ["starting", *FAKE_PHASES]:
        assert re.search(rf"\b{re.escape(label)} \d+\.\d+s", summary), ready[0]
    assert res.err.index(lines[-1]) < res.err.index(ready[0])
    # the record knows when it became ready; ps shows the run, its state and age
    rec = rig.record("phases")
    assert rec["ready_at"] >= rec["started_at"], rec
    ps = rig.xpuctl("ps", "--json", "--state-dir", rig.state)
    runs = {r["name"]: r for r in ps.json["runs"]}
    assert runs["phases"]["state"] == "ready" and runs["phases"]["age_seconds"] > 0, ps.out
    table = rig.xpuctl("ps", "--state-dir", rig.state)
    assert re.search(r"^phases +ready +\d+s +\d+ ", table.out, re.M), table.out
    assert rig.shutdown("phases", "--release-timeout", "5").rc == 0
    rig.assert_clean()


def test_serve_on_a_terminal_redraws_one_status_line(rig):
    """Through a pty, as a person sees it: the status line is redrawn in place, and replaced
    by the one-line summary when the server is ready."""
    import pty

    port = free_port()
    cmd = rig.serve_cmd(port=port, opts=["--name", "tty"])
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, env=rig.env(FAKE_VLLM_PHASE_S="0.4", COLUMNS="100"),
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                cwd=rig.tmp, start_new_session=True)
        rig.popens.append(proc)
    finally:
        os.close(slave)
    out = read_pty(master)
    rc = proc.wait(120)
    assert rc == 0, out
    frames = out.split("\r\x1b[2K")
    status = [f for f in frames if f.startswith("xpuctl: tty ") and " is ready " not in f]
    assert len(status) >= 5, out  # redrawn, in place
    shown = [next((p for p in FAKE_PHASES if p in f), None) for f in status]
    seen = [p for i, p in enumerate(shown) if p and p not in shown[:i]]
    assert seen == [p for p in FAKE_PHASES if p in seen] and len(seen) >= 3, seen
    assert all(len(f.split("\r\n")[0].split("\n")[0]) <= 99 for f in status), status
    tail = frames[-1]
    assert re.match(r"xpuctl: tty is ready on port \d+ \(http://[^)]+\) after \d+\.\d+s: starting ",
                    tail), repr(tail)
    assert "\x1b" not in tail and "\r\x1b[2K" not in tail
    assert rig.shutdown("tty", "--release-timeout", "5").rc == 0
    rig.assert_clean()


def test_shutdown_of_a_run_still_starting_skips_the_drain(rig):
    """A record that says `starting`: SIGTERM, the teardown budget, SIGTERM survivors,
    SIGKILL after --kill-after; never the drain budget (drain 30 s here)."""
    # vLLM's own grace for its workers kept long (serve would pass 1 s for a 3 s budget), so
    # that xpuctl's ladder, not EngineCore's, is what stops the hung workers here
    fg = rig.serve_bg(detach=True, ready=120, drain=30, teardown=3,
                      env={"FAKE_VLLM_FAULTS": "hang-startup",
                           "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"})
    assert wait_for(lambda: rig.run_log(fg.name).count("backend=xccl") == 2, 20), rig.run_log(fg.name)
    ps = rig.xpuctl("ps", "--json", "--state-dir", rig.state)
    assert [r["state"] for r in ps.json["runs"] if r["name"] == fg.name] == ["starting"], ps.out
    res = rig.shutdown(fg.name, "--json", "--kill-after", "1", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    assert "drain" not in phases(res), str(res)
    teardown = event_of(res, "teardown")
    assert "waiting up to 3s" in teardown["detail"], teardown
    assert_subsequence(phases(res), ["sigterm", "teardown", "timeout", "sigterm-survivors",
                                     "sigkill", "exited", "verdict"])
    assert event_of(res, "sigkill")["t"] < 3 + 1 + 20, str(res)  # nowhere near 30 + 3 + 10
    # a stop that was asked for, during start-up: 0 once released (docs/serve-exits.md)
    assert fg.proc.wait(120) == 0, str(fg)
    assert "was stopped before it was ready (a stop was asked for" in fg.err(), str(fg)
    rig.assert_clean()


def test_serve_quiet_shows_no_phases(rig):
    res = rig.serve(name="hush", opts=["--quiet"])
    assert res.rc == 0, str(res)
    assert not re.search(r"^xpuctl: hush: +\d+\.\d+s ", res.err, re.M), str(res)
    assert "hush is ready on port" in res.err, str(res)
    assert rig.shutdown("hush", "--release-timeout", "5").rc == 0
    rig.assert_clean()


def test_foreground_hung_start_is_diagnosed_on_the_terminal(rig):
    fg = rig.serve_bg(ready=4, teardown=2, kill_after=1, drain=30,
                      env={"FAKE_VLLM_FAULTS": "hang-startup"})
    rc = fg.proc.wait(4 + 2 + 1 + 30)
    assert rc == 4, str(fg)
    err = fg.err()
    assert re.search(rf"^xpuctl: {fg.name}: +\d+\.\d+s oneCCL init \(xccl\)$", err, re.M), str(fg)
    assert "not ready after 4s; stuck in: oneCCL init (xccl)" in err, str(fg)
    assert "CCL_KVS_IFACE=lo" in err and "never ready, nothing to drain" in err, str(fg)
    assert "backend=xccl" in fg.out()  # vLLM's own output still goes to stdout
    rig.assert_clean()
    # the foreground serve's stop of its hung start, in the audit log (issue 17 item 3)
    lines = audit_lines(rig)
    assert {(e["command"], e["xpuctl_pid"]) for e in lines} == {("serve", fg.proc.pid)}, lines
    sent = [(e["signal"], e["target"]["pid"]) for e in lines if e["result"] == "sent"]
    assert sent[0] == ("SIGTERM", rig.record(fg.name)["pid"]) and {"SIGKILL"} <= {s for s, _ in sent}, lines


def test_a_detached_serve_leaves_no_reader_behind(rig):
    """The bounded reader of the `serve --detach` that returned goes with it: the forked
    supervisor closes its copies of that reader's pipes (it starts its own), so no stray
    process titled like `xpuctl serve` outlives the command (seen with real vLLM)."""
    res = rig.serve(name="noreader")
    assert res.rc == 0, str(res)
    supervisor = rig.record("noreader")["supervisor_pid"]

    def strays() -> list[int]:
        out = []
        for pid in pids_with_token(rig.token):
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    comm = fh.read().strip()
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    st = fh.read()
            except OSError:
                continue
            ppid = int(st[st.rfind(b")") + 2:].split()[1])
            if comm == "xpuctl-reader" and ppid != supervisor:
                out.append(pid)
        return out

    assert wait_for(lambda: not strays(), 15, 0.1), strays()
    assert rig.shutdown("noreader", "--kill-after", "1", "--release-timeout", "5").rc == 0
    rig.assert_clean()

# ---------------------------------------------------------------------------------------------
# last, so that `-x` runs everything else first: it fails while the race below exists


def test_concurrent_detached_serves_on_one_device(rig):
    """Two `serve --detach` claiming one device at the same moment: one runs, the other
    exits 5 (LOCKED).

    The detaching parent checks the locks and releases them before it forks; the supervisor
    child takes them again. When the other parent's check falls between the two, the lock is
    refused only in the child, which reports "supervisor failed: error ... already claimed"
    and exit 1 instead of 5 (about 2 rounds in 5 here, so a few rounds make it likely)."""
    for rnd in range(5):
        names = [f"c{rnd}a", f"c{rnd}b"]
        procs = []
        for name in names:  # --force: the preflight would see the other one starting
            cmd = rig.serve_cmd(port=free_port(), opts=["--name", name, "--devices", "0",
                                                         "--force"], tp=1)
            procs.append(subprocess.Popen(cmd, env=rig.env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          stdin=subprocess.DEVNULL, cwd=rig.tmp))
        rig.popens.extend(procs)
        outs = [p.communicate(timeout=180) for p in procs]
        codes = [p.returncode for p in procs]
        for name, code in zip(names, codes, strict=True):
            if code == 0:
                assert rig.shutdown(name, "--release-timeout", "5").rc == 0
        rig.assert_clean()
        detail = "; ".join(f"{n}: rc={c} {o[1].strip().splitlines()[-1] if o[1].strip() else ''}"
                           for n, c, o in zip(names, codes, outs, strict=True))
        assert sorted(codes) == [0, 5], f"round {rnd}: {detail}"
    starts = [e for e in rig.events() if e["event"] == "start" and e["role"] == "api-server"]
    assert len(starts) == 5  # exactly one server per round
