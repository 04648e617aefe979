#!/usr/bin/env python3
"""`doctor --collective`'s cost (issue 21): the check on two healthy devices, beyond the
ranks' own import of torch (target < 2 s), and a hung group's total time (target: the
timeout, plus the runs alone, plus 2 s at most). See bench/README.md.

In-process `xpuctl.probes.collective.run_collective` on a fake root with two xe GPUs
(tests/support/fakehost.py), rounds interleaved, wall time by `time.perf_counter`:

  standin      the collective stand-ins (tests/standins/collective: torch.xpu and a real TCP
               rendezvous), healthy
  gloo         the installed CPU torch over gloo (XPUCTL_TEST_COLLECTIVE_BACKEND, test-only)
  import       the floor of each: as many `python -c "import torch"` at once as there are
               ranks, with the same environment
  hung         the stand-ins with device 1 hanging in init, --collective-timeout T

overhead = check − import (median of the rounds). Every process started here exits by
itself or is killed with its session by the check.
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
sys.path.insert(0, str(REPO))

import fakehost as fh

from xpuctl.host.seam import Host
from xpuctl.probes.collective import run_collective
from xpuctl.probes.runner import probe_env, probe_python

STANDINS = REPO / "tests" / "standins" / "collective"


def env_for(tmp: Path, scenario: dict | None, gloo: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if scenario is not None:
        path = tmp / f"scen-{len(list(tmp.iterdir()))}.json"
        path.write_text(json.dumps({"collective": scenario}))
        env.update(PYTHONPATH=str(STANDINS), XPUCTL_STANDIN=str(path))
    if gloo:
        env["XPUCTL_TEST_COLLECTIVE_BACKEND"] = "gloo"
    return probe_env(env)


def imports(env: dict[str, str], n: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([probe_python(), "-c", "import torch, torch.distributed"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def check(host: Host, env: dict[str, str], timeout: float) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = run_collective(host, None, env, timeout)
    return time.perf_counter() - t0, r.verdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3.0, help="the hung group's bound")
    ap.add_argument("--no-gloo", action="store_true", help="skip the real-torch rounds")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fh.clean_host(tmp / "root")
        host = Host(str(tmp / "root"))
        envs = {"standin": env_for(tmp, {}), "hung": env_for(tmp, {"hang": {"1": "init"}})}
        if not a.no_gloo:
            envs["gloo"] = env_for(tmp, None, gloo=True)
        got: dict[str, list[float]] = {k: [] for k in ("standin", "standin-import", "gloo",
                                                       "gloo-import", "hung")}
        for i in range(a.rounds):
            order = ["standin", "gloo", "hung"][i % 3:] + ["standin", "gloo", "hung"][:i % 3]
            for kind in order:
                if kind not in envs:
                    continue
                if kind == "hung":
                    secs, verdict = check(host, envs[kind], a.timeout)
                    assert verdict == "hung", verdict
                    got["hung"].append(secs)
                    continue
                secs, verdict = check(host, envs[kind], 120)
                assert verdict == "ok", verdict
                got[kind].append(secs)
                got[f"{kind}-import"].append(imports(envs[kind], 2))
    med = {k: statistics.median(v) for k, v in got.items() if v}
    print(f"rounds {a.rounds}, 2 devices, python {sys.version.split()[0]}, {os.cpu_count()} cpu(s)")
    for kind in ("standin", "gloo"):
        if kind in med:
            over = med[kind] - med[f"{kind}-import"]
            print(f"{kind:8s} check {med[kind]:.3f} s, import floor {med[kind + '-import']:.3f} s, "
                  f"overhead {over:.3f} s (target < 2 s): {'ok' if over < 2 else 'MISSED'}")
    target = 2 * a.timeout + 2
    print(f"hung     total {med['hung']:.3f} s (max {max(got['hung']):.3f}), timeout {a.timeout:g} s, "
          f"target <= {target:g} s: {'ok' if max(got['hung']) <= target else 'MISSED'}")


if __name__ == "__main__":
    main()
