"""End-to-end tests of `xpuctl shutdown` against the fake vLLM: the ladder (drain, escalation,
release), orphans, the run's recorded exit, targets. The serve side is in test_serve.py.

Everything runs for real (the rig: tests/support/serverig.py, its fixture in
tests/support/proc_fixtures.py). Nothing here signals a process the test did not start:
``shutdown --all`` only ever runs inside a private PID namespace (other engineers' vLLM
processes are visible through /proc otherwise).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest
from proctools import (
    free_port,
    holders,
    http_get,
    http_post,
    is_gone,
    metric,
    pidns_available,
    ppid_of,
    sid_of,
    wait_for,
)
from serverig import (
    BDF0,
    BDF1,
    PY,
    SUPPORT_DIR,
    assert_subsequence,
    audit_lines,
    event_of,
    phases,
    pids_in,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# the shutdown ladder


def test_clean_drain_with_request_in_flight(rig):
    # drain 60: the request below is sized from this run, and vLLM's deadline must not cut it
    res = rig.serve(drain=60)
    assert res.rc == 0, str(res)
    name, url = res.name, f"http://127.0.0.1:{res.port}"
    api = rig.record(name)["pid"]
    core, workers = rig.tree(api)

    # --dry-run: the plan, nothing sent
    dry = rig.shutdown(name, "--dry-run")
    assert dry.rc == 0, str(dry)
    assert f"would stop {name}: SIGTERM api-server {api}" in dry.out, str(dry)
    dry = rig.shutdown(name, "--dry-run", "--json")
    assert dry.rc == 0 and dry.json["dry_run"] is True and dry.json["events"] == [], str(dry)
    # the request must still run when the real shutdown's SIGTERM lands: it lasts several
    # times what a dry run (the same resolution, no signal) took in this run
    request_s = round(max(1.5, 5 * dry.elapsed), 2)
    assert sorted(dry.json["targets"][0]["processes"]) == sorted([api, core, *workers])
    time.sleep(0.3)
    assert [e for e in rig.events() if e["event"] == "signal"] == []
    assert http_get(url + "/health")[0] == 200

    results: list = []
    t_request = time.time()
    t = threading.Thread(target=lambda: results.append(http_post(
        url + "/v1/completions", {"model": "fake-model", "prompt": "hi", "fake_seconds": request_s},
        timeout=120)), daemon=True)
    t.start()
    assert wait_for(lambda: metric(http_get(url + "/metrics")[1], "vllm:num_requests_running") == 1.0, 30)

    res = rig.shutdown(name, "--json", "--kill-after", "1", "--release-timeout", "5")
    t.join(120)
    assert res.rc == 0, str(res)
    data = res.json
    assert data["verdict"] == "clean", data
    ph = phases(res)
    assert_subsequence(ph, ["sigterm", "drain", "exited", "released", "verdict"])
    assert not {"timeout", "sigterm-survivors", "sigkill"} & set(ph), ph
    assert pids_in(event_of(res, "sigterm")["detail"]) == [api]
    assert ph.count("sigterm") == 1
    assert "1 request(s) running or waiting" in event_of(res, "in-flight")["detail"]
    vllm_lines = [e["detail"] for e in data["events"] if e["phase"] == "vllm"]
    assert "[shutdown] EngineCore: draining in-flight requests count=1" in vllm_lines, vllm_lines
    assert "[shutdown] API server: shutting down FastAPI HTTP server" in vllm_lines
    assert rig.exits(api) == [0]
    t_exit = next(e["t"] for e in rig.events() if e["pid"] == api and e["event"] == "exit")
    # the server stayed up until the request was done
    assert t_exit >= t_request + request_s - 0.1, (t_exit - t_request, request_s)
    assert data["survivors"] == [] and data["holders"] == [] and data["ports_busy"] == []

    # the request finished normally
    assert results and results[0][0] == 200, results
    assert results[0][1]["choices"][0]["finish_reason"] == "length", results

    # signals: xpuctl SIGTERMed the API server only; EngineCore got its SIGTERM afterwards
    # (from the API server's engine client); the workers stopped through the death pipe
    assert rig.signals(api) == ["SIGTERM"]
    assert rig.signals(core) == ["SIGTERM"]
    assert rig.signal_times(core)[0] > rig.signal_times(api)[0]
    assert all(rig.signals(w) == [] for w in workers)
    assert all(rig.exits(p) == [0] for p in (api, core, *workers))
    rig.assert_clean()
    rec = rig.record(name)
    assert rec["state"] == "stopped", rec  # exit_code: see the lost-update test below


def test_escalation_when_the_api_server_ignores_sigterm(rig):
    # the API server would exit by itself 1 s after its engine died: keep it up until killed
    res = rig.serve(env={"FAKE_VLLM_FAULTS": "ignore-sigterm", "FAKE_VLLM_ENGINE_DEAD_EXIT_S": "30"})
    assert res.rc == 0, str(res)
    api = rig.record(res.name)["pid"]
    core, workers = rig.tree(api)

    # --kill-after 6: EngineCore and the workers stop on their SIGTERM (a fraction of a second
    # here) well before the SIGKILL, even on a slow, loaded machine
    res = rig.shutdown(res.name, "--json", "--timeout", "1", "--kill-after", "6",
                       "--release-timeout", "5")
    assert res.rc == 0, str(res)
    assert res.json["verdict"] == "escalated", str(res)
    ph = phases(res)
    assert_subsequence(ph, ["sigterm", "drain", "timeout", "sigterm-survivors", "sigkill",
                            "exited", "released", "verdict"])
    first, surv, kill = (event_of(res, p) for p in ("sigterm", "sigterm-survivors", "sigkill"))
    assert pids_in(first["detail"]) == [api]
    assert pids_in(surv["detail"]) == sorted([api, core, *workers])
    assert pids_in(kill["detail"]) == [api]  # the others stopped on their SIGTERM
    assert surv["t"] - first["t"] >= 0.95  # --timeout 1
    assert kill["t"] - surv["t"] >= 5.95  # --kill-after 6

    # the event log: the order of signals as the processes saw them
    t_api = rig.signal_times(api)
    assert rig.signals(api) == ["SIGTERM", "SIGTERM"]
    assert rig.signals(core) == ["SIGTERM"] and all(rig.signals(w) == ["SIGTERM"] for w in workers)
    assert rig.signal_times(core)[0] - t_api[0] >= 0.9  # nobody else was signalled at first
    assert all(rig.signal_times(w)[0] - t_api[0] >= 0.9 for w in workers)
    assert rig.exits(api) == []  # SIGKILLed
    assert rig.exits(core) == [0] and all(rig.exits(w) == [0] for w in workers)
    rig.assert_clean()


def test_worker_ignoring_sigterm_still_stops_cleanly(rig):
    """xpuctl never signals workers in a clean stop: vLLM's own teardown stops them."""
    # a 10 s teardown budget: vLLM waits 5 s for its workers (serve's VLLM_WORKER_SHUTDOWN_
    # TIMEOUT_SECONDS), room for a loaded machine before its own SIGTERM
    res = rig.serve(teardown=10, env={"FAKE_VLLM_FAULTS": "worker-ignores-sigterm"})
    assert res.rc == 0, str(res)
    name, api = res.name, rig.record(res.name)["pid"]
    _core, workers = rig.tree(api)
    # by port this time: the server listening there, tied to its run record
    res = rig.shutdown("--port", str(res.port), "--json", "--kill-after", "1",
                       "--release-timeout", "5")
    assert res.rc == 0 and res.json["verdict"] == "clean", str(res)
    assert [(t["name"], t["top"]) for t in res.json["targets"]] == [(name, api)]
    assert "[shutdown] Executor: all workers exited gracefully" in [
        e["detail"] for e in res.json["events"] if e["phase"] == "vllm"]
    assert all(rig.signals(w) == [] and rig.exits(w) == [0] for w in workers)
    assert rig.signals(api) == ["SIGTERM"]
    rig.assert_clean()


def test_slow_teardown_within_the_shutdown_timeout_is_clean(rig):
    """A 2.5 s worker teardown fits in --shutdown-timeout 22 (drain 2 + teardown 20, room for
    a slow, loaded machine): xpuctl waits, sends nothing more."""
    res = rig.serve(teardown=20,
                    env={"FAKE_VLLM_FAULTS": "slow-teardown", "FAKE_VLLM_TEARDOWN_S": "2.5"})
    assert res.rc == 0, str(res)
    name, api = res.name, rig.record(res.name)["pid"]
    _core, workers = rig.tree(api)
    # by the pid of any process of the server (a worker): the whole server is stopped
    res = rig.shutdown("--pid", str(workers[1]), "--json", "--kill-after", "1",
                       "--release-timeout", "5")
    assert res.rc == 0 and res.json["verdict"] == "clean", str(res)
    assert [(t["name"], t["top"]) for t in res.json["targets"]] == [(name, api)]
    assert pids_in(event_of(res, "sigterm")["detail"]) == [api]  # the top, not the worker
    assert event_of(res, "exited")["t"] >= 2.4
    details = [e["detail"] for e in res.json["events"] if e["phase"] == "vllm"]
    assert "XPUWorker shutdown: done (rank=1, local_rank=1)" in details, details
    assert not any("force killing" in d for d in details), details
    ev = rig.events()
    assert all(any(e["pid"] == w and e["event"] == "teardown-done" for e in ev) for w in workers)
    assert all(rig.signals(w) == [] for w in workers)
    rig.assert_clean()


def test_slow_teardown_past_the_deadline_is_killed(rig):
    """Teardown longer than --timeout: survivors get SIGTERM (ignored mid-teardown), then SIGKILL.

    --timeout 5: the workers are well into their teardown when the survivors' SIGTERM lands
    (they start it a fraction of a second after the first SIGTERM here); vLLM's own deadline
    (drain 30 + teardown 30) comes long after xpuctl's escalation, and so does EngineCore's
    own grace for its workers (60 s here, 5 s by default)."""
    res = rig.serve(drain=30, teardown=30,
                    env={"FAKE_VLLM_FAULTS": "slow-teardown", "FAKE_VLLM_TEARDOWN_S": "120",
                         "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"})
    assert res.rc == 0, str(res)
    api = rig.record(res.name)["pid"]
    _core, workers = rig.tree(api)
    res = rig.shutdown(res.name, "--json", "--timeout", "5", "--kill-after", "1",
                       "--release-timeout", "5")
    assert res.rc == 0, str(res)
    assert res.json["verdict"] == "escalated", str(res)
    assert_subsequence(phases(res), ["sigterm", "timeout", "sigterm-survivors", "sigkill",
                                     "exited", "released"])
    killed = pids_in(event_of(res, "sigkill")["detail"])
    assert set(workers) <= set(killed), (killed, workers)
    assert all(rig.signals(w) == ["SIGTERM"] for w in workers)  # one, ignored during teardown
    ev = rig.events()
    assert not any(e["event"] == "teardown-done" for e in ev)
    assert all(rig.exits(w) == [] for w in workers)
    rig.assert_clean()


def test_setsid_worker_found_by_run_id_after_the_supervisor_died(rig):
    """The supervisor is SIGKILLed mid-start-up, EngineCore too: the hung workers are left,
    one of them in its own session; `shutdown NAME` finds both by the run id and kills them."""
    fg = rig.serve_bg(detach=True, ready=60,
                      env={"FAKE_VLLM_FAULTS": "hang-startup,setsid-worker,ignore-sigterm"})
    assert wait_for(lambda: rig.run_log(fg.name).count("backend=xccl") == 2, 60), rig.run_log(fg.name)
    rec = rig.record(fg.name)
    api, sup = rec["pid"], rec["supervisor_pid"]
    core, (w0, w1) = rig.tree(api)
    assert sid_of(w0) == w0 and sid_of(w1) == api == sid_of(core)  # w0 left the session

    rig.kill_mine(sup)
    assert fg.proc.wait(60) == 1  # `serve --detach` reports the lost supervisor
    assert "supervisor failed" in fg.err(), str(fg)
    # the parent-death signal (ignored); the kernel may send it once per exiting supervisor
    # thread the API server gets reparented to, so one or more
    assert wait_for(lambda: rig.signals(api)[:1] == ["SIGTERM"], 30)
    assert set(rig.signals(api)) == {"SIGTERM"}
    rig.kill_mine(core)
    assert wait_for(lambda: is_gone(api), 30)  # the API server gives up without its engine
    time.sleep(0.2)
    assert not is_gone(w0) and not is_gone(w1)
    assert sorted(rig.alive()) == sorted([w0, w1])

    dry = rig.shutdown(fg.name, "--dry-run", "--json")
    assert dry.rc == 0, str(dry)
    assert sorted(p for t in dry.json["targets"] for p in t["processes"]) == sorted([w0, w1]), str(dry)

    res = rig.shutdown(fg.name, "--json", "--timeout", "1", "--kill-after", "1",
                       "--release-timeout", "5")
    assert res.rc == 0, str(res)
    assert res.json["verdict"] == "escalated", str(res)
    assert sorted(pids_in(event_of(res, "sigkill")["detail"])) == sorted([w0, w1])
    assert all(rig.exits(w) == [] for w in (w0, w1))
    rig.assert_clean()
    # its end was unclean before the shutdown (supervisor, EngineCore and API server gone):
    # stopping what was left keeps it so, and the next launch runs the collective check
    rec = rig.record(fg.name)
    assert rec["state"] == "failed", rec
    assert rec["reason"].startswith("ended uncleanly before the shutdown: "), rec


def test_serve_stops_the_orphans_of_its_killed_api_server(rig):
    """vLLM #55510: a SIGKILLed API server leaves EngineCore and workers holding the GPU. The
    supervisor (a child subreaper) inherits them, stops them and records the failure."""
    res = rig.serve(name="oom")
    assert res.rc == 0, str(res)
    rec = rig.record("oom")
    api, sup = rec["pid"], rec["supervisor_pid"]
    core, workers = rig.tree(api)
    rig.kill_mine(api)  # the OOM killer
    # (the API server's other threads may still be exiting when its leader is a zombie:
    # until the last one is gone, EngineCore's ppid still names the API server)
    assert wait_for(lambda: is_gone(api) and ppid_of(core) != api, 30)
    # the orphaned EngineCore was reparented to the supervisor (a child subreaper), not to
    # PID 1 (None: the supervisor already stopped and reaped it)
    assert ppid_of(core) in (sup, None), (ppid_of(core), sup)
    rig.assert_clean(timeout=60)
    log = rig.run_log("oom")
    assert "xpuctl: vLLM exited with code -9" in log, log
    assert re.search(rf"SIGTERM to .*\b{core} \(", log), log  # the supervisor stopped it
    # the supervisor's cleanup is audited (issue 17 item 3)
    assert [(e["command"], e["xpuctl_pid"], e["signal"], e["target"]["pid"])
            for e in audit_lines(rig) if e["result"] == "sent"] == [("serve", sup, "SIGTERM", core)]
    assert rig.signals(core) == ["SIGTERM"] and rig.exits(core) == [0]
    assert all(rig.exits(w) == [0] for w in workers)
    rec = rig.record("oom")
    assert rec["state"] == "failed" and rec["exit_code"] == -9, rec


def test_shutdown_keeps_the_exit_code_the_supervisor_recorded(rig):
    res = rig.serve(name="rec")
    assert res.rc == 0, str(res)
    sup = rig.record("rec")["supervisor_pid"]
    # a non-vLLM holder of one of the run's devices: both the supervisor (release wait =
    # --teardown-timeout 2) and `shutdown` (--release-timeout 8) wait for it, then report
    # leftovers; the supervisor writes its record first, shutdown ~6 s later
    holder = subprocess.Popen([PY, "-c", ("import os,sys,time; os.open(sys.argv[1], os.O_RDWR); "
                                          "time.sleep(60)"), rig.root.node(1)],
                              env=rig.env(), start_new_session=True, stdin=subprocess.DEVNULL)
    rig.popens.append(holder)
    assert wait_for(lambda: holder.pid in holders(rig.root.node(1)), 30)
    try:
        res = rig.shutdown("rec", "--json", "--release-timeout", "8")
        assert wait_for(lambda: is_gone(sup), 60)
    finally:
        rig.kill_mine(holder.pid)
        holder.wait(5)
    assert res.rc == 1 and res.json["verdict"] == "leftovers", str(res)  # reported, not hidden
    assert res.json["holders"] == [holder.pid]
    rig.assert_clean()
    rec = rig.record("rec")
    assert rec["state"] == "failed", rec
    assert rec["exit_code"] == 0, rec  # vLLM exited 0; the supervisor recorded it


_DRIVER = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from proctools import holders, is_gone, start_fake_vllm
tests, root, state, token, workdir = sys.argv[1:6]
xp = [sys.executable, "-m", "xpuctl", "--root", root, "shutdown", "--state-dir", state]
out = {"pid": os.getpid()}
def run(*args):
    p = subprocess.run(xp + list(args), capture_output=True, text=True, timeout=180)
    return [p.returncode, p.stdout, p.stderr]
out["empty"] = run("--all")
fv = start_fake_vllm(token, root, tp=2, shutdown_timeout=5, workdir=workdir)
out["ready"] = fv.wait_ready(60)
start = [e for e in fv.events() if e["event"] == "start"]
out["core"] = [e["pid"] for e in start if e["role"] == "engine-core"]
out["workers"] = [e["pid"] for e in start if e["role"] == "worker"]
fv.proc.kill()
fv.proc.wait()
time.sleep(0.2)
out["orphans_alive"] = [not is_gone(p) for p in out["core"] + out["workers"]]
out["all"] = run("--all", "--yes", "--json", "--kill-after", "1", "--release-timeout", "5")
out["gone"] = [is_gone(p) for p in out["core"] + out["workers"]]
out["held"] = holders(os.path.join(root, "dev/dri/renderD128")) + holders(os.path.join(root, "dev/dri/renderD129"))
out["events"] = fv.events()
print(json.dumps(out))
"""


@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_shutdown_all_in_a_private_pid_namespace(rig):
    """`--all` sees every vLLM on the host, so it runs where only our processes exist: with
    nothing running it exits 0; after a SIGKILLed API server it finds and stops the orphans."""
    driver = rig.tmp / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), rig.root.root, rig.state, rig.token, str(rig.tmp)],
                       env=rig.env(), capture_output=True, text=True, timeout=400, cwd=rig.tmp)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1  # really alone

    rc, stdout, stderr = out["empty"]
    assert rc == 0 and stdout.strip() == "nothing to stop", (rc, stdout, stderr)

    assert out["ready"] and len(out["core"]) == 1 and len(out["workers"]) == 2
    assert all(out["orphans_alive"])
    rc, stdout, stderr = out["all"]
    assert rc == 0, (stdout, stderr)
    data = json.loads(stdout)
    core = out["core"][0]
    assert [t["top"] for t in data["targets"]] == [core]
    t = data["targets"][0]
    assert t["orphan"] is True and sorted(t["processes"]) == sorted([core, *out["workers"]])
    assert sorted(t["devices"]) == [BDF0, BDF1]
    assert data["verdict"] == "clean", data
    assert any(e["phase"] == "released" and f"{BDF0}, {BDF1} released" in e["detail"]
               for e in data["events"])
    assert all(out["gone"]) and out["held"] == []
    sigs = [(e["role"], e["signal"]) for e in out["events"] if e["event"] == "signal"]
    assert sigs == [("engine-core", "SIGTERM")], sigs
    rig.assert_clean()


def test_shutdown_targets_that_match_nothing(rig):
    os.makedirs(rig.state, mode=0o700)
    res = rig.shutdown("nope")
    assert res.rc == 3 and "no run named 'nope'" in res.err, str(res)
    sleeper = subprocess.Popen(["sleep", "30"], env=rig.env(), start_new_session=True)
    rig.popens.append(sleeper)
    res = rig.shutdown("--pid", str(sleeper.pid))
    assert res.rc == 3 and "is not a vLLM process" in res.err, str(res)
    assert sleeper.poll() is None  # untouched
    res = rig.shutdown("--port", str(free_port()))
    assert res.rc == 3 and "no vLLM server listens on port" in res.err, str(res)
    res = rig.shutdown("--device", "0")  # our stand-in root: nobody holds it
    assert res.rc == 3 and f"no vLLM process holds {BDF0}" in res.err, str(res)
    res = rig.shutdown("--device", "5")
    assert res.rc == 2 and "unknown device '5'" in res.err, str(res)
    res = rig.shutdown()
    assert res.rc == 2 and "say which server to stop" in res.err, str(res)
    rig.kill_mine(sleeper.pid)
    sleeper.wait(30)
    rig.assert_clean()
