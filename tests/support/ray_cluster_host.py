"""Holds a real multi-node Ray cluster on this machine for a test (ray.cluster_utils.Cluster).

Started by tests/support/raytools.py in its own session; prints one JSON line (the address) when every
node is up, then waits until its stdin closes and shuts the cluster down. Each node is a
raylet of its own with its own environment (`env_vars`): a node's XPUCTL_ROOT is what every
task and actor on it sees.

argv[1]: JSON {"nodes": [{"env": {...}, "num_cpus": 1, "num_gpus": 0, "resources": {...}}, ...],
               "plain": false, "hold_cpus": false}

`plain`: each node as `Cluster.add_node(num_cpus=...)` makes it, with Ray's defaults (no
dashboard port of ours, no per-node environment or resources), but for a small object store
(a shared machine). `hold_cpus`: this process then joins the cluster as a driver and keeps one
actor on each node that holds all of its CPUs, as a busy node's own work does.
"""

import json
import socket
import sys

from ray.cluster_utils import Cluster

OBJECT_STORE = 78 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_args(i: int, node: dict, plain: bool) -> dict:
    args = {"num_cpus": node.get("num_cpus", 1), "object_store_memory": OBJECT_STORE}
    if plain:
        return args
    args.update(env_vars=node.get("env") or {}, resources=node.get("resources") or {})
    if "num_gpus" in node:  # Ray's "GPU" for the node, as `ray start --num-gpus` declares it
        args.update(num_gpus=node["num_gpus"])
    if i == 0:  # the state API needs the dashboard; 8265 may be another cluster's
        args.update(include_dashboard=True, dashboard_port=_free_port())
    return args


def _hold_cpus(cluster: Cluster, cpus: list[int]) -> list:
    """One actor per node holding its `cpus[i]` CPUs, alive while this process lives."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=cluster.address)

    class Busy:
        def ready(self) -> bool:
            return True

    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])
    holders = [
        ray.remote(num_cpus=n_cpus)(Busy).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n, n_cpus in zip(nodes, cpus, strict=True)
    ]
    ray.get([h.ready.remote() for h in holders], timeout=120)
    return holders


def main() -> None:
    cfg = json.loads(sys.argv[1])
    plain = bool(cfg.get("plain"))
    cluster = Cluster(shutdown_at_exit=True)
    for i, node in enumerate(cfg["nodes"]):
        cluster.add_node(**_node_args(i, node, plain))
    cluster.wait_for_nodes()
    held = _hold_cpus(cluster, [n.get("num_cpus", 1) for n in cfg["nodes"]]) \
        if cfg.get("hold_cpus") else []
    sys.stdout.write(json.dumps({"address": cluster.address, "held": len(held)}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    cluster.shutdown()


if __name__ == "__main__":
    main()
