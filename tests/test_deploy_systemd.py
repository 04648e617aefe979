"""deploy/systemd: `systemd-analyze verify` passes with no warning on the unit pointed at this
install, the stop timeout covers xpuctl's worst-case stop, the gate is a working doctor
command, and the restart policy cannot loop on a refused gate."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from deploytools import DEPLOY, expand, parse_xpuctl, read_env, read_unit, seconds

from xpuctl.errors import ExitCode
from xpuctl.serve.budget import worst_stop_seconds

UNIT = DEPLOY / "systemd" / "xpuctl-vllm@.service"
ENV = DEPLOY / "systemd" / "vllm.env.example"
INSTALLED = "/usr/local/bin/xpuctl"  # where the unit expects xpuctl
INSTANCE = "llama"


@pytest.fixture(scope="module")
def unit():
    return read_unit(UNIT)


@pytest.fixture(scope="module")
def env():
    return read_env(ENV)


def one(unit, section, key) -> str:
    values = unit.get((section, key), [])
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def our_xpuctl() -> str:
    exe = Path(sys.executable).with_name("xpuctl")
    assert exe.exists(), f"{exe}: this test needs the installed console script"
    return str(exe)


def analyze(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` on an instance of a copy of the unit in tmp_path."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: apt-get install systemd)")
    d = tmp_path / "units"
    d.mkdir(exist_ok=True)
    (d / UNIT.name).write_text(unit_text)
    env_copy = d / f"vllm-{INSTANCE}.env"
    shutil.copy(ENV, env_copy)
    return subprocess.run(
        [tool, "verify", "--man=no", str(d / f"xpuctl-vllm@{INSTANCE}.service")],
        capture_output=True, text=True, timeout=120,
    )


def pointed_here(text: str, tmp_path: Path) -> str:
    execs = [ln for ln in text.splitlines() if ln.startswith("Exec")]
    assert len(execs) == 2 and all(ln.split("=", 1)[1].startswith(INSTALLED + " ") for ln in execs)
    return (text.replace(INSTALLED, our_xpuctl())
                .replace("/etc/xpuctl/vllm-%i.env", str(tmp_path / "units" / "vllm-%i.env")))


def test_systemd_analyze_verify_passes_without_a_warning(tmp_path):
    res = analyze(pointed_here(UNIT.read_text(), tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr  # systemd reports parse problems here, exit 0
    assert res.stdout.strip() == ""


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda t: t.replace("KillMode=mixed", "KillMode=mixed\nKillModee=mixed"), "Unknown key"),
        (lambda t: t.replace("Restart=on-abnormal", "Restart=on-sometimes"), "on-sometimes"),
        (lambda t: t.replace("[Service]", "[Service]\nExecStartPost=/nonexistent/xpuctl doctor"),
         "/nonexistent/xpuctl"),
    ],
)
def test_verify_catches_what_it_should(tmp_path, mutate, needle):
    """The check above can fail: the same run flags a typo, a bad value, a missing binary."""
    res = analyze(mutate(pointed_here(UNIT.read_text(), tmp_path)), tmp_path)
    assert needle in res.stderr, res.stderr


def test_stop_timeout_covers_the_worst_case_stop(unit, env):
    argv = expand(one(unit, "Service", "ExecStart"), env, INSTANCE)
    assert argv[0] == INSTALLED
    command, p = parse_xpuctl(argv[1:])
    assert command == "serve"
    drain, teardown, kill_after = p["drain_timeout"], p["teardown_timeout"], p["kill_after"]
    assert (drain, teardown, kill_after) == (
        float(env["XPUCTL_DRAIN_TIMEOUT"]), float(env["XPUCTL_TEARDOWN_TIMEOUT"]),
        float(env["XPUCTL_KILL_AFTER"]))
    stop = seconds(one(unit, "Service", "TimeoutStopSec"))
    assert stop > drain + teardown + kill_after
    assert stop > worst_stop_seconds(drain, teardown, kill_after)
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    assert not p["detach"], "serve must stay in the foreground as the main process"
    assert p["name"] == INSTANCE
    # xpuctl sets vLLM's --shutdown-timeout from the budgets; one in the args would override it
    assert not any(a.startswith("--shutdown") for a in p["_extra"] + list(p["vllm_args"] or []))
    assert one(unit, "Service", "Type") == "notify"


def test_the_unit_speaks_the_notify_protocol_with_a_watchdog(unit):
    """Type=notify: READY=1 ends the start (serve sends it once vLLM answers); serve is the main
    process and NotifyAccess=main hears only it; WatchdogSec= restarts a run whose keep-alives
    stop (serve sends them only while its watch finds the run healthy, every WatchdogSec/2),
    with SIGTERM so the drain still runs; a run the watch stopped (7) restarts too."""
    from xpuctl.serve.launch import ServeOptions

    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    watchdog = seconds(one(unit, "Service", "WatchdogSec"))
    # a keep-alive every half of it, from a loop that checks every --health-interval (the
    # unit keeps the default) with requests bounded by about an interval each
    assert watchdog / 2 >= 4 * ServeOptions(model="m", vllm_args=[]).health_interval
    assert one(unit, "Service", "WatchdogSignal") == "SIGTERM"
    force = {int(c) for c in one(unit, "Service", "RestartForceExitStatus").split()}
    assert {ExitCode.PROBLEMS, ExitCode.UNHEALTHY} <= force
    assert "--detach" not in one(unit, "Service", "ExecStart")


def test_start_timeout_covers_the_gate(unit, env):
    pre = expand(one(unit, "Service", "ExecStartPre"), env, INSTANCE)
    command, p = parse_xpuctl(pre[1:])
    assert command == "doctor" and p["expect_idle"] and p["wait_clean"] is not None
    assert p["wait_clean"] == float(env["XPUCTL_WAIT_CLEAN"])
    assert seconds(one(unit, "Service", "TimeoutStartSec")) >= p["wait_clean"] + 30


def test_gate_and_server_name_the_same_devices_and_port(unit, env):
    _, pre = parse_xpuctl(expand(one(unit, "Service", "ExecStartPre"), env, INSTANCE)[1:])
    _, srv = parse_xpuctl(expand(one(unit, "Service", "ExecStart"), env, INSTANCE)[1:])
    assert list(pre["device"]) == list(srv["devices"]) == [env["XPUCTL_DEVICES"]]
    rest = list(srv["vllm_args"] or []) + srv["_extra"]
    assert pre["port"] == int(rest[rest.index("--port") + 1]) == int(env["XPUCTL_PORT"])
    assert srv["model"] == env["XPUCTL_MODEL"]


def test_restart_policy_cannot_loop_on_a_refused_gate(unit):
    """systemd matches RestartForceExitStatus=/RestartPreventExitStatus= against the main
    process only (service.c, service_shall_restart: main_exec_status, reset at every start);
    a failed ExecStartPre is a plain exit-code failure. Restart=on-abnormal never restarts
    after one, so a refused gate ends the unit in "failed"."""
    assert one(unit, "Service", "Restart") in ("no", "on-abnormal", "on-abort", "on-watchdog")
    force = {int(c) for c in one(unit, "Service", "RestartForceExitStatus").split()}
    never = {ExitCode.OK, ExitCode.USAGE, ExitCode.NOT_FOUND, ExitCode.NOT_READY,
             ExitCode.LOCKED, 70}
    assert not force & {int(c) for c in never}
    assert ExitCode.PROBLEMS in force  # a crashed tree: restart through the gate
    assert seconds(one(unit, "Service", "RestartSec")) >= 10
    burst = int(one(unit, "Unit", "StartLimitBurst"))
    assert 1 <= burst <= 10 and seconds(one(unit, "Unit", "StartLimitIntervalSec")) >= 600
    # the gate is an ExecStartPre, so its refusal is never the main process's status
    assert "doctor" in one(unit, "Service", "ExecStartPre")
    assert "doctor" not in one(unit, "Service", "ExecStart")


@pytest.mark.parametrize(
    "host, code",
    [(fh.clean_host, 0), (fh.orphan_host, ExitCode.PROBLEMS), (fh.healthy_host, ExitCode.PROBLEMS)],
)
def test_the_gate_command_runs(unit, env, tmp_path, host, code):
    """The unit's ExecStartPre, as systemd expands it, against fake hosts: a clean GPU passes;
    orphans, and a GPU busy with another server (--expect-idle), are refused with exit 1."""
    h = host(tmp_path / "root")
    argv = expand(one(unit, "Service", "ExecStartPre"), {**env, "XPUCTL_WAIT_CLEAN": "0"}, INSTANCE)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
    run_env["XPUCTL_ROOT"] = str(h.root)
    res = subprocess.run([our_xpuctl(), *argv[1:]], capture_output=True, text=True, timeout=120,
                         env=run_env)
    assert res.returncode == code, res.stdout + res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_exec_start_drains_on_sigterm(unit, env, tmp_path):
    """The unit's ExecStart, as systemd expands it, with the fake vLLM and short budgets: serve
    stays in the foreground, and a SIGTERM to it alone (what KillMode=mixed sends) becomes the
    drain: SIGTERM to vLLM's API server only, the tree exits by itself, serve exits 0."""
    import tempfile

    from notifytools import Listener
    from proctools import (
        FAKE_VLLM,
        StandInRoot,
        free_port,
        http_get,
        new_token,
        pids_with_token,
        read_events,
        reap_token,
        token_env,
        wait_for,
    )

    token = new_token()
    root = StandInRoot(tmp_path, n_devices=1)
    port = free_port()
    sock_dir = tempfile.mkdtemp(prefix="xn", dir="/tmp")  # a socket path under 108 bytes
    manager = Listener(sock_dir, abstract=False)  # systemd's end of NOTIFY_SOCKET
    events = tmp_path / "events.jsonl"
    short = {**env, "XPUCTL_DRAIN_TIMEOUT": "2", "XPUCTL_TEARDOWN_TIMEOUT": "2",
             "XPUCTL_KILL_AFTER": "1", "XPUCTL_PORT": str(port), "XPUCTL_DEVICES": "0",
             "XPUCTL_MODEL": "fake-model", "XPUCTL_VLLM_ARGS": "--tensor-parallel-size 2",
             "XPUCTL_READY_TIMEOUT": "60"}
    argv = [our_xpuctl(), *expand(one(unit, "Service", "ExecStart"), short, INSTANCE)[1:]]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("XPUCTL_", "FAKE_VLLM_", "ZE_", "VLLM_")) and k != "SPT_NOENV"}
    run_env = token_env(token, base, **short, XPUCTL_ROOT=root.root,
                        XPUCTL_STATE_DIR=str(tmp_path / "state"), FAKE_VLLM_EVENTS=str(events),
                        XPUCTL_VLLM=f"{sys.executable} {FAKE_VLLM} serve",
                        **manager.env(watchdog_usec=2_000_000))
    procs = []
    try:
        for attempt in (1, 2):
            err_path = tmp_path / f"serve{attempt}.err"
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(argv, env=run_env, stdout=subprocess.DEVNULL, stderr=err,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            url = f"http://127.0.0.1:{port}/health"
            def started(proc=proc, err_path=err_path) -> bool:
                return (proc.poll() is not None
                        or "xpuctl: ready on" in err_path.read_text(errors="replace"))

            assert wait_for(started, 120, 0.1), err_path.read_text()
            text = err_path.read_text(errors="replace")
            if proc.poll() == 1 and "preflight failed" in text and attempt == 1:
                # refused because of vLLM processes of others on this shared machine
                argv = [argv[0], "serve", "--force", *argv[2:]]
                continue
            break
        assert proc.poll() is None, text
        assert http_get(url, 2.0)[0] == 200
        assert wait_for(lambda: manager.first("READY", "1") is not None, 10, 0.05), manager.all()
        assert wait_for(lambda: manager.pings(manager.first("READY").t), 10, 0.05)
        proc.send_signal(signal.SIGTERM)
        budget = worst_stop_seconds(2, 2, 1)
        rc = proc.wait(timeout=3 * budget + 30)
        text = err_path.read_text(errors="replace")
        assert rc == 0, text
        assert "stopped: clean" in text, text
        ev = read_events(events)
        api = next(e["pid"] for e in ev if e["event"] == "start" and e["role"] == "api-server")
        sigs = [(e["pid"], e["signal"]) for e in ev if e["event"] == "signal"]
        assert sigs and sigs[0] == (api, "SIGTERM"), sigs
        assert not [s for s in sigs if s[1] == "SIGKILL"], sigs
        assert wait_for(lambda: not pids_with_token(token), 10, 0.1)
        stopping = manager.first("STOPPING", "1")
        assert stopping is not None and stopping.t > manager.first("READY").t, manager.all()
        assert manager.statuses()[0].startswith("starting vLLM")
        assert not any(m.has(k) for m in manager.all() for k in ("NOTIFY_SOCKET", "MAINPID"))
    finally:
        reap_token(token)
        manager.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        root.close()


def test_doctor_device_takes_the_units_comma_list(tmp_path):
    """XPUCTL_DEVICES feeds both serve --devices and doctor --device: both take "0,1"."""
    import json

    from typer.testing import CliRunner

    from xpuctl.cli import app

    h = fh.orphan_host(tmp_path / "root")
    runner = CliRunner()
    both = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--device", "0,1"])
    one_ = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--device", "1"])
    devs = {f["device"] for f in json.loads(both.stdout)["findings"] if f["device"]}
    assert len(devs) == 2, devs
    assert {f["device"] for f in json.loads(one_.stdout)["findings"] if f["device"]} < devs
    bad = runner.invoke(app, ["--root", str(h.root), "doctor", "--device", "0,7"])
    assert bad.exit_code == 2 and "unknown device '7'" in bad.stderr
