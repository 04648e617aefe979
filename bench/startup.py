#!/usr/bin/env python3
"""Start-up of xpuctl against `python -c "import typer"` (issue 18's targets).

Each round runs every command once, in a shuffled order, so the machine's noise falls on all
of them alike; the figure for a command is the median over rounds of its time divided by
`import typer`'s time in the same round (paired ratios). Run by hand:

    .venv/bin/python bench/startup.py --rounds 40

Targets: `xpuctl --version` <= 1.15x, `xpuctl doctor --help` <= 2.6x, `xpuctl ps` on an empty
fake host no more than its own work (compare with `ps --help` and the in-process scan time).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    py = sys.executable
    xpuctl = os.path.join(os.path.dirname(py), "xpuctl")
    empty = tempfile.mkdtemp(prefix="xpuctl-empty-host-")
    for d in ("proc", "sys/class/drm", "dev/dri", "dev/shm", "tmp"):
        os.makedirs(os.path.join(empty, d))
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
    env["XPUCTL_STATE_DIR"] = os.path.join(empty, "state")
    cmds = {
        "import typer": [py, "-c", "import typer"],
        "python -c pass": [py, "-c", "pass"],
        "xpuctl --version": [xpuctl, "--version"],
        "xpuctl --help": [xpuctl, "--help"],
        "xpuctl doctor --help": [xpuctl, "doctor", "--help"],
        "xpuctl ps (empty host)": [xpuctl, "--root", empty, "ps"],
        "xpuctl ps --json (empty host)": [xpuctl, "--root", empty, "ps", "--json"],
        "completion request": [xpuctl, "doctor", "--dev"],
    }
    comp_env = dict(env, _XPUCTL_COMPLETE="complete_bash", COMP_WORDS="xpuctl doctor --dev", COMP_CWORD="2")
    for cmd in cmds.values():  # warm the page cache and .pyc files
        timed(cmd, env)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(args.rounds):
        order = list(cmds)
        random.shuffle(order)
        for k in order:
            times[k].append(timed(cmds[k], comp_env if k == "completion request" else env))
    base = times["import typer"]
    print(f"{args.rounds} rounds; python {sys.version.split()[0]}; median ms and median paired ratio to import typer")
    for k, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        print(f"  {k:32s} {statistics.median(ts) * 1000:7.1f} ms   {statistics.median(ratios):5.2f}x")


if __name__ == "__main__":
    main()
