"""The benchmark's machinery: host facts and limits, running and timing commands (rounds
interleaved in rotating order, each command its own process timed with `time.perf_counter`),
the population of idle holders, and the checks of each command's output. Used by run.py
(scenarios.py, report.py) and by scanpass.py and snapshot.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "support"))  # the test helpers; no pytest needed
import proctools as pt  # noqa: F401 (the scenarios and snapshot.py use it through harness)

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


def entry(main: Callable[[list[str]], int]) -> None:
    """Run a bench's `main(argv)` as a program: SIGTERM and SIGHUP end it as Ctrl-C does
    (whatever it started is stopped by its own cleanup), a BenchError is one line, exit 2."""
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
                 timeout: float = 300, shared: str | None = None) -> None:
        """`shared`: a directory for issue 38's layout (holders.py `shared:DIR`): every fd on
        five files there, one child in n / n_hold holding the node as an extra fd."""
        self.n, self.k, self.node, self.n_hold = n, k, node, n_hold
        self.shared = shared
        self.pids: list[int] = []
        extra = [f"shared:{shared}"] if shared else []
        self.proc = subprocess.Popen([py, str(HERE / "holders.py"), str(n), str(k), node, str(n_hold), mode,
                                      *extra],
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

    @property
    def holders(self) -> list[int]:
        """The pids that hold the node."""
        if not self.shared:
            return self.pids[:self.n_hold]
        every = max(1, self.n // self.n_hold) if self.n_hold else 0
        return [p for i, p in enumerate(self.pids) if every and i % every == 0]

    def verify(self) -> None:
        """Every sampled child holds exactly K fds; the first n_hold hold the node as fd K-1
        (shared layout: every holder holds it as fd K, an extra one)."""
        if self.shared:
            held = set(self.holders)
            for pid in self.pids[::max(1, self.n // 50)] + self.holders[:5]:
                fds = os.listdir(f"/proc/{pid}/fd")
                want = self.k + (pid in held)
                if len(fds) != want:
                    raise BenchError(f"holder {pid} has {len(fds)} fds, not {want}")
            return
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
