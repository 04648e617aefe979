#!/usr/bin/env python3
"""doctor on issue 38's population, against an earlier commit, fuser, lsof and the bare loop.

    python bench/against.py [--against REV] [--sizes 1000,4000] [--rounds 7] [--stale 15]

The population (bench/holders.py `shared:DIR`): N processes, each holding 35 fds on five
shared regular files, one in ten also holding the stand-in render node of a StandInRoot R
(whose `proc` links to /proc). For each N, interleaved in rotating order, each command its own
process: `xpuctl --root R doctor --json`; the same with --stale regular files `psm_*` in
R/dev/shm that nobody holds (each must be judged stale); `xpuctl doctor --json` on the real
root; `fuser` and `lsof -w` on the node; and the loop (bench/floor.py). With `--against REV`
each doctor command also runs from REV, built in a temporary venv (a git worktree of REV and
a venv, both removed after), in the same rounds. This checkout is installed the same way (a
copy of it, as it is on disk, in a venv of its own: byte-compiled by pip) unless --xpuctl
names another. Then `--version` against `python -c "import typer"` (and REV's `--version`).

Ratios are paired: each round's doctor time over the same round's other command, the median
of those (the machine's noise falls on both). Each command runs under a small wrapper that
adopts its orphans (a subreaper) and waits for them: the wall time is from its start to its
own exit, the CPU time (user + system) is its own and that of every process it started,
the reader and the split helper included, which stays meaningful on a loaded machine. Every
run's output is checked: doctor, fuser and lsof must name exactly the holders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (
    REPO,
    BenchError,
    Cmd,
    Population,
    become_subreaper,
    check_doctor,
    check_doctor_stale,
    check_floor,
    check_fuser,
    check_lsof,
    entry,
    preflight,
    pt,
    say,
    shielded,
)

HERE = Path(__file__).resolve().parent

#: Runs argv, adopting and waiting for whatever it leaves (PR_SET_CHILD_SUBREAPER); prints
#: its output, then [wall to its own exit, CPU of it and its descendants, exit status] on
#: stderr.
WRAP = r"""
import ctypes, json, os, resource, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdin=subprocess.DEVNULL, capture_output=True)
wall = time.perf_counter() - t
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
sys.stdout.buffer.write(r.stdout)
sys.stderr.write(json.dumps([wall, ru.ru_utime + ru.ru_stime, r.returncode]) + "\n")
"""


def timed(cmd: Cmd) -> tuple[float, float]:
    """(wall, CPU) of one checked run of `cmd`."""
    if cmd.before:
        cmd.before()
    try:
        r = subprocess.run([sys.executable, "-c", WRAP, *cmd.argv], env=cmd.env,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    finally:
        if cmd.after:
            cmd.after()
    wall, cpu, code = json.loads(r.stderr.decode().splitlines()[-1])
    if code not in cmd.ok:
        raise BenchError(f"{cmd.label} exited {code}")
    done = subprocess.CompletedProcess(cmd.argv, code, r.stdout, b"")
    problem = cmd.check(done) if cmd.check is not None else None
    if problem:
        raise BenchError(f"{cmd.label}: {problem}")
    return wall, cpu


def interleave(cmds: list[Cmd], rounds: int) -> tuple[dict[str, list[float]],
                                                      dict[str, list[float]]]:
    """A warm-up round, then `rounds` rounds, round i starting at command i mod len: the
    wall and CPU samples of each command."""
    wall: dict[str, list[float]] = {c.key: [] for c in cmds}
    cpu: dict[str, list[float]] = {c.key: [] for c in cmds}
    for c in cmds:
        timed(c)
    for i in range(rounds):
        k = i % len(cmds)
        for c in cmds[k:] + cmds[:k]:
            w, u = timed(c)
            wall[c.key].append(w)
            cpu[c.key].append(u)
    return wall, cpu


def build(rev: str | None, where: str) -> str:
    """An xpuctl installed in a venv of its own at `where` (pip byte-compiles what it
    installs): REV's, from a git worktree of it, or (None) this checkout's, as it is on
    disk. Its path.

    Both sides are installed the same way. An editable install (the README's test command)
    has no bytecode of its own where PYTHONDONTWRITEBYTECODE is set (this machine sets it)
    until the test suite compiles it (tests/conftest.py): every run then compiles each
    module it imports, 0.09 s of doctor here (0.33 s against 0.24 s at N=1000)."""
    say(f"installing {rev or 'this checkout'} in {where}")
    source = Path(where) / "src"
    if rev is not None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(source), rev],
                       check=True, capture_output=True)
    else:  # a copy: pip builds in the source tree, and a build/ left there could hold old modules
        shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "venv", f"{where}/.venv"], check=True)
    subprocess.run([f"{where}/.venv/bin/pip", "install", "-q", str(source)], check=True,
                   capture_output=True)
    return f"{where}/.venv/bin/xpuctl"


def unbuild(where: str) -> None:
    """Remove what `build` made under `where` (a worktree, venvs)."""
    if os.path.isdir(f"{where}/rev/src"):
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", f"{where}/rev/src"],
                       capture_output=True)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)


def doctor_cmds(tag: str, xpuctl: str, env: dict[str, str], root: str, holders: list[int],
                stale: list[str]) -> list[Cmd]:
    def make() -> None:
        for path in stale:
            with open(root + path, "wb") as f:
                f.write(b"\0" * 4096)

    def remove() -> None:
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root + path)

    cmds = [Cmd(f"doctor{tag}", f"xpuctl{tag} --root R doctor --json",
                [xpuctl, "--root", root, "doctor", "--json"], env, (0, 1), check_doctor(holders)),
            Cmd(f"real{tag}", f"xpuctl{tag} doctor --json (the real root)",
                [xpuctl, "doctor", "--json"], env, (0, 1))]
    if stale:
        cmds.append(Cmd(f"stale{tag}", f"xpuctl{tag} --root R doctor --json, {len(stale)} stale",
                        [xpuctl, "--root", root, "doctor", "--json"], env, (0, 1),
                        _all_stale(holders, stale), make, remove))
    return cmds


def _all_stale(holders: list[int], stale: list[str]):  # type: ignore[no-untyped-def]
    checks = [check_doctor_stale(holders, p) for p in stale]
    return lambda r: next((p for p in (c(r) for c in checks) if p), None)


def paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s [{min(xs):.3f}-{max(xs):.3f}]"


def scenario(a: argparse.Namespace, n: int, builds: dict[str, str], env: dict[str, str]) -> None:
    root = pt.StandInRoot(n_devices=2)
    shared = tempfile.mkdtemp(prefix="xpuctl-bench-shared-")
    pop = None
    try:
        node = root.node(0)
        pop = Population(sys.executable, n, 35, node, max(1, n // 10), shared=shared)
        pop.verify()
        holders = sorted(pop.holders)
        stale = [f"/dev/shm/psm_b3nch{i:02d}" for i in range(a.stale)]
        cmds: list[Cmd] = []
        for tag, xpuctl in builds.items():
            cmds += doctor_cmds(tag, xpuctl, env, root.root, holders, stale)
        cmds += [Cmd("fuser", "fuser R/dev/dri/renderD128", ["fuser", node], env, (0,),
                     check_fuser(holders)),
                 Cmd("lsof", "lsof -w R/dev/dri/renderD128", ["lsof", "-w", node], env, (0,),
                     check_lsof(holders)),
                 Cmd("loop", "loop: python bench/floor.py", [sys.executable, str(HERE / "floor.py")],
                     env, (0,), check_floor(n * 35))]
        say(f"N={n}: {len(holders)} holders; {a.rounds} rounds of {len(cmds)} commands")
        s, cpu = interleave(cmds, a.rounds)
        print(f"\nN={n} x 35 fds, {len(holders)} holding the node; wall medians [min-max] of "
              f"{a.rounds}, CPU medians")
        for c in cmds:
            print(f"  {c.label:48s} {spread(s[c.key])}  cpu {statistics.median(cpu[c.key]):.3f} s")
        print("  ratios (paired medians):")
        for tag in builds:
            for what in ("doctor", "real", "stale"):
                if f"{what}{tag}" not in s:
                    continue
                line = f"    {what}{tag:10s}"
                for other in (["fuser", "lsof", "loop"] if what == "doctor" else []) + [
                        f"{what}{t}" for t in builds if t != tag]:
                    line += f"  /{other} {paired(s[what + tag], s[other]):.2f}"
                print(line + f"   (CPU /loop {paired(cpu[what + tag], cpu['loop']):.2f})")
    finally:
        with shielded():
            if pop is not None:
                pop.close()
            root.close()
            shutil.rmtree(shared, ignore_errors=True)


def start(a: argparse.Namespace, builds: dict[str, str], env: dict[str, str]) -> None:
    cmds = [Cmd(f"version{tag}", f"xpuctl{tag} --version", [x, "--version"], env)
            for tag, x in builds.items()]
    cmds.append(Cmd("typer", 'python -c "import typer"', [sys.executable, "-c", "import typer"],
                    env))
    s, _ = interleave(cmds, 3 * a.rounds)
    print(f"\nstart-up, wall medians [min-max] of {3 * a.rounds}")
    for c in cmds:
        print(f"  {c.label:48s} {spread(s[c.key])}")
    for tag in builds:
        print(f"    version{tag:10s}  /import typer {paired(s['version' + tag], s['typer']):.2f}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", metavar="REV", help="also run doctor from REV, built in a temporary venv")
    p.add_argument("--sizes", default="1000,4000")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--stale", type=int, default=15, help="stale files for the judged run (0: none)")
    p.add_argument("--xpuctl", help="the xpuctl to measure (default: this checkout, installed in a "
                                    "temporary venv as REV is)")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    for tool in ("fuser", "lsof"):
        if not shutil.which(tool):
            raise BenchError(f"{tool} not found (apt-get install psmisc lsof)")
    preflight(max(sizes), 35, 0.5)
    become_subreaper()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUCTL_", "_XPUCTL_"))}
    where = tempfile.mkdtemp(prefix="xpuctl-against-")
    try:
        builds = {"": a.xpuctl or build(None, f"{where}/this")}
        if a.against:
            builds["@" + a.against[:10]] = build(a.against, f"{where}/rev")
        for n in sizes:
            scenario(a, n, builds, env)
        start(a, builds, env)
    finally:
        with shielded():
            unbuild(where)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (2 cores)")
    return 0


if __name__ == "__main__":
    entry(main)
