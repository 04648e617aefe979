"""The scenarios of bench/run.py: scan (N holders; doctor against fuser, lsof and the floor),
start, shutdown and the import check. Each returns its samples; report.py judges them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import (
    COMPLETE_ENV,
    CONTENTION,
    FORBIDDEN,
    HERE,
    MODULES_PROBE,
    BenchError,
    Cmd,
    Population,
    check_doctor,
    check_doctor_stale,
    check_floor,
    check_fuser,
    check_lsof,
    count_procs,
    interleave,
    meminfo_kib,
    peak_rss_kib,
    pt,
    run,
    runnable_others,
    say,
    shielded,
    wait_quiet,
)

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


#: doctor under cProfile, as the installed entry runs it, but without its exit (cli.leave
#: ends the process with os._exit: the profiler would never print); the statistics go to
#: stderr, the command's output to stdout.
PROFILED = """
import cProfile, pstats, sys
prof = cProfile.Profile()
prof.enable()
from xpuctl.cli.group import main
sys.argv = ["xpuctl"] + sys.argv[1:]
try:
    main()
except SystemExit:
    pass
prof.disable()
pstats.Stats(prof, stream=sys.stderr).sort_stats("cumtime").print_stats(40)
"""


def profile_doctor(c: Ctx, root: str, runs: int = 3) -> dict:
    """cProfile (sorted by cumulative time) and -X importtime of doctor: of `runs` runs each,
    the fastest is kept (a single run on a shared host is easily disturbed)."""
    say(f"profiling doctor (cProfile, -X importtime; fastest of {runs})")
    best: tuple[float, list[str]] | None = None
    for _ in range(runs):
        r = subprocess.run([c.py, "-c", PROFILED, "--root", root, "doctor", "--json"], env=c.env,
                           capture_output=True, text=True, timeout=600)
        lines = r.stderr.splitlines()
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
