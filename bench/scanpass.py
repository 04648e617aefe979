#!/usr/bin/env python3
"""How the pass over /proc is run, compared in one process on one population.

    python bench/scanpass.py [--n 1000] [--fds 35] [--rounds 9]

Builds N idle processes with K fds each (bench/holders.py, 10 of them holding a stand-in
node under a StandInRoot) and times `xpuctl.host.processes.scan_processes` in this
process, interleaved, in these ways:

  plain        one process, one thread
  two threads  the same work split over two threads (what xpuctl did before the split)
  split        a forked helper scans every other pid (what xpuctl does above split.SPLIT_ABOVE)

each with and without the dense fd read (fd tables read as 0..n-1 from st_size instead of
a listing, see Host.fd_links). This is the evidence for how the pass is run; the whole-CLI
figures come from bench/run.py. Every process started here is killed on exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as bench

from xpuctl.host import (
    processes,
    seam,
)
from xpuctl.host import split as Sp
from xpuctl.host.seam import Host


def plain(host: Host) -> processes.FdTable:
    saved, Sp.SPLIT_ABOVE = Sp.SPLIT_ABOVE, 1 << 30
    try:
        return processes.scan_processes(host)
    finally:
        Sp.SPLIT_ABOVE = saved


def two_threads(host: Host) -> processes.FdTable:
    pids = processes.list_pids(host)
    out, half = processes.FdTable(), processes.FdTable()
    t = threading.Thread(target=processes._scan_some, args=(host, pids[1::2], frozenset(), half))
    t.start()
    processes._scan_some(host, pids[0::2], frozenset(), out)
    t.join()
    out.merge(half)
    return out


def split(host: Host) -> processes.FdTable:
    saved, Sp.SPLIT_ABOVE = Sp.SPLIT_ABOVE, 0
    try:
        return processes.scan_processes(host)
    finally:
        Sp.SPLIT_ABOVE = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--fds", type=int, default=35)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    root = bench.pt.StandInRoot(n_devices=1)
    pop = None
    try:
        pop = bench.Population(sys.executable, a.n, a.fds, root.node(0), min(10, a.n))
        pop.verify()
        host = Host(root.root)
        dense = seam._FD_NAMES
        ways = [(f"{name}{'' if d else ', listing every fd dir'}", fn, d)
                for d in (True, False) for name, fn in
                (("plain", plain), ("two threads", two_threads), ("split", split))]
        times: dict[str, list[float]] = {w[0]: [] for w in ways}
        for r in range(a.rounds + 1):
            for i in range(len(ways)):
                label, fn, d = ways[(i + r) % len(ways)]
                seam._FD_NAMES = dense if d else ()
                t0 = time.perf_counter()
                found = fn(host)
                dt = time.perf_counter() - t0
                held = sorted(p for p, _, path in found.drm_fds if path == "/dev/dri/renderD128")
                if held != sorted(pop.pids[:10]):
                    raise SystemExit(f"{label}: found holders {held}, expected {pop.pids[:10]}")
                if r:  # round 0 is a warm-up
                    times[label].append(dt)
        seam._FD_NAMES = dense
        procs = len(processes.list_pids(host))
        print(f"scan_processes on {procs} processes ({a.n} with {a.fds} fds), "
              f"{a.rounds} rounds, {os.cpu_count()} CPUs")
        print(f"{'way':38s} {'median':>8s} {'min':>8s} {'max':>8s}")
        for label, xs in times.items():
            print(f"{label:38s} {statistics.median(xs) * 1e3:6.1f}ms {min(xs) * 1e3:6.1f}ms "
                  f"{max(xs) * 1e3:6.1f}ms")
        return 0
    finally:
        if pop is not None:
            pop.close()
        root.close()


if __name__ == "__main__":
    sys.exit(main())
