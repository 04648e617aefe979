"""The rig for end-to-end tests of `xpuctl serve` and `xpuctl shutdown` against the fake vLLM.

xpuctl runs as a subprocess with a stand-in root (``proc`` -> ``/proc``, plain-file render
nodes), the fake vLLM (``tests/fake_vllm/vllm``) builds the real process tree, and its
JSON-lines event log (``FAKE_VLLM_EVENTS``) tells which process received which signal, and
when. Every process a test starts carries the rig's token (xpuctl passes its environment
through to vLLM); the ``rig`` fixture (proc_fixtures.py) checks that nothing carrying it
survives a test and that the stand-in nodes are free, then SIGKILLs whatever carries it.
Importable without pytest."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from proctools import (
    FAKE_VLLM,
    TOKEN_VAR,
    StandInRoot,
    _signal_if_token,
    cmdline,
    environ,
    free_port,
    holders,
    pids_with_token,
    read_events,
    wait_for,
)

PY = sys.executable
XPUCTL = [PY, "-m", "xpuctl"]
VLLM_CMD = f"{PY} {FAKE_VLLM} serve"
SUPPORT_DIR = Path(__file__).resolve().parent  # where proctools is, for child scripts
BDF0, BDF1 = StandInRoot.bdf(0), StandInRoot.bdf(1)

# never inherited from the caller's environment: they would change what is being tested
_SCRUB = {
    "XPUCTL_ROOT", "XPUCTL_STATE_DIR", "XPUCTL_VLLM", "XPUCTL_RUN_ID", "XPUCTL_DEBUG",
    "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR", "ZE_FLAT_DEVICE_HIERARCHY",
    "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_PROCESS_NAME_PREFIX", "SPT_NOENV", TOKEN_VAR,
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
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
        """`port_before`: `serve --port N ... MODEL` (xpuctl's option) instead of after MODEL;
        `teardown=None`: no --teardown-timeout (serve's default budget)."""
        cmd = [*XPUCTL, "--root", root or self.root.root, "serve"]
        if port_before:
            cmd += ["--port", str(port)]
        cmd += ["--vllm", VLLM_CMD,
                "--state-dir", self.state, "--drain-timeout", str(drain),
                *(["--teardown-timeout", str(teardown)] if teardown is not None else []),
                "--ready-timeout", str(ready),
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


def audit_lines(rig) -> list[dict]:
    path = Path(rig.state, "audit.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_ready(rig: Rig, fg: Foreground, timeout: float = 60) -> None:
    def ready() -> bool:
        try:
            return rig.record(fg.name)["state"] == "ready"
        except (OSError, ValueError):
            return False

    assert wait_for(ready, timeout, 0.1), str(fg)


def running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 here may never reap one: a zombie holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"

