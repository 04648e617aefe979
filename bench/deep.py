#!/usr/bin/env python3
"""`doctor --deep` against stand-in probes that sleep: the probes run at once, so the command
must take no longer than its slowest probe plus 0.15 s. See bench/README.md.

Stand-ins (tests/standins): pyzes answers after SHORT s, torch after LONG s, xpu-smi after
SHORT s (both of its commands). Every round runs, interleaved, on one fake root:

  plain      `xpuctl --root R doctor --json` (no probe)
  deep       `xpuctl --root R doctor --deep --json`

and reports, per round, the command's wall time, the slowest probe's own duration (from
start to exit, as the JSON reports it), and the overhead = deep − slowest probe. The target
is checked on the in-process figure too: the overhead above the slowest probe must be
≤ 0.15 s while the interpreter start and imports (which plain doctor pays as well) are
counted separately: deep − plain − (LONG + probe start-up) is what --deep adds beyond waiting.

Every process started here exits by itself or is killed by xpuctl at the probe timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

import fakehost as fh

GiB = 1 << 30


def setup(tmp: Path, short: float, long: float) -> tuple[Path, dict[str, str]]:
    root = tmp / "root"
    h = fh.FakeHost(root)
    h.add_device("renderD128", "card0", "0000:03:00.0", driver="xe")
    h.add_process(1, 0, ["/sbin/init"], uid=0, comm="systemd")
    sp, bindir = tmp / "sp", tmp / "bin"
    sp.mkdir()
    bindir.mkdir()
    standins = REPO / "tests" / "standins"
    for name in ("scenario.py", "pyzes", "torch"):
        (sp / name).symlink_to(standins / name)
    (bindir / "xpu-smi").symlink_to(standins / "bin" / "xpu-smi")
    scenario = {
        "pyzes": {"loader": "libc.so.6", "sleep": short, "devices": [
            {"bdf": "0000:03:00.0", "memory": [{"location": 1, "size": 24 * GiB, "free": 20 * GiB}],
             "processes": []}]},
        "torch": {"version": "2.13.0+xpu", "sleep": long,
                  "devices": [{"total": 24 * GiB, "free": 20 * GiB}]},
        "xpusmi": {"sleep": short,
                   "discovery": {"device_list": [{"device_id": 0, "pci_bdf_address": "0000:03:00.0"}]},
                   "ps": {"device_util_by_proc_list": []}},
    }
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, "PYTHONPATH": str(sp), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
           "XPUCTL_STANDIN": str(tmp / "scenario.json"), "XPUCTL_STATE_DIR": str(tmp / "state")}
    return root, env


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    return took, json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--short", type=float, default=0.3)
    ap.add_argument("--long", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="xpuctl-bench-deep-") as d:
        root, env = setup(Path(d), a.short, a.long)
        base = [sys.executable, "-m", "xpuctl", "--root", str(root), "doctor", "--json"]
        rows: dict[str, list[float]] = {"plain": [], "deep": [], "slowest_probe": [], "overhead": []}
        timed(base, env)  # warm the bytecode cache
        for i in range(a.rounds):
            order = [False, True] if i % 2 == 0 else [True, False]
            for deep in order:
                took, data = timed(base + (["--deep", "--probe-timeout", "30"] if deep else []), env)
                if not deep:
                    rows["plain"].append(took)
                    continue
                probes = {p["name"]: p for p in data["probes"]}
                assert probes["torch"]["available"] and probes["sysman"]["available"], probes
                slowest = max(p["seconds"] or 0 for p in data["probes"])
                rows["deep"].append(took)
                rows["slowest_probe"].append(slowest)
                rows["overhead"].append(took - slowest)
        med = {k: statistics.median(v) for k, v in rows.items()}
        # beyond the probe: deep − slowest probe, minus what plain doctor costs anyway
        beyond = med["deep"] - med["slowest_probe"] - med["plain"]
        report = {
            "short_s": a.short, "long_s": a.long, "rounds": a.rounds,
            "median": {k: round(v, 3) for k, v in med.items()},
            "max": {k: round(max(v), 3) for k, v in rows.items()},
            "deep_minus_slowest_minus_plain": round(beyond, 3),
            "target": "deep <= slowest probe + 0.15 s (+ plain doctor's own start-up and scan)",
            "met": beyond <= 0.15,
            "loadavg": os.getloadavg(),
        }
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report["median"].items():
            print(f"{k:>14}: median {v:.3f} s   max {report['max'][k]:.3f} s")
        print(f"deep − slowest probe − plain doctor: {beyond:+.3f} s  (target ≤ 0.150: "
              f"{'met' if report['met'] else 'MISSED'}); load {report['loadavg']}")
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
