#!/usr/bin/env python3
"""What `xpuctl snapshot` costs next to `xpuctl doctor`, on one population, in one run.

    python bench/snapshot.py [--n 1000] [--fds 35] [--rounds 5] [--holder-mode exec|fork]
                             [--xpuctl PATH]

Builds N idle processes with K fds each (bench/holders.py, 10 of them holding a stand-in
node under a StandInRoot whose `proc` links to /proc), then times, as separate processes,
interleaved (round i starts at command i mod 4), after one untimed warm-up each:

  doctor           xpuctl --root R doctor --json
  snapshot         xpuctl --root R snapshot -o FILE
  doctor, stale    the same two with one stale psm_* file in R/dev/shm, which makes doctor
  snapshot, stale  read every process's maps (and the snapshot keep their /dev/shm lines)

and checks each output outside the timed span: doctor names exactly the 10 holders, and
the archive read back with `doctor --from` names them too. Targets (issue 11): at N=1000
x 35 a snapshot takes at most 3 x doctor's time (medians) and the archive is at most 5 MiB.
Every process started here is killed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as bench  # Population, interleave, Cmd, StandInRoot via proctools

TIME_RATIO_MAX = 3.0
SIZE_MAX = 5 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--fds", type=int, default=35)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--holder-mode", choices=("exec", "fork"), default="exec")
    ap.add_argument("--xpuctl", default=shutil.which("xpuctl", path=os.path.dirname(sys.executable)))
    a = ap.parse_args()
    if not a.xpuctl:
        raise SystemExit("xpuctl not found next to this interpreter; pass --xpuctl PATH")
    root = bench.pt.StandInRoot(n_devices=1)
    out_dir = tempfile.mkdtemp(prefix="xpuctl-bench-snap-")
    pop = None
    try:
        pop = bench.Population(sys.executable, a.n, a.fds, root.node(0), min(10, a.n),
                               a.holder_mode)
        pop.verify()
        held = sorted(pop.pids[:10])
        stale = os.path.join(root.root, "dev/shm/psm_benchstale")
        env = dict(os.environ, XPUCTL_STATE_DIR=os.path.join(out_dir, "state"))
        archive = os.path.join(out_dir, "snap.tar.gz")
        sizes: dict[str, list[int]] = {"snapshot": [], "snapshot-stale": []}

        def doctor_check(r: subprocess.CompletedProcess) -> str | None:
            data = json.loads(r.stdout)
            got = sorted(next((d["holders"] for d in data["devices"]), []))
            return None if got == held else f"holders {got}, expected {held}"

        def snap_check(key: str):
            def check(r: subprocess.CompletedProcess) -> str | None:
                sizes[key].append(os.path.getsize(archive))
                back = subprocess.run([a.xpuctl, "doctor", "--json", "--from", archive],
                                      capture_output=True)
                if back.returncode not in (0, 1):
                    return f"doctor --from exited {back.returncode}: {back.stderr[-300:]!r}"
                return doctor_check(back)
            return check

        def add_stale() -> None:
            with open(stale, "wb") as f:
                f.write(b"x" * 4096)

        def rm_stale() -> None:
            os.unlink(stale)

        R = ["--root", root.root]
        cmds = [
            bench.Cmd("doctor", "doctor", [a.xpuctl, *R, "doctor", "--json"], env, (0, 1),
                      doctor_check),
            bench.Cmd("snapshot", "snapshot", [a.xpuctl, *R, "snapshot", "-o", archive], env,
                      (0,), snap_check("snapshot")),
            bench.Cmd("doctor-stale", "doctor, stale file", [a.xpuctl, *R, "doctor", "--json"],
                      env, (0, 1), doctor_check, add_stale, rm_stale),
            bench.Cmd("snapshot-stale", "snapshot, stale file",
                      [a.xpuctl, *R, "snapshot", "-o", archive], env, (0,),
                      snap_check("snapshot-stale"), add_stale, rm_stale),
        ]
        bench.wait_quiet(30, "snapshot")
        t = bench.interleave(cmds, a.rounds, "snapshot")
        procs = bench.count_procs()
        busy = bench.CONTENTION.get("snapshot", [])
        print(f"xpuctl snapshot vs doctor: {procs} processes on the host ({a.n} with {a.fds} fds, "
              f"10 hold the node, holders {a.holder_mode}), {a.rounds} rounds, {os.cpu_count()} CPUs, "
              f"load {bench.loadavg()}, other runnable tasks median "
              f"{statistics.median(busy) if busy else 0}")
        print(f"{'command':28s} {'median':>8s} {'min':>8s} {'max':>8s}")
        for c in cmds:
            xs = t[c.key]
            print(f"{c.label:28s} {statistics.median(xs):7.3f}s {min(xs):7.3f}s {max(xs):7.3f}s")
        ok = True
        for snap, doc in (("snapshot", "doctor"), ("snapshot-stale", "doctor-stale")):
            ratio = statistics.median(t[snap]) / statistics.median(t[doc])
            size = max(sizes[snap])
            met_t = ratio <= TIME_RATIO_MAX
            met_s = size <= SIZE_MAX
            ok &= met_t and met_s
            print(f"{snap:16s} time {ratio:4.2f} x {doc} (limit {TIME_RATIO_MAX:g}) "
                  f"{'MET' if met_t else 'MISSED'};  archive {size / 1024:.0f} KiB "
                  f"(limit {SIZE_MAX >> 20} MiB) {'MET' if met_s else 'MISSED'}")
        return 0 if ok else 1
    finally:
        if pop is not None:
            pop.close()
        root.close()
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
