"""serve's liveness watch without processes: the Prometheus parser, the state machine fed with
observations and a clock, the judgement of a recorded health, systemd's notify datagrams, the
kernel follower, and what ps, doctor and its Prometheus text say of a run's health."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from xpuctl.core.runrecords import Health
from xpuctl.core.watch import (
    HEALTHY,
    STALLED,
    UNHEALTHY,
    Observation,
    Watch,
    WatchConfig,
    judge,
)
from xpuctl.parse import metrics
from xpuctl.parse.enginedeath import EngineDeath, engine_death, stop_triggered
from xpuctl.parse.metrics import Counters

# ---------------------------------------------------------------------------------------------
# parse/metrics.py

# vLLM 0.32's /metrics as prometheus_client writes it (vllm/v1/metrics/loggers.py; labels
# model_name and engine; counters get `_total` and `_created` samples), cut to what matters,
# with two engines (DP=2) to sum over.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 30.0
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7645e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 4096.0
vllm:generation_tokens_total{engine="1",model_name="tiny"} 4.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7645e+09
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
"""


def test_vllm_counters_are_summed_over_engines():
    assert metrics.counters(VLLM_METRICS) == Counters(3.0, 4100.0, 150.0, waiting=0.0)


def test_a_server_without_the_metrics_says_nothing():
    assert metrics.counters("# nothing here\nother_metric 1\n") == Counters(None, None, None)


@pytest.mark.parametrize("line, sample", [
    ('a{b="x\\"y",c="1\\\\2\\n"} 3 1700000000000', ("a", (("b", 'x"y'), ("c", "1\\2\n")), 3.0)),
    ("a 1e3", ("a", (), 1000.0)),
    ('a{} +Inf', ("a", (), float("inf"))),
    ('a{b="}"} 2', ("a", (("b", "}"),), 2.0)),
    ('a{b="1",} 2', ("a", (("b", "1"),), 2.0)),
])
def test_exposition_lines(line, sample):
    got = metrics.parse_sample(line)
    assert got is not None and (got.name, got.labels, got.value) == sample


@pytest.mark.parametrize("line", ["# HELP a b", "", "a", 'a{b="1" 2', "a{b=1} 2", "a x", "a 1 2 3",
                                  '{b="1"} 2'])
def test_lines_that_are_not_samples(line):
    assert metrics.parse_sample(line) is None


def test_nan_and_infinite_samples_are_left_out_of_the_sums():
    text = "vllm:num_requests_running NaN\nvllm:generation_tokens_total +Inf\n"
    assert metrics.counters(text) == Counters(None, None, None)


# ---------------------------------------------------------------------------------------------
# core/watch.py: the machine

CFG = WatchConfig(interval=1.0, unhealthy_after=3.0, stall_after=4.0)
IDLE = Counters(0.0, 10.0, 5.0)
DEATH = EngineDeath("EngineCore died", "ERROR 12-03 [core_client.py:562] Engine core proc "
                                       "EngineCore_DP0 died unexpectedly, shutting down client.")


def ok(t: float, counters: Counters | None = IDLE) -> Observation:
    return Observation(t, 200, None, None if counters is None else (counters,))


def failing(t: float, status: int | None = 503, error: str | None = None) -> Observation:
    return Observation(t, status, error, None)


def run(watch: Watch, observations: list[Observation]) -> list[str]:
    return [watch.feed(o).state for o in observations]


def test_an_idle_server_is_healthy():
    w = Watch(CFG, 0.0)
    assert set(run(w, [ok(t) for t in range(60)])) == {HEALTHY}


def test_health_failing_without_a_break_is_unhealthy_after_the_window():
    w = Watch(CFG, 0.0)
    states = run(w, [ok(0), failing(1), failing(2), failing(3), failing(4), failing(5)])
    assert states == [HEALTHY, HEALTHY, HEALTHY, HEALTHY, UNHEALTHY, UNHEALTHY]  # 3 s: 1 -> 4
    assert w.verdict.since == 4.0
    assert w.verdict.reason is not None and w.verdict.reason.startswith("unhealthy: /health answered 503")


def test_a_refused_connection_and_a_timeout_count_as_failures():
    w = Watch(CFG, 0.0)
    obs = [failing(0, None, "connection refused"), failing(1.5, None, "timed out after 1s"),
           failing(3, None, "connection refused")]
    assert run(w, obs)[-1] == UNHEALTHY
    assert "failed (connection refused)" in (w.verdict.reason or "")


def test_a_blip_is_healthy():
    """One 1.5 s blip of /health failures under checks every second: two failed checks."""
    w = Watch(CFG, 0.0)
    obs = [ok(0), failing(1), failing(2), ok(3), failing(4), ok(5), ok(6)]
    assert set(run(w, obs)) == {HEALTHY}


def test_a_break_restarts_the_window():
    w = Watch(CFG, 0.0)
    obs = [failing(0), failing(1), failing(2), ok(2.5), failing(3), failing(4), failing(5)]
    assert set(run(w, obs)) == {HEALTHY}
    assert w.feed(failing(6)).state == UNHEALTHY


def test_an_engine_death_line_is_unhealthy_at_once_and_for_good():
    w = Watch(CFG, 0.0)
    v = w.feed(Observation(1, 503, None, None, DEATH))
    assert v.state == UNHEALTHY and v.since == 1
    assert v.reason is not None and v.reason.startswith("unhealthy: EngineCore died")
    assert "died unexpectedly" in v.reason and "/health answered 503" in v.reason
    assert w.feed(Observation(2, 200, None, (IDLE,), DEATH)).state == UNHEALTHY


def test_a_wedged_device_is_unhealthy_at_once():
    wedged = "xe 0000:03:00.0: [drm] CRITICAL: Xe has declared device 0000:03:00.0 as wedged."
    v = Watch(CFG, 0.0).feed(Observation(1, 200, None, (IDLE,), None, wedged))
    assert v.state == UNHEALTHY and "wedged" in (v.reason or "")


def test_running_requests_with_frozen_counters_stall():
    w = Watch(CFG, 0.0)
    frozen = Counters(2.0, 500.0, 40.0)
    states = run(w, [ok(t, frozen) for t in range(6)])
    assert states == [HEALTHY] * 4 + [STALLED] * 2
    reason = w.verdict.reason or ""
    assert reason.startswith("stalled: 2 request(s) running") and "500" in reason and "for 5.0s" in reason


def test_a_slow_request_whose_counters_move_is_healthy():
    w = Watch(CFG, 0.0)
    obs = [ok(t, Counters(1.0, 100.0 + t, 7.0)) for t in range(30)]
    assert set(run(w, obs)) == {HEALTHY}


def test_either_counter_moving_is_progress():
    w = Watch(CFG, 0.0)
    obs = [ok(t, Counters(1.0, 100.0, 7.0 + t)) for t in range(30)]
    assert set(run(w, obs)) == {HEALTHY}


def test_a_stall_clears_when_tokens_move_again():
    w = Watch(CFG, 0.0)
    frozen = Counters(1.0, 100.0, 7.0)
    assert run(w, [ok(t, frozen) for t in range(6)])[-1] == STALLED
    assert w.feed(ok(6, Counters(1.0, 101.0, 7.0))).state == HEALTHY


def test_unreadable_metrics_neither_stall_nor_clear_a_stall():
    w = Watch(CFG, 0.0)
    frozen = Counters(1.0, 100.0, 7.0)
    states = run(w, [ok(0, frozen), ok(1, None), ok(2, None), ok(3, frozen), ok(4, frozen)])
    assert states[-1] == STALLED


def test_a_server_without_token_counters_never_stalls():
    w = Watch(CFG, 0.0)
    assert set(run(w, [ok(t, Counters(3.0, None, None)) for t in range(30)])) == {HEALTHY}


# ---------------------------------------------------------------------------------------------
# core/watch.py: judging a record


def health(state: str = HEALTHY, checked: float = 100.0, interval: float = 5.0,
           reason: str | None = None) -> Health:
    return Health(state, 50.0, reason, checked, interval)


@pytest.mark.parametrize("state, h, now, healthy, status", [
    ("ready", health(), 101.0, True, "healthy"),
    ("ready", health(), 115.0, True, "healthy"),  # three intervals: still believed
    ("ready", health(), 115.5, False, "stale"),  # more than three: a hung supervisor
    ("starting", health("starting"), 101.0, True, "starting"),
    ("ready", health(UNHEALTHY, reason="unhealthy: x"), 101.0, False, "unhealthy"),
    ("ready", health(STALLED, reason="stalled: x"), 101.0, False, "stalled"),
    ("stopping", health(), 101.0, False, "stopping"),
    ("stopped", health(), 101.0, False, "stopped"),
    ("failed", health(), 101.0, False, "failed"),
    ("ready", None, 101.0, False, "unknown"),
])
def test_judge(state, h, now, healthy, status):
    seen = judge(state, h, now)
    assert (seen.healthy, seen.status) == (healthy, status)
    assert seen.detail.startswith(status)


def test_health_from_a_record_is_checked():
    good = {"state": "healthy", "since": 1, "reason": None, "checked_at": 2.5, "interval": 5}
    assert Health.from_dict(good) == Health("healthy", 1.0, None, 2.5, 5.0)
    for bad in (None, [], {"state": 1}, {**good, "since": "x"}, {**good, "interval": True},
                {**good, "reason": 3}):
        assert Health.from_dict(bad) is None


def test_an_old_record_without_health_still_reads(tmp_path):
    from xpuctl.state.runs import read_record

    runs = tmp_path / "runs"
    runs.mkdir()
    old = {"name": "old", "run_id": "r", "pid": 1, "start_ticks": 2, "session": 1, "command": [],
           "devices": [], "port": 8000, "host": "127.0.0.1", "shutdown_timeout": 5,
           "drain_timeout": 1, "teardown_timeout": 1, "log_path": "x", "state": "ready"}
    (runs / "old.json").write_text(json.dumps(old))
    rec = read_record(str(tmp_path), "old")
    assert rec is not None and rec.health is None and rec.bind == "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# parse/enginedeath.py: the outside signal


def test_the_api_servers_shutdown_line_is_found():
    # vLLM 0.33 launcher.py serve_http's handler (docs/vllm.md, "Signals and shutdown")
    line = "(APIServer pid=1) INFO 12-03 06:38:41 [launcher.py:241] [shutdown] API server: shutdown triggered"
    assert stop_triggered(line)
    assert not stop_triggered("[shutdown] API server: stopping engine client mode=drain")
    assert engine_death([line]) is None


# ---------------------------------------------------------------------------------------------
# host/notify.py


def bound(tmp_path, abstract: bool) -> tuple[socket.socket, str]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"xpuctl-test-{os.getpid()}-{time.monotonic_ns()}"
        s.bind("\0" + name)
        return s, "@" + name
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    return s, path


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_datagrams_reach_the_socket(tmp_path, abstract):
    from xpuctl.host.notify import Notifier

    sock, where = bound(tmp_path, abstract)
    sock.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": where, "WATCHDOG_USEC": "2000000"}, pid=os.getpid())
        assert n.watchdog == 2.0
        assert n.ready("ready on x\nsecond line") and n.ping() and n.stopping("stopping: y", 1.5)
        got = [sock.recv(4096).decode() for _ in range(3)]
        assert got == ["READY=1\nSTATUS=ready on x second line", "WATCHDOG=1",
                       "STOPPING=1\nSTATUS=stopping: y\nEXTEND_TIMEOUT_USEC=1500000"]
    finally:
        sock.close()


def test_notify_never_fails_and_honours_watchdog_pid(tmp_path):
    from xpuctl.host.notify import Notifier

    assert not Notifier({}).send("READY=1")  # no socket: nothing to do
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert not gone.ready("x") and gone.lost == 1  # a socket that is gone loses the message
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000"}
    assert Notifier({**env, "WATCHDOG_PID": "1"}, pid=4242).watchdog is None  # not ours
    assert Notifier({**env, "WATCHDOG_PID": "4242"}, pid=4242).watchdog == 4.0
    assert Notifier({**env, "WATCHDOG_USEC": "0"}, pid=4242).watchdog is None
    assert not Notifier({**env, "WATCHDOG_PID": "1"}, pid=4242).ping()


# ---------------------------------------------------------------------------------------------
# host/kernel.py: the follower

# xe's record (Linux drivers/gpu/drm/xe/xe_device.c, xe_device_declare_wedged) in /dev/kmsg's
# format (Documentation/ABI/testing/dev-kmsg), as docs/kernel.md quotes it
WEDGED = ("2,1200,99000000,-;xe 0000:03:00.0: [drm] CRITICAL: Xe has declared device "
          "0000:03:00.0 as wedged.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:03:00.0\n")
TIMEDOUT = "4,1201,99100000,-;xe 0000:04:00.0: [drm] Timedout job: seqno=1, lrc_seqno=1\n"


def test_the_kernel_follower_reads_only_what_was_logged_since(tmp_path):
    from xpuctl.host.kernel import KernelFollower
    from xpuctl.host.seam import Host

    kmsg = tmp_path / "dev" / "kmsg"
    kmsg.parent.mkdir()
    kmsg.write_text(WEDGED)  # before the watch: preflight doctor's business
    f = KernelFollower(Host(str(tmp_path)))
    assert f.read() == []
    with open(kmsg, "a") as fh:
        fh.write(TIMEDOUT + WEDGED[:30])  # a record cut short: read when it is whole
    events = f.read()
    assert [(e.kind, e.bdf) for e in events] == [("hang", "0000:04:00.0")]
    with open(kmsg, "a") as fh:
        fh.write(WEDGED[30:])
    assert [(e.kind, e.bdf) for e in f.read()] == [("wedged", "0000:03:00.0")]
    f.close()


def test_a_kernel_log_that_appears_later_is_read_from_its_start(tmp_path):
    from xpuctl.host.kernel import KernelFollower
    from xpuctl.host.seam import Host

    f = KernelFollower(Host(str(tmp_path)))
    assert f.read() == []
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kmsg").write_text(WEDGED)
    assert [e.kind for e in f.read()] == ["wedged"]
    f.close()


# ---------------------------------------------------------------------------------------------
# what everyone sees: xpuctl health, ps --json, doctor and its Prometheus text, from a record
# whose supervisor is this test's own process (alive: a live run)


def live_record(state: str, h: Health | None, name: str = "llm", reason: str | None = None,
                devices: tuple[str, ...] = ("0000:03:00.0",)):
    from serverig import start_ticks

    from xpuctl.state.runs import RunRecord

    return RunRecord(name=name, run_id="r1", pid=os.getpid(), start_ticks=start_ticks(os.getpid()),
                     session=None, command=["vllm"], devices=list(devices), port=8123,
                     bind="127.0.0.1", shutdown_timeout=5, drain_timeout=1, teardown_timeout=1,
                     log_path="/dev/null", state=state, supervisor_pid=os.getpid(),
                     started_at=time.time(), reason=reason, health=h)


@pytest.fixture
def state_dir(tmp_path):
    from xpuctl.state.runs import ensure_state_dir

    return ensure_state_dir(str(tmp_path / "state"))


def cli(root: str, *args: str):
    from typer.testing import CliRunner

    from xpuctl.cli import app

    return CliRunner().invoke(app, ["--root", root, *args])


def put(state_dir: str, rec) -> None:
    from xpuctl.state.runs import write_record

    write_record(state_dir, rec)


NOW_HEALTHY = lambda: Health(HEALTHY, time.time() - 60, None, time.time(), 5.0)  # noqa: E731


def test_xpuctl_health_exit_codes(standin_root, state_dir):
    root = standin_root.root
    put(state_dir, live_record("ready", NOW_HEALTHY()))
    res = cli(root, "health", "llm", "--state-dir", state_dir)
    assert res.exit_code == 0 and res.stdout.startswith("llm: healthy"), res.stdout
    doc = json.loads(cli(root, "health", "llm", "--json", "--state-dir", state_dir).stdout)
    assert doc["schema"] == "xpuctl.health/1" and doc["healthy"] is True
    assert doc["status"] == "healthy" and doc["health"]["interval"] == 5.0

    reason = "unhealthy: /health answered 503 at every check for 30.0s"
    put(state_dir, live_record("ready", Health(UNHEALTHY, time.time(), reason, time.time(), 5.0)))
    res = cli(root, "health", "llm", "--state-dir", state_dir)
    assert res.exit_code == 1 and reason in res.stdout, res.stdout
    doc = json.loads(cli(root, "health", "llm", "--json", "--state-dir", state_dir).stdout)
    assert (doc["healthy"], doc["status"]) == (False, "unhealthy")

    stale = Health(HEALTHY, time.time() - 60, None, time.time() - 16, 5.0)  # > 3 intervals
    put(state_dir, live_record("ready", stale))
    res = cli(root, "health", "llm", "--state-dir", state_dir)
    assert res.exit_code == 1 and "stale: not checked for 16s" in res.stdout, res.stdout

    put(state_dir, live_record("stopped", NOW_HEALTHY()))
    assert cli(root, "health", "llm", "--state-dir", state_dir).exit_code == 1
    put(state_dir, live_record("failed", NOW_HEALTHY(), reason="unhealthy: x"))
    res = cli(root, "health", "llm", "--state-dir", state_dir)
    assert res.exit_code == 1 and "failed: unhealthy: x" in res.stdout

    missing = cli(root, "health", "nobody", "--state-dir", state_dir)
    assert missing.exit_code == 3 and "no run named 'nobody'" in missing.stderr


def test_ps_doctor_and_prometheus_say_a_run_is_unhealthy(standin_root, state_dir):
    root = standin_root.root
    reason = "stalled: 1 request(s) running and neither ... moved for 300.0s"
    put(state_dir, live_record("ready", Health(STALLED, time.time(), reason, time.time(), 5.0)))
    put(state_dir, live_record("ready", NOW_HEALTHY(), name="fine"))
    ps = json.loads(cli(root, "ps", "--json", "--state-dir", state_dir).stdout)
    runs = {r["name"]: r["health"] for r in ps["runs"]}
    assert runs["llm"]["state"] == STALLED and runs["llm"]["healthy"] is False
    assert runs["llm"]["reason"] == reason
    assert runs["fine"]["healthy"] is True and runs["fine"]["status"] == "healthy"
    table = cli(root, "ps", "--state-dir", state_dir).stdout
    assert "HEALTH" in table and "stalled" in table

    doc = cli(root, "doctor", "--json", "--state-dir", state_dir)
    assert doc.exit_code == 1, doc.stdout
    found = [f for f in json.loads(doc.stdout)["findings"] if f["check"] == "run-health"]
    assert len(found) == 1 and found[0]["severity"] == "fail", found
    assert "run llm is unhealthy (stalled)" in found[0]["message"]

    prom = cli(root, "doctor", "--format", "prometheus", "--state-dir", state_dir).stdout
    assert 'xpuctl_run_healthy{run="llm"} 0' in prom.splitlines()
    assert 'xpuctl_run_healthy{run="fine"} 1' in prom.splitlines()
    # --device scopes it: the run's device is 0000:03:00.0 (device 0)
    other = json.loads(cli(root, "doctor", "--json", "--device", "1", "--state-dir",
                           state_dir).stdout)
    assert not [f for f in other["findings"] if f["check"] == "run-health"]


def test_a_healthy_run_is_no_finding_and_a_run_without_health_is_not_judged(standin_root, state_dir):
    root = standin_root.root
    put(state_dir, live_record("ready", NOW_HEALTHY()))
    put(state_dir, live_record("ready", None, name="old"))
    doc = json.loads(cli(root, "doctor", "--json", "--state-dir", state_dir).stdout)
    assert not [f for f in doc["findings"] if f["check"] == "run-health"]
    prom = cli(root, "doctor", "--format", "prometheus", "--state-dir", state_dir).stdout
    assert 'xpuctl_run_healthy{run="llm"} 1' in prom and 'run="old"' not in prom


# ---------------------------------------------------------------------------------------------
# one exit table


def test_exit_codes_are_one_table():
    """README's table is errors.MEANINGS, code for code and word for word, and `xpuctl --help`
    shows every code."""
    import subprocess
    import sys

    from xpuctl.errors import MEANINGS, ExitCode

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    table = {int(r.split("|")[1]): r.split("|")[3].strip() for r in rows}
    assert table == {int(c): m for c, m in MEANINGS.items()}
    assert set(MEANINGS) == set(ExitCode)
    names = {int(r.split("|")[1]): r.split("|")[2].strip() for r in rows}
    assert names == {int(c): f"`{c.name}`" for c in ExitCode}
    out = subprocess.run([sys.executable, "-m", "xpuctl", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    epilog = out.split("Exit codes", 1)[1]
    for code in ExitCode:
        assert f"\n{int(code):>5}  " in epilog, code


def test_checks_that_run_a_little_late_still_decide_at_the_window():
    """Checks run a hair after their due time: three intervals between the first failed check
    and the fourth measure 2.95 s; the 3 s window is reached there, not a check later."""
    w = Watch(CFG, 0.0)
    states = run(w, [failing(1.05), failing(2.02), failing(3.03), failing(4.0)])
    assert states == [HEALTHY, HEALTHY, HEALTHY, UNHEALTHY]


def test_a_malformed_or_hostile_health_field_is_read_safely(standin_root, state_dir):
    """A record written by something else: a health that is not the watch's reads as none
    (unknown, not healthy); a reason with control characters is escaped on the terminal."""
    root = standin_root.root
    rec = live_record("ready", None)
    data = rec.to_dict()
    for bad in ("healthy", {"state": "healthy"}, {"state": 1, "since": 1, "checked_at": 1,
                                                  "interval": 1, "reason": None}):
        (Path(state_dir) / "runs" / "llm.json").write_text(json.dumps({**data, "health": bad}))
        res = cli(root, "health", "llm", "--state-dir", state_dir)
        assert res.exit_code == 1 and res.stdout.startswith("llm: unknown"), res.stdout
    evil = "unhealthy: \x1b[31mred\x1b[0m\rline"
    put(state_dir, live_record("ready", Health(UNHEALTHY, time.time(), evil, time.time(), 5.0)))
    res = cli(root, "health", "llm", "--state-dir", state_dir)
    assert res.exit_code == 1 and "\x1b" not in res.stdout and "\r" not in res.stdout
    assert "\\x1b[31mred" in res.stdout, res.stdout


def test_health_reads_the_record_only(state_dir, tmp_path):
    """A liveness probe runs every few seconds: `xpuctl health` loads no scan of /proc, no
    process reader, nothing of serve."""
    import subprocess
    import sys

    put(state_dir, live_record("ready", NOW_HEALTHY()))
    code = (
        "import atexit, sys, runpy\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.startswith(("
        "'xpuctl.host.scan', 'xpuctl.host.processes', 'xpuctl.host.split', 'xpuctl.serve', "
        "'xpuctl.diagnosis', 'prometheus_client')))))\n"
        f"sys.argv = ['xpuctl', 'health', 'llm', '--state-dir', {state_dir!r}]\n"
        "runpy.run_module('xpuctl', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    assert out.stdout.startswith("llm: healthy"), out.stdout


def test_no_module_of_xpuctl_imports_prometheus_client():
    """vLLM's /metrics is read by xpuctl's own parser (parse/metrics.py)."""
    import ast

    src = Path(__file__).resolve().parents[1] / "xpuctl"
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "prometheus_client" for n in names), path
