"""`doctor --ray` over N nodes against the slowest node's own doctor (issue 16).

Target: the whole `xpuctl doctor --ray ADDRESS --json` (wall clock, a separate process, CLI
start-up included) takes no longer than the slowest node's doctor + 1.5 s, for N = 1 and 3
(6 with --sizes 1,3,6 when the machine holds it).

For each N the script starts a real cluster on this machine (ray.cluster_utils.Cluster through
tests/support/ray_cluster_host.py, one raylet per node, each node's XPUCTL_ROOT a stand-in root of its
own), runs one untimed warm-up, then R timed rounds. "slowest node" is the largest of the
nodes' own doctor times as they report them (`seconds` in each node's entry: the task's
doctor, from scan to document). The overhead is wall - slowest. The cluster is stopped through
its own process group and the reaper token (tests/support/raytools.py), never by name.

    python bench/ray.py                    # N = 1, 3; 5 rounds
    python bench/ray.py --sizes 1,3,6 --rounds 7 --json
    python bench/ray.py --compare /tmp/old   # also an older xpuctl (its parent dir), interleaved
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from proctools import StandInRoot, new_token, reap_token
from raytools import RayCluster, ray_env

TARGET_MARGIN = 1.5


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[3]
    except OSError:
        return "?"


def one_round(address: str, env: dict[str, str]) -> tuple[float, float, list[float]]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "xpuctl", "doctor", "--ray", address, "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    wall = time.perf_counter() - t0
    doc = json.loads(out.stdout)
    nodes = [n.get("seconds") or 0.0 for n in doc["nodes"]]
    if any("error" in n for n in doc["nodes"]):
        raise SystemExit(f"a node did not answer: {doc['nodes']}")
    return wall, max(nodes), nodes


def breakdown(address: str, env: dict[str, str]) -> dict:
    """Where one `doctor --ray` call's time goes, as the Ray child and the nodes report it:
    the child's `import ray`, zipping xpuctl's sources, `ray.init`, the tasks (scheduling,
    the object's transfer, the nodes' imports of xpuctl and their doctor), and per node its
    import of xpuctl and its doctor."""
    from xpuctl.ray import bridge
    from xpuctl.ray.cluster import DEADLINE, NODE_TIMEOUT

    t0 = time.perf_counter()
    answer = bridge.call("cluster", {"command": "doctor", "options": {}, "runner": "xpuctl.node",
                                     "node_timeout": NODE_TIMEOUT}, address,
                         bridge.ray_python(env), timeout=DEADLINE, environ=env)
    results = [n.get("result") or {} for n in answer["nodes"]]
    return {"call_s": round(time.perf_counter() - t0, 3),
            "child_s": answer.get("child_seconds"), "import_ray_s": answer.get("import_seconds"),
            **{f"{k}_s": v for k, v in answer.get("timing", {}).items()},
            "node_import_max_s": max((r.get("import_seconds") or 0.0 for r in results), default=0.0),
            "node_doctor_max_s": max((r.get("seconds") or 0.0 for r in results), default=0.0)}


def measure(n: int, rounds: int, compare: str | None = None) -> dict:
    token = new_token()
    roots = [StandInRoot(n_devices=2) for _ in range(n)]
    auth = Path(tempfile.mkdtemp(prefix="xpuctl-ray-bench-"))
    env = ray_env(token, auth, RAY_AUTH_MODE="token")
    client = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    client["PYTHONPATH"] = str(REPO)
    t0 = time.perf_counter()
    cluster = RayCluster(token, env, [{"env": {"XPUCTL_ROOT": r.root}} for r in roots])
    started = time.perf_counter() - t0
    try:
        one_round(cluster.address, client)  # warm-up: the package upload, the first workers
        walls, slowest, overheads, runnable, parts, old = [], [], [], [], [], []
        if compare:
            one_round(cluster.address, {**client, "PYTHONPATH": compare})  # its warm-up
        for _ in range(rounds):  # interleaved: a CLI round, then a broken-down call
            runnable.append(loadavg())
            wall, slow, _ = one_round(cluster.address, client)
            walls.append(wall)
            slowest.append(slow)
            overheads.append(wall - slow)
            parts.append(breakdown(cluster.address, client))
            if compare:
                wall, slow, _ = one_round(cluster.address, {**client, "PYTHONPATH": compare})
                old.append(wall - slow)
    finally:
        cluster.stop()
        reap_token(token)
        for r in roots:
            r.close()
    return {"nodes": n, "cluster_start_s": round(started, 2),
            "wall_median_s": round(statistics.median(walls), 3), "wall_min_s": round(min(walls), 3),
            "wall_max_s": round(max(walls), 3),
            "slowest_node_median_s": round(statistics.median(slowest), 3),
            "overhead_median_s": round(statistics.median(overheads), 3),
            "overhead_min_s": round(min(overheads), 3), "overhead_max_s": round(max(overheads), 3),
            "target_met": statistics.median(overheads) <= TARGET_MARGIN,
            "compared_overhead_median_s": round(statistics.median(old), 3) if old else None,
            "breakdown_median": {k: round(statistics.median(p[k] or 0.0 for p in parts), 3)
                                 for k in parts[0]},
            "contention": runnable}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", metavar="DIR", help="the parent directory of another xpuctl")
    args = ap.parse_args()
    results = [measure(int(n), args.rounds, args.compare) for n in args.sizes.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
    for r in results:
        print(f"N={r['nodes']}: doctor --ray {r['wall_median_s']:.2f}s median "
              f"[{r['wall_min_s']:.2f}-{r['wall_max_s']:.2f}], slowest node {r['slowest_node_median_s']:.2f}s, "
              f"overhead {r['overhead_median_s']:.2f}s [{r['overhead_min_s']:.2f}-{r['overhead_max_s']:.2f}] "
              f"(target <= {TARGET_MARGIN}s: {'met' if r['target_met'] else 'MISSED'}); "
              f"cluster start {r['cluster_start_s']:.1f}s; runnable {','.join(r['contention'])}",
              file=sys.stderr)
        if r["compared_overhead_median_s"] is not None:
            print(f"    compared xpuctl: overhead {r['compared_overhead_median_s']:.2f}s median", file=sys.stderr)
        print("    breakdown (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_median"].items()),
              file=sys.stderr)
    return 0 if all(r["target_met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
