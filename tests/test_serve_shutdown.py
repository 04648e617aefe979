"""End-to-end tests of `xpuctl serve` and `xpuctl shutdown` against the fake vLLM.

Everything runs for real: xpuctl is started as a subprocess with a stand-in root (``proc`` ->
``/proc``, plain-file render nodes), the fake vLLM (``tests/fake_vllm/vllm``) builds the real
process tree, and its JSON-lines event log (``FAKE_VLLM_EVENTS``) tells which process received
which signal, and when.

Safety: every process a test starts carries ``XPUCTL_TEST_TOKEN`` (xpuctl passes its
environment through to vLLM); the ``rig`` fixture checks that nothing carrying the token
survives a test and that the stand-in nodes are free, then SIGKILLs whatever carries the token.
Nothing here signals a process the test did not start: ``shutdown --all`` only ever runs inside a
private PID namespace (other engineers' vLLM processes are visible through /proc otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from proctools import (
    FAKE_VLLM,
    TOKEN_VAR,
    StandInRoot,
    _signal_if_token,
    cmdline,
    environ,
    free_port,
    holders,
    http_get,
    http_post,
    is_gone,
    metric,
    new_token,
    pidns_available,
    pids_with_token,
    port_listening,
    ppid_of,
    read_events,
    reap_token,
    sid_of,
    wait_for,
)

pytestmark = pytest.mark.slow

PY = sys.executable
XPUCTL = [PY, "-m", "xpuctl"]
VLLM_CMD = f"{PY} {FAKE_VLLM} serve"
TESTS_DIR = Path(__file__).resolve().parent
BDF0, BDF1 = StandInRoot.bdf(0), StandInRoot.bdf(1)

# never inherited from the caller's environment: they would change what is being tested
_SCRUB = {
    "XPUCTL_ROOT", "XPUCTL_STATE_DIR", "XPUCTL_VLLM", "XPUCTL_RUN_ID", "XPUCTL_DEBUG",
    "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR", "ZE_FLAT_DEVICE_HIERARCHY",
    "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_PROCESS_NAME_PREFIX", "SPT_NOENV", TOKEN_VAR,
}


# ---------------------------------------------------------------------------------------------
# the rig: one token, one stand-in root, one state dir, one event log per test


@dataclass
class Result:
    rc: int
    out: str
    err: str
    port: int | None = None
    name: str | None = None
    elapsed: float = 0.0

    @property
    def json(self) -> dict:
        return json.loads(self.out)

    def __str__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.out}\n--- stderr\n{self.err}"


@dataclass
class Foreground:
    proc: subprocess.Popen
    port: int
    name: str
    out_path: Path
    err_path: Path

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def __str__(self) -> str:
        return f"rc={self.proc.poll()}\n--- stdout\n{self.out()}\n--- stderr\n{self.err()}"


@dataclass
class Rig:
    token: str
    root: StandInRoot
    tmp: Path
    started: float = field(default_factory=time.time)
    popens: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = str(self.tmp / "state")  # missing on purpose: serve must create it (0700)
        self.events_path = self.tmp / "events.jsonl"

    # -- environment and commands ---------------------------------------------------------
    def env(self, spt_noenv: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in _SCRUB and not k.startswith("FAKE_VLLM_")}
        env[TOKEN_VAR] = self.token
        if spt_noenv:  # belt and braces for the reaper; the contract test leaves it to xpuctl
            env["SPT_NOENV"] = "1"
        env["FAKE_VLLM_EVENTS"] = str(self.events_path)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def serve_cmd(self, vllm_args=(), *, port: int, opts=(), detach=True, drain=2, teardown=2,
                  ready=60, kill_after=1, tp=2, model="fake-model", root: str | None = None,
                  port_before: bool = False):
        """`port_before`: `serve --port N ... MODEL` (xpuctl's option) instead of after MODEL."""
        cmd = [*XPUCTL, "--root", root or self.root.root, "serve"]
        if port_before:
            cmd += ["--port", str(port)]
        cmd += ["--vllm", VLLM_CMD,
                "--state-dir", self.state, "--drain-timeout", str(drain),
                "--teardown-timeout", str(teardown), "--ready-timeout", str(ready),
                "--kill-after", str(kill_after), *opts]
        if detach:
            cmd.append("--detach")
        after = [] if port_before else ["--port", str(port)]
        return cmd + [model, *after, "-tp", str(tp), *vllm_args]

    def foreign_preflight(self, rc: int, err: str) -> bool:
        """True when serve was refused only because of processes this test did not start.

        The preflight doctor sees the whole host: on a shared machine another engineer's
        orphaned vLLM (e.g. one still listening on a port) fails it for everyone (see the
        report). Then, and only then, the launch is retried with --force.
        """
        if rc != 1 or "xpuctl: error: preflight failed" not in err:
            return False
        mine = set(self.alive()) | {e["pid"] for e in self.events()}
        fails = [line for line in err.splitlines() if line.startswith("xpuctl: preflight fail ")]
        named = {int(n) for line in fails for n in re.findall(r"\b\d+\b", line)}
        return bool(fails) and not (named & mine)

    def _warn_foreign(self, err: str) -> None:
        import warnings

        warnings.warn("preflight refused because of processes of others; retried with --force:\n"
                      + err, stacklevel=3)

    def serve(self, *vllm_args, port=None, name=None, opts=(), env=None, spt_noenv=True,
              timeout=180, retry_foreign=True, **kw) -> Result:
        port = port or free_port()
        opts = list(opts) + (["--name", name] if name else [])
        t0 = time.monotonic()
        while True:
            cmd = self.serve_cmd(vllm_args, port=port, opts=opts, **kw)
            p = subprocess.run(cmd, env=self.env(spt_noenv, **(env or {})), capture_output=True,
                               text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=self.tmp)
            if retry_foreign and "--force" not in opts and self.foreign_preflight(p.returncode, p.stderr):
                self._warn_foreign(p.stderr)
                opts = [*opts, "--force"]
                continue
            return Result(p.returncode, p.stdout, p.stderr, port, name or f"vllm-{port}",
                          time.monotonic() - t0)

    def serve_bg(self, *vllm_args, port=None, name=None, opts=(), env=None, detach=False,
                 **kw) -> Foreground:
        """serve as a background child (foreground mode by default): stdout/stderr to files.
        Returns once the run record exists (the preflight passed)."""
        port = port or free_port()
        name = name or f"vllm-{port}"
        opts = list(opts) + ["--name", name]
        record = Path(self.state, "runs", f"{name}.json")
        while True:
            cmd = self.serve_cmd(vllm_args, port=port, opts=opts, detach=detach, **kw)
            n = len(self.popens)
            out_path, err_path = self.tmp / f"serve{n}.out", self.tmp / f"serve{n}.err"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(cmd, env=self.env(**(env or {})), stdout=out, stderr=err,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        cwd=self.tmp)
            self.popens.append(proc)
            fg = Foreground(proc, port, name, out_path, err_path)
            assert wait_for(lambda p=proc: record.exists() or p.poll() is not None, 60, 0.05), str(fg)
            if (not record.exists() and "--force" not in opts
                    and self.foreign_preflight(proc.wait(), fg.err())):
                self._warn_foreign(fg.err())
                opts = [*opts, "--force"]
                continue
            return fg

    def xpuctl(self, *args, timeout=180, root: str | None = None) -> Result:
        cmd = [*XPUCTL, "--root", root or self.root.root, *args]
        t0 = time.monotonic()
        p = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, cwd=self.tmp)
        return Result(p.returncode, p.stdout, p.stderr, elapsed=time.monotonic() - t0)

    def shutdown(self, *args, timeout=180) -> Result:
        return self.xpuctl("shutdown", *args, "--state-dir", self.state, timeout=timeout)

    # -- state ------------------------------------------------------------------------------
    def record(self, name: str) -> dict:
        with open(os.path.join(self.state, "runs", f"{name}.json")) as fh:
            return json.load(fh)

    def run_log(self, name: str) -> str:
        try:
            return Path(self.state, "logs", f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def events(self) -> list[dict]:
        return read_events(self.events_path)

    def tree(self, api_pid: int) -> tuple[int, list[int]]:
        """(engine core, [workers by rank]) of the fake server whose API server is api_pid,
        from the event log (pids of processes started after it)."""
        ev = self.events()
        start = [e for e in ev if e["event"] == "start"]
        t_api = next(e["t"] for e in start if e["pid"] == api_pid)
        later = [e for e in start if e["t"] >= t_api]
        core = next(e["pid"] for e in later if e["role"] == "engine-core")
        t_core = next(e["t"] for e in later if e["pid"] == core)
        workers = [e for e in later if e["role"] == "worker" and e["t"] >= t_core]
        by_rank: dict[int, int] = {}
        for e in workers:
            by_rank.setdefault(e["rank"], e["pid"])
        return core, [by_rank[r] for r in sorted(by_rank)]

    def signals(self, pid: int) -> list[str]:
        return [e["signal"] for e in self.events() if e["pid"] == pid and e["event"] == "signal"]

    def signal_times(self, pid: int) -> list[float]:
        return [e["t"] for e in self.events() if e["pid"] == pid and e["event"] == "signal"]

    def exits(self, pid: int) -> list[int]:
        return [e["code"] for e in self.events() if e["pid"] == pid and e["event"] == "exit"]

    def alive(self) -> list[int]:
        return pids_with_token(self.token)

    def describe(self, pids) -> str:
        return "; ".join(f"{p}: {' '.join(cmdline(p))[:100]}" for p in pids)

    # -- the end-of-test contract -----------------------------------------------------------
    def assert_clean(self, timeout: float = 30.0) -> None:
        """Nothing carrying the token is alive (zombies are gone), the nodes are free."""
        ok = wait_for(lambda: not self.alive(), timeout, 0.1)
        assert ok, f"processes still alive: {self.describe(self.alive())}"
        for i in range(self.root.n_devices):
            assert holders(self.root.node(i)) == [], f"renderD{128 + i} still held"

    def kill_mine(self, pid: int, sig: int = signal.SIGKILL) -> None:
        needle = f"{TOKEN_VAR}={self.token}".encode()
        assert _signal_if_token(pid, needle, sig), f"{pid} is not ours (or gone)"

    def reap_untagged(self) -> None:
        """Fallback if a vLLM process lost its environ (e.g. SPT_NOENV not honoured): SIGKILL
        the live processes our fake logged a start event for, identity pinned by a pidfd and
        a start time matching the event's."""
        try:
            btime = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                         if line.startswith("btime"))
        except (OSError, StopIteration):
            return
        tck = os.sysconf("SC_CLK_TCK")
        for e in self.events():
            if e["event"] != "start" or e["t"] < self.started - 1:
                continue
            pid = e["pid"]
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    data = fh.read()
                fields = data[data.rfind(b")") + 2:].split()
                started = btime + int(fields[19]) / tck
                if fields[0] not in (b"Z", b"X") and abs(started - e["t"]) < 3.0:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)


@pytest.fixture
def rig(tmp_path):
    token = new_token()
    root = StandInRoot(tmp_path, n_devices=2)
    r = Rig(token, root, tmp_path)
    try:
        yield r
    finally:
        ok = wait_for(lambda: not r.alive(), 10.0, 0.1)
        left = [] if ok else r.describe(r.alive())
        reap_token(token)
        r.reap_untagged()
        for p in r.popens:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        held = {i: holders(root.node(i)) for i in range(root.n_devices)}
        root.close()
        if left or any(held.values()):
            pytest.fail(f"test left processes behind: {left}; node holders: {held}")


def phases(result: Result) -> list[str]:
    return [e["phase"] for e in result.json["events"]]


def event_of(result: Result, phase: str) -> dict:
    evs = [e for e in result.json["events"] if e["phase"] == phase]
    assert evs, f"no {phase!r} event in {result.json['events']}"
    return evs[0]


def pids_in(detail: str) -> list[int]:
    return sorted(int(p) for p in re.findall(r"\b(\d+) \(", detail))


def assert_subsequence(seq: list[str], wanted: list[str]) -> None:
    it = iter(seq)
    assert all(w in it for w in wanted), f"{wanted} is not a subsequence of {seq}"


def proc_env(pid: int) -> dict[str, str]:
    env = environ(pid)
    assert env is not None, f"cannot read the environ of {pid}"
    return env


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    return int(data[data.rfind(b")") + 2:].split()[19])


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
        (["--shutdown_timeout", "9"], False, 2, 2, 9, None),
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
    p = subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=30, cwd=rig.tmp)
    assert p.returncode == 2 and "--detach comes after MODEL" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr
    # --port on both sides of MODEL, with different values
    cmd = rig.serve_cmd(["--port", str(port + 1)], port=port, port_before=True)
    p = subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=30, cwd=rig.tmp)
    assert p.returncode == 2, p.stderr
    assert p.stderr == (f"xpuctl: error: --port {port} before MODEL and --port {port + 1} after it "
                        "disagree: give it once\n"), p.stderr

    # unsafe state directories
    bad = rig.tmp / "bad-state"
    bad.mkdir(mode=0o700)
    def serve_in(state_dir: Path) -> subprocess.CompletedProcess:
        cmd = [*XPUCTL, "--root", rig.root.root, "serve", "--vllm", VLLM_CMD, "--state-dir",
               str(state_dir), "--detach", "fake-model", "--port", str(free_port())]
        return subprocess.run(cmd, env=rig.env(), capture_output=True, text=True, timeout=30,
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
    assert rec["port"] == port and rec["host"] == "127.0.0.1"
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
    assert not _running(supervisor), down
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
    helper.wait(10)
    assert wait_for(out.exists, 10)
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
    res = rig.serve(name="hung", ready=ready, teardown=teardown, kill_after=kill_after,
                    drain=30, env={"FAKE_VLLM_FAULTS": "hang-startup"})
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


def audit_lines(rig) -> list[dict]:
    path = Path(rig.state, "audit.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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
    res = rig.serve(env={"FAKE_VLLM_FAULTS": "worker-ignores-sigterm"})
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
    assert rig.record(fg.name)["state"] == "stopped"


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
out["all"] = run("--all", "--json", "--kill-after", "1", "--release-timeout", "5")
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
                        str(TESTS_DIR), rig.root.root, rig.state, rig.token, str(rig.tmp)],
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


# ---------------------------------------------------------------------------------------------
# foreground serve


def _wait_ready(rig: Rig, fg: Foreground, timeout: float = 60) -> None:
    def ready() -> bool:
        try:
            return rig.record(fg.name)["state"] == "ready"
        except (OSError, ValueError):
            return False

    assert wait_for(ready, timeout, 0.1), str(fg)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_foreground_signal_stops_cleanly(rig, sig):
    fg = rig.serve_bg()
    _wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    core, workers = rig.tree(api)
    assert "Application startup complete." in fg.out()  # vLLM's output is streamed
    fg.proc.send_signal(sig)
    assert fg.proc.wait(60) == 0, str(fg)
    err = fg.err()
    assert "stopping (signal received" in err and "xpuctl: stopped: clean" in err, str(fg)
    assert "[shutdown] EngineCore: shutdown complete" in err  # the timeline
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
    _wait_ready(rig, fg)
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
    fg = rig.serve_bg(env={"FAKE_VLLM_FAULTS": "crash-engine", "FAKE_VLLM_CRASH_AFTER": "0.5",
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
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer of the pty is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = proc.wait(30)
    out = b"".join(chunks).decode(errors="replace")
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
    fg = rig.serve_bg(detach=True, ready=120, drain=30, teardown=3,
                      env={"FAKE_VLLM_FAULTS": "hang-startup"})
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
    assert fg.proc.wait(30) != 0, str(fg)
    assert "exited before it was ready" in fg.err(), str(fg)
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


def _running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 here may never reap one: a zombie holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


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
