#!/usr/bin/env python3
"""xpuctl performance benchmark. See bench/README.md.

Scenarios, all in one run on the same host state, every command timed as its own process
with Python's `time.perf_counter` (wall clock), rounds interleaved in rotating order:

  scan      N idle processes with K open fds each (10 of them hold a stand-in render node
            under a root R whose `proc` links to /proc): `xpuctl --root R doctor --json`,
            `fuser` and `lsof -w` on the node, and a bare Python loop (bench/floor.py) as
            the floor. N = 0 (idle) and every --sizes value.
  start     `xpuctl --version`, a completion request, `xpuctl doctor --json` on the idle
            host, against `python -c "import typer"` and `python -c pass`.
  memory    peak RSS of doctor (`/usr/bin/time -v`) at every N.
  shutdown  the fake vLLM (tests/fake_vllm/vllm) exiting at once on SIGTERM: SIGTERM to
            all-gone by itself, and `xpuctl shutdown --pid TOP` end to end.
  imports   every command run under a probe that lists sys.modules at exit: none may
            import torch, intel_extension_for_pytorch, pyzes or vllm.

Cleanup: every process this script starts is killed and reaped on exit, Ctrl-C, SIGTERM
or an error; nothing else is ever signalled.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "support"))  # the test helpers; no pytest needed
import proctools as pt

FORBIDDEN = ("torch", "intel_extension_for_pytorch", "pyzes", "vllm")
MIB = 1 << 20
COMPLETE_ENV = {"_XPUCTL_COMPLETE": "complete_bash", "COMP_WORDS": "xpuctl do", "COMP_CWORD": "1"}
T0 = time.monotonic()

# A probe that runs `python -m xpuctl ARGS` and writes the names in sys.modules at exit.
MODULES_PROBE = r"""
import atexit, os, runpy, sys
_out = os.environ.pop("XPUCTL_BENCH_MODULES")
def _dump():
    with open(_out, "w") as f:
        f.write("\n".join(sorted(sys.modules)))
atexit.register(_dump)
sys.argv = ["xpuctl"] + sys.argv[1:]
runpy.run_module("xpuctl", run_name="__main__", alter_sys=True)
"""


class BenchError(RuntimeError):
    pass


def say(msg: str) -> None:
    sys.stderr.write(f"[{time.monotonic() - T0:6.1f}s] {msg}\n")
    sys.stderr.flush()


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def shielded():
    """Cleanup runs to the end: Ctrl-C / SIGTERM during it are held, then re-raised."""
    got: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]}")


# ---------------------------------------------------------------------------------------
# host facts and limits


def meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/meminfo has no {key}")


def read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def count_procs() -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit())


def loadavg() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def preflight(max_n: int, k: int, per_proc_mib: float) -> dict:
    """Refuse to start a population the host cannot hold."""
    import resource

    facts: dict = {}
    need = max_n + 100
    current = count_procs()
    pid_max = read_int("/proc/sys/kernel/pid_max") or 32768
    threads_max = read_int("/proc/sys/kernel/threads-max") or 1 << 30
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    facts.update(procs_before=current, pid_max=pid_max, threads_max=threads_max,
                 rlimit_nproc=None if soft == resource.RLIM_INFINITY else soft)
    if current + need > min(pid_max, threads_max):
        raise BenchError(f"N={max_n} needs {need} more processes; pid_max={pid_max}, "
                         f"threads-max={threads_max}, {current} in use")
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and current + need > soft:
        raise BenchError(f"N={max_n} needs {need} more processes; ulimit -u is {soft}")
    avail = meminfo_kib("MemAvailable") * 1024
    est = int(max_n * per_proc_mib * MIB) + 1024 * MIB
    facts.update(mem_available=avail, mem_estimate=est)
    if est > avail * 0.8:
        raise BenchError(f"N={max_n} needs about {est / MIB:.0f} MiB; {avail / MIB:.0f} MiB available")
    if k >= 1000 or k < 4:
        raise BenchError("--fds must be in 4..999")
    return facts


def become_subreaper() -> bool:
    """Orphans of what we start re-parent to us, so we can reap them (PID 1 may not)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, ctypes.c_ulong(1), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------
# running and timing commands


@dataclass
class Cmd:
    key: str
    label: str
    argv: list[str]
    env: dict[str, str] | None = None
    ok: tuple[int, ...] = (0,)
    check: Callable[[subprocess.CompletedProcess], str | None] | None = None
    before: Callable[[], None] | None = None  # untimed set-up / tear-down around each run
    after: Callable[[], None] | None = None


def run(cmd: Cmd, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    """Run one command; wall time from just before spawn to after its exit and output."""
    if cmd.before:
        cmd.before()
    try:
        t0 = time.perf_counter()
        r = subprocess.run(cmd.argv, env=cmd.env, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout)
        dt = time.perf_counter() - t0
    finally:
        if cmd.after:
            cmd.after()
    if r.returncode not in cmd.ok:
        raise BenchError(f"{shlex.join(cmd.argv)} exited {r.returncode}: "
                         f"{r.stderr.decode(errors='replace')[-600:]}")
    if cmd.check is not None:
        problem = cmd.check(r)
        if problem:
            raise BenchError(f"{cmd.label}: {problem}")
    return dt, r


def runnable_others() -> int:
    """Tasks runnable right now besides the one reading (4th field of /proc/loadavg)."""
    try:
        return max(0, int(open("/proc/loadavg").read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return 0


#: other runnable tasks sampled just before every timed run, per scenario (noise indicator)
CONTENTION: dict[str, list[int]] = {}


def wait_quiet(limit_s: float, scenario: str) -> None:
    """Wait (up to limit_s) until at most one other task is runnable for 1 s in a row."""
    if limit_s <= 0:
        return
    deadline = time.monotonic() + limit_s
    calm = 0
    while time.monotonic() < deadline:
        calm = calm + 1 if runnable_others() <= 1 else 0
        if calm >= 10:
            return
        time.sleep(0.1)
    say(f"note: host still busy after waiting {limit_s:g}s; measuring {scenario} anyway")


def interleave(cmds: list[Cmd], rounds: int, scenario: str, warmup: int = 1) -> dict[str, list[float]]:
    """`warmup` untimed rounds, then `rounds` rounds; round i starts at command i mod len."""
    samples: dict[str, list[float]] = {c.key: [] for c in cmds}
    busy = CONTENTION.setdefault(scenario, [])
    for _ in range(warmup):
        for c in cmds:
            run(c)
    for i in range(rounds):
        k = i % len(cmds)
        for c in cmds[k:] + cmds[:k]:
            busy.append(runnable_others())
            dt, _ = run(c)
            samples[c.key].append(dt)
    return samples


def find_time() -> str | None:
    for cand in ("/usr/bin/time", shutil.which("time")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def peak_rss_kib(argv: list[str], env: dict[str, str], py: str, ok: tuple[int, ...]) -> int:
    """Peak RSS of one run: `/usr/bin/time -v`, else getrusage(RUSAGE_CHILDREN) in a wrapper."""
    tool = find_time()
    if tool:
        r = subprocess.run([tool, "-v", *argv], env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        m = re.search(rb"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
        if r.returncode not in ok or not m:
            raise BenchError(f"/usr/bin/time -v {shlex.join(argv)} failed: {r.stderr[-400:]!r}")
        return int(m.group(1))
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL,"
               " stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([py, "-c", wrapper, *argv], env=env, capture_output=True, timeout=600)
    return int(r.stdout.split()[-1])


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------
# the population: N forked idle processes with K fds each (bench/holders.py)


class Population:
    def __init__(self, py: str, n: int, k: int, node: str, n_hold: int, mode: str = "exec",
                 timeout: float = 300) -> None:
        self.n, self.k, self.node, self.n_hold = n, k, node, n_hold
        self.pids: list[int] = []
        self.proc = subprocess.Popen([py, str(HERE / "holders.py"), str(n), str(k), node, str(n_hold), mode],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     start_new_session=True)  # Ctrl-C reaches us, not it
        try:
            line = self._readline(timeout)
            if not line.startswith("ready"):
                raise BenchError(f"holders.py: {line.strip() or 'exited early'}")
            self.pids = [int(x) for x in line.split()[1:]]
            if len(self.pids) != n:
                raise BenchError(f"holders.py started {len(self.pids)} of {n} processes")
        except BaseException:
            self.close()
            raise

    def _readline(self, timeout: float) -> str:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]  # started with stdout=PIPE
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"holders.py: not ready after {timeout:g}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                buf += chunk
        return buf.decode()

    def verify(self) -> None:
        """Every sampled child holds exactly K fds; the first n_hold hold the node as fd K-1."""
        step = max(1, self.n // 50)
        for i in list(range(0, self.n, step)) + list(range(self.n_hold)):
            pid = self.pids[i]
            fds = os.listdir(f"/proc/{pid}/fd")
            if len(fds) != self.k:
                raise BenchError(f"holder {pid} has {len(fds)} fds, not {self.k}")
            link = os.readlink(f"/proc/{pid}/fd/{self.k - 1}")
            if (i < self.n_hold) != (link == self.node):
                raise BenchError(f"holder {pid}: fd {self.k - 1} -> {link}")

    def close(self) -> None:
        with shielded():
            self._close()

    def _close(self) -> None:
        p = self.proc
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # it SIGKILLs and reaps its own children
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()  # children die by PR_SET_PDEATHSIG and re-parent to us
                p.wait()
        if p.stdout:
            p.stdout.close()
        # Children the holder parent did not reap (it was killed) are ours now: reap those pids.
        left = set(self.pids)
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            for pid in list(left):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid  # reaped by the holder parent: not ours
                if done:
                    left.discard(pid)
            if left:
                time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# checks of command output (every timed run is checked, outside the timed interval)


def _pids_in(text: str) -> list[int]:
    return sorted(int(m) for m in re.findall(r"\d+", text))


def check_doctor(expected: list[int]) -> Callable[[subprocess.CompletedProcess], str | None]:
    def check(r: subprocess.CompletedProcess) -> str | None:
        data = json.loads(r.stdout)
        if data.get("schema") != "xpuctl.doctor/1":
            return f"unexpected schema {data.get('schema')!r}"
        for d in data["devices"]:
            if d.get("render_node") == "/dev/dri/renderD128":
                got = sorted(d.get("holders") or [])
                return None if got == expected else f"holders {got[:12]} != expected {expected[:12]}"
        return "no renderD128 in devices"
    return check


def check_doctor_stale(expected: list[int], path: str) -> Callable[[subprocess.CompletedProcess], str | None]:
    base = check_doctor(expected)

    def check(r: subprocess.CompletedProcess) -> str | None:
        problem = base(r)
        if problem:
            return problem
        arts = [x for x in json.loads(r.stdout).get("artifacts", []) if x.get("path") == path]
        return None if arts and arts[0].get("stale") else f"{path} not reported stale: {arts}"
    return check


def check_fuser(expected: list[int]) -> Callable[[subprocess.CompletedProcess], str | None]:
    def check(r: subprocess.CompletedProcess) -> str | None:
        got = _pids_in(r.stdout.decode())
        return None if got == expected else f"pids {got[:12]} != expected {expected[:12]}"
    return check


def check_lsof(expected: list[int]) -> Callable[[subprocess.CompletedProcess], str | None]:
    def check(r: subprocess.CompletedProcess) -> str | None:
        lines = r.stdout.decode().splitlines()[1:]
        got = sorted(int(line.split()[1]) for line in lines if len(line.split()) > 1)
        return None if got == expected else f"pids {got[:12]} != expected {expected[:12]}"
    return check


def check_floor(minimum: int) -> Callable[[subprocess.CompletedProcess], str | None]:
    def check(r: subprocess.CompletedProcess) -> str | None:
        n = int(r.stdout.split()[-1])
        return None if n >= minimum else f"read {n} fds, expected at least {minimum}"
    return check


# ---------------------------------------------------------------------------------------
# scenarios


@dataclass
class Ctx:
    args: argparse.Namespace
    xpuctl: str
    py: str
    env: dict[str, str]
    results: dict = field(default_factory=dict)


STALE_SHM = "/dev/shm/psm_b3nch5ta1e"  # matches the psm_* rule; nobody has it open or mapped


def scan_cmds(c: Ctx, root: str, node: str, expected: list[int], min_fds: int) -> list[Cmd]:
    stale = root + STALE_SHM

    def make_stale() -> None:
        with open(stale, "wb") as f:
            f.write(b"\0" * 4096)

    def remove_stale() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)

    return [
        Cmd("doctor", "xpuctl --root R doctor --json", [c.xpuctl, "--root", root, "doctor", "--json"],
            c.env, (0, 1), check_doctor(expected)),
        Cmd("doctor_stale", "  same, one stale file in R/dev/shm (extra)",
            [c.xpuctl, "--root", root, "doctor", "--json"], c.env, (0, 1),
            check_doctor_stale(expected, STALE_SHM), make_stale, remove_stale),
        Cmd("fuser", "fuser R/dev/dri/renderD128", ["fuser", node], c.env,
            (0,) if expected else (1,), check_fuser(expected)),
        Cmd("lsof", "lsof -w R/dev/dri/renderD128", ["lsof", "-w", node], c.env,
            (0,) if expected else (1,), check_lsof(expected)),
        Cmd("floor", "floor: python bench/floor.py", [c.py, str(HERE / "floor.py")], c.env,
            (0,), check_floor(min_fds)),
    ]


def scenario_scan(c: Ctx, n: int, root: pt.StandInRoot) -> dict:
    a = c.args
    node = root.node(0)
    n_hold = min(10, n)
    avail0 = meminfo_kib("MemAvailable")
    pop = None
    t_build = time.monotonic()
    try:
        if n:
            pop = Population(c.py, n, a.fds, node, n_hold, a.holder_mode)
            pop.verify()
        built = time.monotonic() - t_build
        cost_mib = (avail0 - meminfo_kib("MemAvailable")) / 1024
        expected = sorted(pop.pids[:n_hold]) if pop else []
        procs = count_procs()
        say(f"scan N={n}: {procs} processes on the host (population built in {built:.1f}s, "
            f"~{cost_mib:.0f} MiB); {a.rounds} rounds")
        cmds = scan_cmds(c, root.root, node, expected, n * a.fds)
        wait_quiet(a.wait_quiet, f"scan N={n}")
        samples = interleave(cmds, a.rounds, f"scan N={n}")
        doctor = cmds[0]
        rss = [peak_rss_kib(doctor.argv, c.env, c.py, doctor.ok) for _ in range(a.rss_runs)]
        out = {"n": n, "k": a.fds, "holders": n_hold, "host_procs": procs,
               "population_mib": round(cost_mib, 1), "samples": samples,
               "labels": {x.key: x.label for x in cmds}, "rss_kib": rss}
        if a.profile and n == profile_size(a):
            out["profile"] = profile_doctor(c, root.root)
        return out
    finally:
        if pop is not None:
            pop.close()


def profile_size(a: argparse.Namespace) -> int:
    return min(a.sizes, key=lambda s: abs(s - 1000))


def profile_doctor(c: Ctx, root: str, runs: int = 3) -> dict:
    """cProfile (sorted by cumulative time) and -X importtime of doctor: of `runs` runs each,
    the fastest is kept (a single run on a shared host is easily disturbed)."""
    say(f"profiling doctor (cProfile, -X importtime; fastest of {runs})")
    best: tuple[float, list[str]] | None = None
    for _ in range(runs):
        r = subprocess.run([c.py, "-m", "cProfile", "-s", "cumtime", "-m", "xpuctl", "--root", root,
                            "doctor", "--json"], env=c.env, capture_output=True, text=True, timeout=600)
        lines = r.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if "function calls" in line), len(lines))
        m = re.search(r"in ([0-9.]+) seconds", lines[start] if start < len(lines) else "")
        total = float(m.group(1)) if m else float("inf")
        if best is None or total < best[0]:
            best = (total, lines[start:start + 45])
    best_imports: list[tuple[int, str]] | None = None
    for _ in range(runs):
        r = subprocess.run([c.py, "-X", "importtime", "-m", "xpuctl", "--root", root, "doctor", "--json"],
                           env=c.env, capture_output=True, text=True, timeout=600)
        imports = []
        for line in r.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if m and len(m.group(3)) <= 3:  # top-level imports only
                imports.append((int(m.group(2)), m.group(4)))
        if best_imports is None or sum(us for us, _ in imports) < sum(us for us, _ in best_imports):
            best_imports = imports
    imports = sorted(best_imports or [], reverse=True)
    return {"cprofile": best[1] if best else [], "importtime_top_us": imports[:15],
            "importtime_total_us": sum(us for us, _ in imports)}


def scenario_start(c: Ctx) -> dict:
    a = c.args
    env_c = dict(c.env, **COMPLETE_ENV)
    cmds = [
        Cmd("version", "xpuctl --version", [c.xpuctl, "--version"], c.env,
            check=lambda r: None if r.stdout.startswith(b"xpuctl ") else f"printed {r.stdout[:60]!r}"),
        Cmd("complete", "xpuctl completion (TAB on `xpuctl do`)", [c.xpuctl], env_c,
            check=lambda r: None if b"doctor" in r.stdout.split() else f"printed {r.stdout[:60]!r}"),
        Cmd("doctor_idle", "xpuctl doctor --json (idle host)", [c.xpuctl, "doctor", "--json"], c.env,
            (0, 1), lambda r: None if json.loads(r.stdout).get("schema") == "xpuctl.doctor/1" else "bad JSON"),
        Cmd("import_typer", 'python -c "import typer"', [c.py, "-c", "import typer"], c.env),
        Cmd("pass", "python -c pass", [c.py, "-c", "pass"], c.env),
    ]
    say(f"start: {a.start_rounds} rounds of {len(cmds)} commands ({count_procs()} processes on the host)")
    wait_quiet(a.wait_quiet, "start")
    samples = interleave(cmds, a.start_rounds, "start")
    rss = [peak_rss_kib(cmds[2].argv, c.env, c.py, cmds[2].ok) for _ in range(a.rss_runs)]
    return {"samples": samples, "labels": {x.key: x.label for x in cmds}, "doctor_idle_rss_kib": rss}


def _wait_pidfds(fds: list[int], timeout: float) -> bool:
    pending = set(fds)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(int(left * 1000) + 1):
            pending.discard(fd)
    return True


def scenario_shutdown(c: Ctx) -> dict:
    a = c.args
    root = pt.StandInRoot(n_devices=2)
    state = tempfile.mkdtemp(prefix="xpuctl-bench-state-")
    token = pt.new_token()
    samples: dict[str, list[float]] = {"alone": [], "xpuctl": []}
    fake_env = {"FAKE_VLLM_TEARDOWN_S": "0", "FAKE_VLLM_STARTUP_S": "0.1"}
    imports: dict = {}

    def start() -> pt.FakeVllm:
        fv = pt.start_fake_vllm(token, root.root, shutdown_timeout=5, env=fake_env, python=c.py)
        if not fv.wait_ready(60):
            raise BenchError(f"fake vLLM not ready: {fv.log()[-600:]}")
        if not pt.wait_for(lambda: pt.holders(root.node(0)), 10):
            raise BenchError("fake vLLM worker does not hold the stand-in node")
        return fv

    def alone(fv: pt.FakeVllm) -> float:
        pids = [fv.pid] + fv.tree()
        fds = [os.pidfd_open(p) for p in pids]
        try:
            t0 = time.perf_counter()
            fv.proc.send_signal(signal.SIGTERM)
            if not _wait_pidfds(fds, 30):
                raise BenchError("fake vLLM did not exit within 30s of SIGTERM")
            return time.perf_counter() - t0
        finally:
            for fd in fds:
                os.close(fd)

    def via_xpuctl(fv: pt.FakeVllm) -> float:
        cmd = Cmd("shutdown", "xpuctl shutdown", [c.xpuctl, "--root", root.root, "shutdown", "--pid",
                                                  str(fv.pid), "--json", "--state-dir", state], c.env)
        dt, r = run(cmd, timeout=120)
        data = json.loads(r.stdout)
        if data.get("verdict") != "clean" or len(data["targets"]) != 1:
            raise BenchError(f"xpuctl shutdown: verdict {data.get('verdict')}, {len(data['targets'])} target(s)")
        return dt

    try:
        say(f"shutdown: {a.rounds} rounds (+1 warm-up) of fake-alone / xpuctl shutdown, alternating")
        wait_quiet(a.wait_quiet, "shutdown")
        busy = CONTENTION.setdefault("shutdown", [])
        for i in range(a.rounds + 1):
            order = ("alone", "xpuctl") if i % 2 == 0 else ("xpuctl", "alone")
            for kind in order:
                fv = start()
                try:
                    if i > 0:
                        busy.append(runnable_others())
                    dt = alone(fv) if kind == "alone" else via_xpuctl(fv)
                    fv.proc.wait(30)
                finally:
                    pt.reap_token(token)  # anything left of this fake (nothing, normally)
                    try:
                        fv.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
                if i > 0:
                    samples[kind].append(dt)
        say("imports: every command under a sys.modules probe (a fake vLLM is running)")
        fv = start()
        try:
            imports = import_check(c, root.root, state)
        finally:
            pt.reap_token(token)
            fv.proc.wait(10)
    finally:
        with shielded():
            pt.reap_token(token)
            root.close()
            shutil.rmtree(state, ignore_errors=True)
    return {"samples": samples, "imports": imports}


def import_check(c: Ctx, root: str, state: str) -> dict:
    commands: list[tuple[str, list[str], dict[str, str]]] = [
        ("--version", ["--version"], c.env),
        ("completion request", [], dict(c.env, **COMPLETE_ENV)),
        ("doctor --json", ["--root", root, "doctor", "--json"], c.env),
        ("doctor (table)", ["--root", root, "doctor"], c.env),
        ("ps --json", ["--root", root, "ps", "--json"], c.env),
        ("devices --json", ["--root", root, "devices", "--json"], c.env),
        ("shutdown --dry-run --all", ["--root", root, "shutdown", "--dry-run", "--all", "--state-dir", state], c.env),
    ]
    out = {}
    with tempfile.TemporaryDirectory(prefix="xpuctl-bench-mods-") as tmp:
        for name, argv, env in commands:
            path = os.path.join(tmp, "modules.txt")
            e = dict(env, XPUCTL_BENCH_MODULES=path)
            r = subprocess.run([c.py, "-c", MODULES_PROBE, *argv], env=e, stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=300)
            try:
                mods = Path(path).read_text().split()
            except OSError:
                raise BenchError(f"import probe for {name} wrote nothing (exit {r.returncode}): "
                                 f"{r.stderr.decode(errors='replace')[-400:]}") from None
            os.unlink(path)
            tops = {m.split(".")[0] for m in mods}
            out[name] = {"exit": r.returncode, "modules": len(mods),
                         "forbidden": sorted(t for t in tops if t in FORBIDDEN),
                         "rich": "rich" in tops, "psutil": "psutil" in tops}
    return out


# ---------------------------------------------------------------------------------------
# report


def row(scn: str, label: str, xs: list[float], unit: str = "s") -> str:
    if unit == "MiB":
        return f"  {scn:<11} {label:<44} {med(xs):>8.1f} {min(xs):>8.1f} {max(xs):>8.1f} {len(xs):>3}  MiB"
    return f"  {scn:<11} {label:<44} {med(xs):>8.3f} {min(xs):>8.3f} {max(xs):>8.3f} {len(xs):>3}"


def build_report(c: Ctx) -> tuple[str, list[dict]]:
    a, res = c.args, c.results
    L: list[str] = []
    h = res["host"]
    L.append(f"xpuctl benchmark — {h['date']}")
    L.append(f"host: {h['cpus']} CPUs, {h['mem_total_gib']:.1f} GiB, Linux {h['kernel']}; "
             f"{h['python']}; typer {h['typer']}; xpuctl {h['xpuctl_version']} (git {h['git']})")
    L.append(f"bytecode: {h['bytecode']}")
    L.append(f"rounds: scan/shutdown {a.rounds}, start {a.start_rounds} (+1 untimed warm-up each), "
             f"interleaved in rotating order; K={a.fds} fds per process ({a.holder_mode}'d holders); "
             "10 hold the node")
    L.append(f"load average at start {h['load_start']}, at end {h.get('load_end')}; "
             f"processes on the host before the run: {h['procs_before']}")
    if a.rounds < 5:
        L.append("NOTE: fewer than 5 rounds (--quick?): figures are indicative only")
    L.append("")
    what = "measurement (wall seconds unless noted)"
    L.append(f"  {'scenario':<11} {what:<44} {'median':>8} {'min':>8} {'max':>8} {'n':>3}")
    L.append("  " + "-" * 86)
    scans = res.get("scan", {})
    for n, s in sorted(scans.items()):
        scn = "idle N=0" if n == 0 else f"scan N={n}"  # N=0: every idle stage, pooled
        for key in ("doctor", "doctor_stale", "fuser", "lsof", "floor"):
            if key in s["samples"]:
                L.append(row(scn, s["labels"][key], s["samples"][key]))
        L.append(row(scn, "doctor peak RSS (/usr/bin/time -v)", [x / 1024 for x in s["rss_kib"]], "MiB"))
    st = res.get("start")
    if st:
        for key in ("version", "complete", "doctor_idle", "import_typer", "pass"):
            L.append(row("start", st["labels"][key], st["samples"][key]))
        L.append(row("start", "doctor --json (idle) peak RSS", [x / 1024 for x in st["doctor_idle_rss_kib"]], "MiB"))
    sd = res.get("shutdown")
    if sd:
        L.append(row("shutdown", "fake vLLM alone: SIGTERM -> all gone", sd["samples"]["alone"]))
        L.append(row("shutdown", "xpuctl --root R shutdown --pid TOP --json", sd["samples"]["xpuctl"]))
    L.append("")

    # ratios
    L.append("ratios (of medians)")
    idle = scans.get(0)
    for n, s in sorted(scans.items()):
        if n == 0:
            continue
        m = {k: med(v) for k, v in s["samples"].items()}
        d0 = baseline(scans, n, "doctor")
        extra = ""
        if d0 is not None:
            extra = (f"   doctor above idle {m['doctor'] - d0:.3f}s "
                     f"({(m['doctor'] - d0) / n * 1000:.3f}s per 1000 procs)")
        if "doctor_stale" in m:
            extra += f"   one stale file adds {m['doctor_stale'] - m['doctor']:+.3f}s"
        L.append(f"  N={n:<5} doctor/fuser {m['doctor'] / m['fuser']:.2f}   doctor/lsof {m['doctor'] / m['lsof']:.2f}"
                 f"   doctor/floor {m['doctor'] / m['floor']:.2f}   fuser/floor {m['fuser'] / m['floor']:.2f}"
                 f"   lsof/floor {m['lsof'] / m['floor']:.2f}{extra}")
    if idle and "doctor_by_stage" in idle:
        stages = ", ".join(f"{x:.3f}s" for x in idle["doctor_by_stage"])
        L.append(f"  idle N=0 is measured before, between and after the populations (doctor medians {stages}); "
                 "the table pools them; each N's figures above idle use the idle right before and after it")
    growth = growth_figure(scans)
    if growth:
        lo, hi, g, _lim = growth
        others = "   ".join(f"{k} {v:.2f}" for k, v in
                            ((k, growth_figure(scans, k)[2]) for k in ("fuser", "lsof", "floor")))  # type: ignore[index]  # a figure, not None, once both sizes ran
        L.append(f"  growth above idle, N={hi} / N={lo} ({hi / lo:g} x the processes and fds): "
                 f"doctor {g:.2f}   {others}")
        mins = "   ".join(f"{k} {growth_figure(scans, k, min)[2]:.2f}"  # type: ignore[index]  # as above
                           for k in ("doctor", "fuser", "lsof", "floor"))
        L.append(f"  the same from the fastest runs (less sensitive to other work on the host): {mins}")
    if st:
        m = {k: med(v) for k, v in st["samples"].items()}
        L.append(f"  start: --version/import typer {m['version'] / m['import_typer']:.2f}   "
                 f"completion/import typer {m['complete'] / m['import_typer']:.2f}   "
                 f"doctor idle/import typer {m['doctor_idle'] / m['import_typer']:.2f}   "
                 f"import typer/pass {m['import_typer'] / m['pass']:.2f}")
    if sd:
        ov = med(sd["samples"]["xpuctl"]) - med(sd["samples"]["alone"])
        L.append(f"  shutdown overhead: median(xpuctl shutdown) - median(fake alone) = {ov:.3f}s")
    if CONTENTION:
        L.append("")
        L.append("contention: other runnable tasks on the host just before each timed run (median / max)")
        L.append("  " + "   ".join(f"{k}: {med(v):g}/{max(v)}" for k, v in CONTENTION.items() if v))
    if sd and sd.get("imports"):
        L.append("")
        L.append("imports (sys.modules at exit of each command)")
        for name, info in sd["imports"].items():
            L.append(f"  {name:<26} exit {info['exit']}  {info['modules']:>4} modules  "
                     f"rich {'yes' if info['rich'] else 'no ':<3}  psutil {'yes' if info['psutil'] else 'no ':<3}  "
                     f"forbidden: {', '.join(info['forbidden']) or 'none'}")

    targets = evaluate_targets(c)
    L.append("")
    L.append("targets")
    for t in targets:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        L.append(f"  {verdict:<7} {t['name']:<58} {t['figure']:>20}  (limit {t['limit']})")
    missed = [t for t in targets if t["met"] is False]
    met = [t for t in targets if t["met"] is True]
    unmeasured = len(targets) - len(met) - len(missed)
    L.append(f"  {len(met)} of {len(targets)} met" + (f", {unmeasured} not measured" if unmeasured else "")
             + ("; missed: " + "; ".join(t["name"] for t in missed) if missed else ""))

    prof = next((s.get("profile") for s in scans.values() if s.get("profile")), None)
    if prof:
        L.append("")
        L.append(f"profile of doctor at N={profile_size(a)} (cProfile, cumulative; fastest of 3 runs)")
        L.extend("  " + x for x in prof["cprofile"])
        L.append(f"  -X importtime: top-level imports {prof['importtime_total_us'] / 1000:.1f} ms in total; largest:")
        for us, name in prof["importtime_top_us"]:
            L.append(f"    {us / 1000:8.1f} ms  {name}")
    return "\n".join(L), targets


def baseline(scans: dict, n: int, key: str, stat: Callable[[list[float]], float] = med) -> float | None:
    """The idle time of `key` around population N: the idle stages right before and after
    it, pooled (all idle stages pooled when the run has no per-stage record)."""
    around = scans.get(n, {}).get("idle_samples", {}).get(key)
    if around:
        return stat(around)
    idle = scans.get(0)
    return stat(idle["samples"][key]) if idle else None


def growth_figure(scans: dict, key: str = "doctor", stat: Callable[[list[float]], float] = med
                  ) -> tuple[int, int, float, float] | None:
    """(smallest N, largest N, time above idle at largest / at smallest, limit)."""
    sizes = sorted(n for n in scans if n)
    if 0 not in scans or len(sizes) < 2:
        return None
    lo, hi = sizes[0], sizes[-1]
    dl = stat(scans[lo]["samples"][key]) - baseline(scans, lo, key, stat)
    dh = stat(scans[hi]["samples"][key]) - baseline(scans, hi, key, stat)
    limit = 18 / 16 * hi / lo  # the issue: 18 x for 16 x the fds
    return lo, hi, (dh / dl if dl > 0 else float("inf")), limit


def evaluate_targets(c: Ctx) -> list[dict]:
    res = c.results
    scans, st, sd = res.get("scan", {}), res.get("start"), res.get("shutdown")
    out: list[dict] = []

    def add(name: str, value: float | None, limit: float, fmt: str, lim_fmt: str) -> None:
        out.append({"name": name, "value": value, "limit_value": limit,
                    "figure": "not measured" if value is None else fmt.format(value),
                    "limit": lim_fmt.format(limit), "met": None if value is None else value <= limit})

    s = scans.get(1000)
    m = {k: med(v) for k, v in s["samples"].items()} if s else None
    add("doctor / fuser at N=1000", m and m["doctor"] / m["fuser"], 1.0, "{:.3f} x", "{:.2f} x")
    add("doctor / lsof at N=1000", m and m["doctor"] / m["lsof"], 0.35, "{:.3f} x", "{:.2f} x")
    add("doctor / bare Python floor at N=1000", m and m["doctor"] / m["floor"], 1.5, "{:.3f} x", "{:.2f} x")
    g = growth_figure(scans)
    add(f"growth of doctor above idle, N={g[1]} vs N={g[0]}" if g else "growth of doctor above idle",
        g and g[2], g[3] if g else 18.0, "{:.2f} x", "{:.1f} x")  # growth: 2 decimals
    sm = {k: med(v) for k, v in st["samples"].items()} if st else None
    add("xpuctl --version / python -c 'import typer'", sm and sm["version"] / sm["import_typer"], 1.15,
        "{:.3f} x", "{:.2f} x")
    add("completion request / python -c 'import typer'", sm and sm["complete"] / sm["import_typer"], 1.3,
        "{:.3f} x", "{:.2f} x")
    add("xpuctl doctor --json on the idle host", sm and sm["doctor_idle"], 0.35, "{:.3f} s", "{:.2f} s")
    add("doctor peak RSS at N=1000", s and med(s["rss_kib"]) / 1024, 80.0, "{:.1f} MiB", "{:.0f} MiB")
    ov = (med(sd["samples"]["xpuctl"]) - med(sd["samples"]["alone"])) if sd else None
    add("shutdown overhead (xpuctl shutdown - fake alone)", ov, 0.3, "{:.3f} s", "{:.2f} s")
    imp = sd.get("imports") if sd else None
    bad = sorted({f"{n}: {m2}" for n, i in (imp or {}).items() for m2 in i["forbidden"]})
    out.append({"name": "no command imports torch/ipex/pyzes/vllm", "value": len(bad) if imp else None,
                "limit_value": 0, "figure": ("none imported" if not bad else "; ".join(bad)) if imp else "not measured",
                "limit": "none", "met": (not bad) if imp else None})
    return out


def host_facts(c: Ctx) -> dict:
    try:
        git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "?"
        if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "xpuctl"],
                          timeout=10).returncode:
            git += "+dirty"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    ver = subprocess.run([c.xpuctl, "--version"], capture_output=True, text=True, env=c.env).stdout.split()
    pyver, typer_ver = (subprocess.run(
        [c.py, "-c", "import sys, importlib.metadata as m; print(sys.version.split()[0], m.version('typer'))"],
        capture_output=True, text=True).stdout.split() + ["?", "?"])[:2]
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(),
            "mem_total_gib": meminfo_kib("MemTotal") / MIB, "kernel": platform.release(),
            "python": f"{c.py} (Python {pyver})", "typer": typer_ver, "xpuctl": c.xpuctl,
            "bytecode": "PYTHONDONTWRITEBYTECODE=1" if c.args.no_bytecode_cache else "private PYTHONPYCACHEPREFIX",
            "xpuctl_version": ver[-1] if ver else "?", "git": git, "load_start": loadavg(),
            "procs_before": count_procs()}


def interpreter_of(script: str) -> str:
    """The interpreter in a console script's #! line (so comparisons use the same Python)."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode().strip()
        if first.startswith("#!"):
            cand = shlex.split(first[2:])[0]
            if os.access(cand, os.X_OK) and "python" in os.path.basename(cand):
                return cand
    except (OSError, IndexError, UnicodeDecodeError):
        pass
    return sys.executable


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="xpuctl performance benchmark (see bench/README.md)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds for scan and shutdown (default 5)")
    p.add_argument("--start-rounds", type=int, help="timed rounds for start-up commands (default 3 x --rounds)")
    p.add_argument("--sizes", default="250,1000,4000",
                   help="process counts N (default 250,1000,4000; N=0 is always run)")
    p.add_argument("--fds", type=int, default=35, help="open fds per process, 0-2 included (default 35)")
    p.add_argument("--holder-mode", choices=("exec", "fork"), default="exec",
                   help="holders exec `sleep infinity` (default, ~0.2 MiB each) "
                        "or stay forked Python copies (~0.6 MiB)")
    p.add_argument("--rss-runs", type=int, default=3, help="runs under /usr/bin/time -v per N (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, sizes 250,1000")
    p.add_argument("--only", default="scan,start,shutdown", help="scenarios to run (comma list)")
    p.add_argument("--profile", action="store_true", help="also cProfile + importtime doctor at the N nearest 1000")
    p.add_argument("--xpuctl", help="the xpuctl executable (default: next to this Python, else on PATH)")
    p.add_argument("--json", action="store_true", help="print raw numbers as JSON on stdout (table on stderr)")
    p.add_argument("--save", metavar="PATH", help="also write the JSON to PATH")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--wait-quiet", type=float, default=30, metavar="S",
                   help="before each scenario, wait up to S seconds for the host to be quiet (default 30; 0: don't)")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="run commands with PYTHONDONTWRITEBYTECODE=1 (modules without a .pyc compile on "
                        "every run); default: a private PYTHONPYCACHEPREFIX filled by the warm-up round")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds = min(a.rounds, 3)
        if a.sizes == p.get_default("sizes"):
            a.sizes = "250,1000"
    a.sizes = sorted({int(x) for x in a.sizes.split(",") if x.strip() and int(x) > 0})
    a.start_rounds = a.start_rounds or 3 * a.rounds
    a.only = {x.strip() for x in a.only.split(",") if x.strip()}
    if a.rounds < 1 or not a.sizes:
        p.error("need --rounds >= 1 and at least one size")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    xpuctl = a.xpuctl or (str(Path(sys.executable).with_name("xpuctl"))
                          if Path(sys.executable).with_name("xpuctl").exists() else shutil.which("xpuctl"))
    if not xpuctl:
        raise BenchError("xpuctl not found: pass --xpuctl PATH")
    for tool in ("fuser", "lsof"):
        if not shutil.which(tool):
            raise BenchError(f"{tool} not found (apt-get install psmisc lsof)")
    if not find_time():
        say("note: /usr/bin/time not found (apt-get install time): peak RSS via getrusage instead")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XPUCTL_", "_XPUCTL_")) and k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    pyc_dir = None
    if a.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        # Cached bytecode, as after a normal install, written outside the source tree; the
        # warm-up round fills it (for xpuctl and typer alike).
        pyc_dir = tempfile.mkdtemp(prefix="xpuctl-bench-pyc-")
        env["PYTHONPYCACHEPREFIX"] = pyc_dir
    try:
        return _main(a, xpuctl, env)
    finally:
        if pyc_dir:
            shutil.rmtree(pyc_dir, ignore_errors=True)


def _main(a: argparse.Namespace, xpuctl: str, env: dict[str, str]) -> int:
    c = Ctx(a, xpuctl, interpreter_of(xpuctl), env)
    # measured: ~0.2 MiB per exec'd holder, ~0.6 MiB per forked one; estimate with a margin
    facts = preflight(max(a.sizes) if "scan" in a.only else 0, a.fds, 0.5 if a.holder_mode == "exec" else 1.0)
    c.results["host"] = host_facts(c) | {"limits": facts}
    c.results["config"] = {"rounds": a.rounds, "start_rounds": a.start_rounds, "sizes": a.sizes,
                           "holder_mode": a.holder_mode,
                           "fds": a.fds, "rss_runs": a.rss_runs, "xpuctl": xpuctl, "python": c.py}
    if os.getloadavg()[0] > 0.5:
        say(f"note: load average {os.getloadavg()[0]:.2f}: other work is running; "
            "interleaving spreads it over all commands, but figures will be noisier")
    become_subreaper()

    if "scan" in a.only:
        c.results["scan"] = {}
        root = pt.StandInRoot(n_devices=2)
        try:
            # Idle is measured before, between and after the populations. Each population's
            # "above idle" figures use the idle right before and right after it (pooled), so
            # a slow stretch of the host (this VM is slower for a while after large frees)
            # shifts a population and its own baseline together, not one of them alone.
            idles = [scenario_scan(c, 0, root)]
            for n in a.sizes:
                c.results["scan"][n] = scenario_scan(c, n, root)
                idles.append(scenario_scan(c, 0, root))
                c.results["scan"][n]["idle_samples"] = {
                    key: idles[-2]["samples"][key] + idles[-1]["samples"][key] for key in idles[-1]["samples"]}
            idle = idles[0]
            idle["doctor_by_stage"] = [med(x["samples"]["doctor"]) for x in idles]
            for again in idles[1:]:
                for key, xs in again["samples"].items():
                    idle["samples"][key].extend(xs)
                idle["rss_kib"].extend(again["rss_kib"])
            c.results["scan"][0] = idle
        finally:
            root.close()
    if "start" in a.only:
        c.results["start"] = scenario_start(c)
    if "shutdown" in a.only:
        c.results["shutdown"] = scenario_shutdown(c)
    c.results["host"]["load_end"] = loadavg()
    c.results["elapsed_s"] = round(time.monotonic() - T0, 1)
    c.results["contention"] = CONTENTION

    text, targets = build_report(c)
    c.results["targets"] = targets
    c.results["summary"] = summarise(c.results)
    text += f"\n\ntotal benchmark time {c.results['elapsed_s']:.0f}s"
    blob = json.dumps(c.results, indent=2, default=str)
    if a.save:
        Path(a.save).write_text(blob + "\n")
    if a.json:
        sys.stderr.write(text + "\n")
        sys.stdout.write(blob + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 1 if a.check and any(t["met"] is False for t in targets) else 0


def summarise(res: dict) -> dict:
    """Medians / min / max of every sample list, for scripts."""
    out: dict = {}
    for n, s in res.get("scan", {}).items():
        out[f"scan N={n}"] = {k: {"median": med(v), "min": min(v), "max": max(v)} for k, v in s["samples"].items()}
        out[f"scan N={n}"]["rss_mib"] = {"median": med(s["rss_kib"]) / 1024}
    for name in ("start", "shutdown"):
        if name in res:
            out[name] = {k: {"median": med(v), "min": min(v), "max": max(v)}
                         for k, v in res[name]["samples"].items()}
    return out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.stderr.write("\nbench: interrupted; everything it started has been stopped\n")
        sys.exit(130)
    except BenchError as exc:
        sys.stderr.write(f"bench: error: {exc}\n")
        sys.exit(2)
