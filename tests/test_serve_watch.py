"""serve's liveness watch end to end (issue 30), against the fake vLLM's runs that die inside:

- `die-inside`: EngineCore's "EngineCore encountered a fatal error.", the API server's
  "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client." (core_client.py,
  vLLM #32468), /health 503 for good, every process still up (vLLM #54553);
- `stall`: /health 200, requests running, the token counters frozen (vLLM #54698);
- the controls: an idle server, a slow request whose counters move, one 1.5 s blip of /health.

serve runs with `--health-interval 1 --unhealthy-after 3 --stall-after 4`, in the foreground
and detached, with NOTIFY_SOCKET on a path and abstract and WATCHDOG_USEC=2000000 (the test is
systemd's end: notifytools.Listener). Checked: the record, `ps --json`, `xpuctl health`,
doctor and its Prometheus text, the exit codes, the datagrams and their times. And the one
exit table: stops that were asked for exit 0 (plain, escalated to SIGKILL, during start-up);
a SIGTERM to vLLM's API server from outside the run exits 1.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import pytest
from notifytools import DetachedServe, Listener, gaps
from proctools import free_port, http_post, is_gone, wait_for
from serverig import Rig, running, wait_ready

pytestmark = pytest.mark.slow

WATCH = ["--health-interval", "1", "--unhealthy-after", "3", "--stall-after", "4"]
HALF_WATCHDOG = 1.0  # WATCHDOG_USEC=2000000: a keep-alive every second


@contextlib.contextmanager
def notify_socket(abstract: bool):
    d = tempfile.mkdtemp(prefix="xn", dir="/tmp")  # a unix socket path stays under 108 bytes
    sock = Listener(d, abstract=abstract)
    try:
        yield sock
    finally:
        sock.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["path", "abstract"])
def listener(request):
    with notify_socket(request.param == "abstract") as sock:
        yield sock


def fault_env(rig: Rig, fault: str, listener: Listener | None = None, **extra: str) -> dict[str, str]:
    env = {"FAKE_VLLM_FAULTS": fault, "FAKE_VLLM_FAULT_FILE": str(rig.tmp / "fault-now"), **extra}
    if listener is not None:
        env.update(listener.env())
    return env


def trigger(rig: Rig) -> float:
    """Start the fake's fault now; the monotonic time it was started."""
    t = time.monotonic()
    (rig.tmp / "fault-now").touch()
    return t


def health(rig: Rig, name: str):
    return rig.xpuctl("health", name, "--json", "--state-dir", rig.state)


def record_health(rig: Rig, name: str) -> dict | None:
    try:
        return rig.record(name).get("health")
    except (OSError, ValueError):
        return None


def assert_pings_while_healthy(sock: Listener, ready_t: float, until: float) -> None:
    """WATCHDOG=1 about every half WATCHDOG_USEC from READY=1 on, never a gap the manager's
    watchdog (2 s) would act on."""
    pings = sock.pings(ready_t, until)
    assert len(pings) >= 3, sock.all()
    g = gaps(pings)
    assert 0.7 * HALF_WATCHDOG <= statistics.median(g) <= 1.4 * HALF_WATCHDOG, g
    assert max(g) < 2 * HALF_WATCHDOG, g


def assert_unhealthy_record(rec: dict, death: bool = True) -> None:
    assert rec["state"] == "failed", rec
    reason = rec["reason"]
    assert reason.startswith("unhealthy: "), reason
    if death:  # /health's status and the engine-death line vLLM printed
        assert "/health answered 503" in reason, reason
        assert "EngineCore encountered a fatal error" in reason or "died unexpectedly" in reason
    assert rec["health"]["state"] == "unhealthy" and rec["health"]["reason"] == reason


# ---------------------------------------------------------------------------------------------
# dies inside: unhealthy, stopped, exit 7; the notify protocol all along


def test_foreground_die_inside_is_stopped_with_exit_7(rig, listener):
    fg = rig.serve_bg(opts=WATCH, env=fault_env(rig, "die-inside", listener))
    assert wait_for(lambda: listener.first("READY") is not None, 60, 0.05), str(fg)
    ready_t = listener.first("READY").t
    assert wait_for(lambda: len(listener.pings(ready_t)) >= 4, 30, 0.05), listener.all()
    assert health(rig, fg.name).rc == 0
    fault_t = trigger(rig)
    assert fg.proc.wait(120) == 7, str(fg)
    rec = rig.record(fg.name)
    assert_unhealthy_record(rec)
    err = fg.err()
    assert f"{fg.name}: unhealthy: " in err and "serve exits 7" in err, str(fg)

    # the datagrams: starting (what it waits for), READY, keep-alives while healthy, the
    # reason, STOPPING; no keep-alive once unhealthy
    statuses = listener.statuses()
    assert statuses[0].startswith("starting vLLM") and "waiting for /health" in statuses[0]
    unhealthy = listener.first("STATUS", f"{rec['reason']}")
    assert unhealthy is not None and unhealthy.t >= fault_t, statuses
    stopping = listener.first("STOPPING", "1")
    assert stopping is not None and stopping.t >= unhealthy.t
    assert stopping.get("STATUS", ).startswith("stopping: unhealthy: ")
    assert int(stopping.get("EXTEND_TIMEOUT_USEC")) > 0
    assert_pings_while_healthy(listener, ready_t, fault_t)
    assert listener.pings(unhealthy.t) == [], listener.all()
    assert all(not m.has("WATCHDOG") for m in listener.all() if m.t < ready_t)
    # detection: the death line is immediate, well within --unhealthy-after + two intervals
    assert unhealthy.t - fault_t < 3 + 2 * 1, unhealthy.t - fault_t
    rig.assert_clean()
    after = health(rig, fg.name)
    assert after.rc == 1 and after.json["status"] == "failed", after.out


def test_detached_die_inside_is_stopped_and_the_supervisor_exits_7(rig, listener):
    """--detach under Type=notify: `serve --detach` (the unit's main pid) hands the role to
    its supervisor with MAINPID= before the supervisor says anything, and a WATCHDOG_PID
    naming it becomes the supervisor's."""
    env = rig.env(**fault_env(rig, "die-inside", listener))
    name = f"detached-{listener.address[0] == '@'}"
    cmd = rig.serve_cmd(port=free_port(), opts=[*WATCH, "--name", name])
    ds = DetachedServe(cmd, env, rig.tmp, rig.tmp / "detach.err")
    rig.popens.append(ds.proc)
    assert wait_for(lambda: ds.serve_code() is not None, 90, 0.1), ds.err()
    assert ds.serve_code() == 0, ds.err()
    supervisor = rig.record(name)["supervisor_pid"]
    first = listener.all()[0]
    assert first.get("MAINPID") == str(supervisor), listener.all()
    assert wait_for(lambda: listener.first("READY") is not None, 30, 0.05)
    ready_t = listener.first("READY").t
    assert wait_for(lambda: len(listener.pings(ready_t)) >= 4, 30, 0.05), listener.all()
    fault_t = trigger(rig)
    ds.wait(120)
    assert ds.supervisor_code(supervisor) == 7, (ds.lines, rig.run_log(name))
    assert_unhealthy_record(rig.record(name))
    assert "serve exits 7" in rig.run_log(name)
    unhealthy = next(m for m in listener.all() if (m.get("STATUS") or "").startswith("unhealthy:"))
    assert_pings_while_healthy(listener, ready_t, fault_t)
    assert listener.pings(unhealthy.t) == []
    assert listener.first("STOPPING", "1").t >= unhealthy.t
    rig.assert_clean()


def test_a_wedged_device_in_the_kernel_log_is_unhealthy_at_once(rig):
    """xe's record (Linux drivers/gpu/drm/xe/xe_device.c, xe_device_declare_wedged), in
    /dev/kmsg's format (Documentation/ABI/testing/dev-kmsg), as docs/kernel.md quotes it;
    under --root the stand-in kernel log is ROOT/dev/kmsg."""
    kmsg = Path(rig.root.root, "dev", "kmsg")
    kmsg.write_text("")
    fg = rig.serve_bg(opts=WATCH)
    wait_ready(rig, fg)
    time.sleep(1.5)
    with open(kmsg, "a") as fh:
        fh.write(f"2,900,99000000,-;xe {rig.root.bdf(1)}: [drm] CRITICAL: Xe has declared device "
                 f"{rig.root.bdf(1)} as wedged.\n")
    assert fg.proc.wait(120) == 7, str(fg)
    rec = rig.record(fg.name)
    assert rec["reason"].startswith("unhealthy: the kernel declared a device of the run wedged")
    assert "/health answered 200" in rec["reason"], rec["reason"]
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# report: the run keeps running, and everything says it is unhealthy


def test_report_mode_keeps_the_run_and_everyone_sees_it(rig, listener):
    fg = rig.serve_bg(opts=[*WATCH, "--on-unhealthy", "report"],
                      env=fault_env(rig, "die-inside", listener))
    wait_ready(rig, fg)
    assert wait_for(lambda: len(listener.pings()) >= 2, 30, 0.05), listener.all()
    trigger(rig)
    assert wait_for(lambda: (record_health(rig, fg.name) or {}).get("state") == "unhealthy", 30, 0.1)
    rec = rig.record(fg.name)
    assert rec["state"] == "ready" and rec["health"]["reason"].startswith("unhealthy: ")
    assert "/health answered 503" in rec["health"]["reason"]

    h = health(rig, fg.name)
    assert h.rc == 1 and h.json["status"] == "unhealthy" and h.json["healthy"] is False, h.out
    ps = rig.xpuctl("ps", "--json", "--state-dir", rig.state)
    run = next(r for r in ps.json["runs"] if r["name"] == fg.name)
    assert run["health"]["state"] == "unhealthy" and run["health"]["healthy"] is False
    doc = rig.xpuctl("doctor", "--json", "--state-dir", rig.state)
    assert doc.rc == 1, str(doc)
    finding = [f for f in doc.json["findings"] if f["check"] == "run-health"]
    assert finding and finding[0]["severity"] == "fail", doc.json["findings"]
    assert f"run {fg.name} is unhealthy" in finding[0]["message"]
    prom = rig.xpuctl("doctor", "--format", "prometheus", "--state-dir", rig.state)
    assert f'xpuctl_run_healthy{{run="{fg.name}"}} 0' in prom.out.splitlines(), prom.out

    # the keep-alives stopped (systemd's WatchdogSec= restarts it even in report mode); the
    # supervisor still checks, and the run still runs
    before = time.time()
    time.sleep(3)
    said = next(m for m in listener.all() if (m.get("STATUS") or "").startswith("unhealthy:"))
    assert listener.pings(said.t) == [], listener.all()
    assert fg.proc.poll() is None and running(rec["pid"])
    # still checking: a check recorded after `before` (on a loaded machine one interval of
    # 1 s can take longer than the 3 s slept: wait for it, generously)
    assert wait_for(lambda: record_health(rig, fg.name)["checked_at"] > before, 60, 0.2)
    assert f"{fg.name}: unhealthy: " in fg.err() and "it keeps running" in fg.err()

    # a stop that was asked for: 0
    assert rig.shutdown(fg.name).rc == 0
    assert fg.proc.wait(120) == 0, str(fg)
    assert rig.record(fg.name)["state"] == "stopped"
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# stalls


def _long_request(port: int, seconds: float) -> threading.Thread:
    t = threading.Thread(target=http_post, args=(f"http://127.0.0.1:{port}/v1/completions",
                                                 {"prompt": "x", "fake_seconds": seconds}, 180),
                         daemon=True)
    t.start()
    return t


def _running(port: int) -> float:
    from proctools import http_get, metric

    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    return (metric(text, "vllm:num_requests_running") or 0.0) if status == 200 else 0.0


def test_a_stall_with_a_request_running_is_stopped_with_exit_7(rig, listener):
    fg = rig.serve_bg(opts=WATCH, env=fault_env(rig, "stall", listener))
    wait_ready(rig, fg)
    _long_request(fg.port, 120)
    assert wait_for(lambda: _running(fg.port) >= 1, 30, 0.05)
    time.sleep(1.5)
    fault_t = trigger(rig)
    assert fg.proc.wait(120) == 7, str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] == "failed" and rec["reason"].startswith("stalled: 1 request(s) running")
    assert "vllm:generation_tokens_total" in rec["reason"] and "vllm:prompt_tokens_total" in rec["reason"]
    said = next(m for m in listener.all() if (m.get("STATUS") or "").startswith("stalled:"))
    # detected within --stall-after plus two intervals of the freeze
    assert said.t - fault_t <= 4 + 2 * 1 + 0.5, said.t - fault_t
    assert listener.pings(said.t) == []
    assert "the run was stalled; serve exits 7" in fg.err()
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# the controls: an idle server, a slow request whose counters move, one 1.5 s blip


@pytest.mark.parametrize("control", ["idle", "slow-request", "blip"])
def test_the_controls_stay_healthy(rig, control):
    with notify_socket(abstract=False) as sock:
        env = sock.env()
        if control == "blip":
            env.update(fault_env(rig, "health-blip", FAKE_VLLM_BLIP_S="1.5"))
        fg = rig.serve_bg(opts=WATCH, env=env)
        wait_ready(rig, fg)
        ready_t = sock.first("READY").t
        if control == "slow-request":  # 16 s: its counters moving, still running 7 s after
            # it was seen running (8 s ended early on a loaded machine: seen late, done early)
            _long_request(fg.port, 16)
            assert wait_for(lambda: _running(fg.port) >= 1, 30, 0.05)
        if control == "blip":
            trigger(rig)
        time.sleep(7)
        end = time.monotonic()
        assert fg.proc.poll() is None, str(fg)
        assert not [s for s in sock.statuses() if s.startswith(("unhealthy", "stalled"))]
        assert_pings_while_healthy(sock, ready_t, end)
        assert record_health(rig, fg.name)["state"] == "healthy"
        h = health(rig, fg.name)
        assert h.rc == 0 and h.json["status"] == "healthy", h.out
        if control == "blip":
            assert '"GET /health HTTP/1.1" 503' in rig.run_log(fg.name)  # the blip was seen
        if control == "slow-request":
            assert _running(fg.port) >= 1  # still running, past --stall-after
        assert rig.shutdown(fg.name).rc == 0
        assert fg.proc.wait(120) == 0, str(fg)
    rig.assert_clean()


def test_a_supervisor_that_stopped_checking_is_not_healthy(rig):
    """A hung supervisor proves nothing: after three intervals without a check, `xpuctl
    health` exits 1 (the supervisor is SIGSTOPped, then let go)."""
    res = rig.serve(name="frozen", opts=WATCH)
    assert res.rc == 0, str(res)
    assert health(rig, "frozen").rc == 0
    supervisor = rig.record("frozen")["supervisor_pid"]
    rig.kill_mine(supervisor, signal.SIGSTOP)  # ours: it carries the rig's token
    try:
        time.sleep(3 * 1 + 1.5)
        h = health(rig, "frozen")
        assert h.rc == 1 and h.json["status"] == "stale", h.out
    finally:
        rig.kill_mine(supervisor, signal.SIGCONT)
    assert wait_for(lambda: health(rig, "frozen").rc == 0, 30, 0.2)
    assert rig.shutdown("frozen").rc == 0
    assert wait_for(lambda: is_gone(supervisor), 60)
    rig.assert_clean()


# ---------------------------------------------------------------------------------------------
# one exit table: stops that were asked for exit 0; a signal from outside the run exits 1


def test_a_shutdown_that_had_to_sigkill_still_exits_0(rig):
    """vLLM's API server ignores SIGTERM: `xpuctl shutdown` escalates to SIGKILL; the release
    is proven, so the foreground serve exits 0 (it used to pass on vLLM's 137). Its engine's
    exit on the survivors' SIGTERM is logged like a death: the watch leaves the stop to the
    shutdown that owns it."""
    fg = rig.serve_bg(opts=WATCH, env={"FAKE_VLLM_FAULTS": "ignore-sigterm",
                                       "FAKE_VLLM_ENGINE_DEAD_EXIT_S": "30"})
    wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    down = rig.shutdown(fg.name, "--json", "--timeout", "1", "--kill-after", "2",
                        "--release-timeout", "5")
    assert down.rc == 0 and down.json["verdict"] == "escalated", str(down)
    assert rig.exits(api) == []  # SIGKILLed
    assert fg.proc.wait(120) == 0, str(fg)
    assert "serve exits 7" not in fg.err(), str(fg)
    assert rig.record(fg.name)["state"] == "stopped"
    rig.assert_clean()


@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_a_stop_asked_for_during_start_up_exits_0(rig, how):
    fg = rig.serve_bg(env={"FAKE_VLLM_FAULTS": "hang-startup"}, ready=120)
    assert wait_for(lambda: rig.record(fg.name).get("pid") is not None, 60, 0.1)
    assert wait_for(lambda: any(e["role"] == "worker" for e in rig.events()), 60, 0.1)
    if how == "shutdown":
        assert rig.shutdown(fg.name, "--kill-after", "1", "--release-timeout", "5").rc == 0
    else:
        fg.proc.send_signal(signal.SIGTERM)
    assert fg.proc.wait(120) == 0, str(fg)
    assert rig.record(fg.name)["state"] == "stopped"
    rig.assert_clean()


def test_a_detached_start_stopped_on_request_exits_0(rig):
    fg = rig.serve_bg(detach=True, env={"FAKE_VLLM_FAULTS": "hang-startup"}, ready=120)
    assert wait_for(lambda: any(e["role"] == "worker" for e in rig.events()), 60, 0.1)
    assert rig.shutdown(fg.name, "--kill-after", "1", "--release-timeout", "5").rc == 0
    assert fg.proc.wait(120) == 0, str(fg)
    assert "was stopped before it was ready (a stop was asked for" in fg.err(), str(fg)
    rig.assert_clean()


def test_a_sigterm_to_vllm_from_outside_the_run_exits_1(rig):
    fg = rig.serve_bg()
    wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    rig.kill_mine(api, signal.SIGTERM)  # nobody asked serve: not xpuctl, not its supervisor
    assert fg.proc.wait(120) == 1, str(fg)
    err = fg.err()
    assert "signal from outside this run" in err and "nobody asked it to" not in err, str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] == "failed" and "signal from outside this run" in rec["reason"], rec
    assert rig.exits(api) == [0]  # vLLM drained and exited 0: still a failure of the run
    rig.assert_clean()
