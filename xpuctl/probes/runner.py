"""Running the device probes: every probe at once, each a child process in its own session,
collected until a deadline (stragglers killed with their process group).

    running = start(environ, timeout)        # nothing waits here
    scan = take_scan(..., exclude_pids=running.pids)   # scan /proc meanwhile
    results = running.finish()               # tuple[ProbeResult]

Probes always describe the live machine (`live: true`), whatever --root says. The probe
environment is the caller's minus ZE_AFFINITY_MASK and ONEAPI_DEVICE_SELECTOR, plus PCI device
order, COMPOSITE hierarchy and Sysman, so one probe device is one PCI device and indices follow
PCI order.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

from xpuctl.parse import kmd, xpusmi
from xpuctl.parse.probes import ProbeResult, parse_probe_output
from xpuctl.state import audit

PROBES = ("sysman", "torch", "xpu-smi", "kmd")
#: the probes of a re-check (doctor --wait-clean): xpu-smi runs once per command, never in a
#: loop (`xpu-smi ps` allocates about 211 MB of device memory and lists itself: xpumanager #116)
ONCE_ONLY = tuple(n for n in PROBES if n != "xpu-smi")
MODULES = {"sysman": "xpuctl.probes.children.sysman", "torch": "xpuctl.probes.children.torch_xpu",
           "kmd": "xpuctl.probes.children.kmd"}
DROP_ENV = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
SET_ENV = {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE",
           "ZES_ENABLE_SYSMAN": "1"}
DEFAULT_TIMEOUT = 10.0
OUTPUT_LIMIT = 4 << 20


def probe_python() -> str:
    """The Python every probe child runs (the torch probe of --deep, the collective check's
    ranks): the one running xpuctl, so torch must be installed beside xpuctl."""
    return sys.executable


def probe_env(environ: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in DROP_ENV}
    env.update(SET_ENV)
    return xpuctl_path(env)


def xpuctl_path(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with this copy of xpuctl on PYTHONPATH: the child imports xpuctl itself
    (appended: stand-ins and the caller's own path entries keep precedence)."""
    env = dict(environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, here])
    return env


class _Job:
    """One child: its own session (process group), stdout/stderr collected, exit seen by pidfd."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.t0 = time.monotonic()
        self.t1: float | None = None
        self.out = bytearray()
        self.err = bytearray()
        self.rc: int | None = None
        self.timed_out = False
        self.stuck = False
        self.pidfd: int | None = None
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True, close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Has the leader exited? (not reaped: its pid, hence its group, cannot be reused yet)"""
        if self.t1 is not None:
            return True
        try:
            exited = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            exited = True  # reaped already
        if exited:
            self.t1 = time.monotonic()
            self.kill_group()  # anything it left behind in its group goes with it
        return self.t1 is not None

    def kill_group(self) -> None:
        """SIGKILL the probe's own process group (it is our child, in a session of its own;
        its unreaped leader keeps the group id from being reused). Audited like every
        signal, when the command records (serve --preflight deep)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        audit.record("signal", {"pgid": self.pid, "label": f"probe {self.name}"}, "sent",
                     signal="SIGKILL")

    @property
    def seconds(self) -> float:
        return round((self.t1 or time.monotonic()) - self.t0, 3)

    def text(self) -> str:
        return self.out.decode("utf-8", "replace")

    def last_error_line(self) -> str:
        lines = [ln for ln in self.err.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:200] if lines else ""


class Running:
    """Probes started by `start`; `finish` collects them (at most until the deadline)."""

    def __init__(self, jobs: list[_Job], missing: list[ProbeResult], timeout: float,
                 since: float | None = None) -> None:
        self.jobs = jobs
        self.missing = missing
        self.timeout = timeout
        first = min((j.t0 for j in jobs), default=time.monotonic())
        # `since`: when the command started (monotonic), so that the command as a whole stays
        # within the timeout; a probe still gets at least half of it
        start = first if since is None else max(min(since, first), first - timeout / 2)
        self.deadline = start + timeout

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(j.pid for j in self.jobs)

    def _collect(self) -> None:
        sel = selectors.DefaultSelector()
        for j in self.jobs:
            assert j.proc.stdout is not None and j.proc.stderr is not None  # started with PIPEs
            sel.register(j.proc.stdout, selectors.EVENT_READ, (j, j.out))
            sel.register(j.proc.stderr, selectors.EVENT_READ, (j, j.err))
            try:
                j.pidfd = os.pidfd_open(j.pid)
                sel.register(j.pidfd, selectors.EVENT_READ, (j, None))
            except (AttributeError, OSError):
                j.pidfd = None
        try:
            while True:
                pending = [j for j in self.jobs if j.t1 is None]
                pipes = [k for k in sel.get_map().values() if k.data[1] is not None]
                if not pending and not pipes:
                    return
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return
                polled = any(j.pidfd is None for j in pending)
                for key, _ in sel.select(min(left, 0.01) if polled else left):
                    j, buf = key.data
                    if buf is None:
                        sel.unregister(key.fileobj)
                        j.exited()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif len(buf) < OUTPUT_LIMIT:
                        buf += chunk
                for j in pending:
                    if j.pidfd is None:
                        j.exited()
        finally:
            sel.close()

    def finish(self) -> tuple[ProbeResult, ...]:
        try:
            self._collect()
        finally:
            for j in self.jobs:
                if not j.exited():
                    j.timed_out = True
                    j.kill_group()
                try:
                    j.rc = j.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    j.stuck = True  # in the kernel (D state): SIGKILL lands when it returns
                for f in (j.proc.stdout, j.proc.stderr):
                    if f is not None:
                        f.close()
                if j.pidfd is not None:
                    os.close(j.pidfd)
        by_name = {j.name: j for j in self.jobs}
        results = list(self.missing)
        for name in PROBES:
            if name == "xpu-smi":
                if "xpu-smi discovery" in by_name:
                    results.append(self._xpusmi(by_name["xpu-smi discovery"], by_name["xpu-smi ps"],
                                                by_name.get("xpu-smi version")))
            elif name in by_name:
                results.append(self._child(by_name[name]))
        order = {n: i for i, n in enumerate(PROBES)}
        return tuple(sorted(results, key=lambda r: order.get(r.name, len(order))))

    def _timed_out(self, name: str, jobs: list[_Job]) -> ProbeResult:
        why = f"no answer within {self.timeout:g} s; killed with its process group"
        if any(j.stuck for j in jobs):
            why += " (a process is stuck in the kernel and will exit when the driver returns)"
        return ProbeResult(name, False, why, None, round(self.timeout, 3), True, timed_out=True)

    def _child(self, j: _Job) -> ProbeResult:
        if j.timed_out:
            return self._timed_out(j.name, [j])
        text = j.text()
        try:
            if j.name == "kmd":
                return kmd.probe_result(text, j.seconds, True)
            return parse_probe_output(text, j.name, j.seconds, True)
        except ValueError as exc:  # ProbeOutputError, KmdReplyError
            why = f"unreadable output ({exc})"
            if j.rc:
                why = f"exited with {j.rc}" + (f": {j.last_error_line()}" if j.last_error_line() else "")
            return ProbeResult(j.name, False, why, None, j.seconds, True)

    def _xpusmi(self, disc: _Job, ps: _Job, ver: _Job | None) -> ProbeResult:
        if disc.timed_out or ps.timed_out:
            return self._timed_out("xpu-smi", [disc, ps])
        seconds = max(disc.seconds, ps.seconds)
        # a version that did not answer is an unknown version (the sizes go unused), not a timeout
        version = (ver.rc, ver.text()) if ver is not None and not ver.timed_out else None
        return xpusmi.probe_result((disc.rc, disc.text()), (ps.rc, ps.text()), seconds, True, version)


def not_again(name: str) -> ProbeResult:
    """A probe not run again on a re-check (ONCE_ONLY), said as such."""
    return ProbeResult(name, False, "not run again on a re-check: `xpu-smi ps` allocates about "
                       "211 MB of device memory and lists itself (xpumanager #116)", None, None,
                       True)


def start(environ: dict[str, str], timeout: float = DEFAULT_TIMEOUT,
          names: tuple[str, ...] = PROBES, since: float | None = None) -> Running:
    """Start every probe now, each in its own session; nothing waits here. `since`
    (time.monotonic() of the command's own start) makes the deadline count from there."""
    env = probe_env(environ)
    jobs: list[_Job] = []
    missing: list[ProbeResult] = []

    def launch(name: str, argv: list[str]) -> bool:
        try:
            jobs.append(_Job(name, argv, env))
            return True
        except OSError as exc:
            missing.append(ProbeResult(name.split(" ")[0], False, f"could not start: {exc}", None, None, True))
            return False

    try:
        for name in names:
            if name in MODULES:
                launch(name, [probe_python(), "-m", MODULES[name]])
            elif name == "xpu-smi":
                exe = shutil.which("xpu-smi", path=env.get("PATH", os.defpath))
                if exe is None:
                    missing.append(ProbeResult("xpu-smi", False, "xpu-smi is not on PATH", None, None, True))
                elif launch("xpu-smi discovery", [exe, "discovery", "-j"]):
                    if not launch("xpu-smi ps", [exe, "ps", "-j"]):
                        gone = jobs.pop()  # half a probe is none: stop the discovery just started
                        gone.kill_group()
                        gone.proc.wait()
                    else:
                        # the unit of ps's sizes depends on the version (parse.xpusmi); one
                        # that cannot start is an unknown version, not a missing probe
                        try:
                            jobs.append(_Job("xpu-smi version", [exe, "--version"], env))
                        except OSError:
                            pass
    except BaseException:
        for j in jobs:
            j.kill_group()
            j.proc.wait()
        raise
    return Running(jobs, missing, timeout, since)
