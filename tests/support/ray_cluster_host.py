"""Holds a real multi-node Ray cluster on this machine for a test (ray.cluster_utils.Cluster).

Started by tests/support/raytools.py in its own session; prints one JSON line (the address) when every
node is up, then waits until its stdin closes and shuts the cluster down. Each node is a
raylet of its own with its own environment (`env_vars`): a node's XPUCTL_ROOT is what every
task and actor on it sees.

argv[1]: JSON {"nodes": [{"env": {...}, "num_cpus": 1, "resources": {...}}, ...]}
"""

import json
import socket
import sys

from ray.cluster_utils import Cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    cluster = Cluster(shutdown_at_exit=True)
    for i, node in enumerate(cfg["nodes"]):
        args = {"num_cpus": node.get("num_cpus", 1), "env_vars": node.get("env") or {},
                "resources": node.get("resources") or {},
                "object_store_memory": 78 * 1024 * 1024}
        if i == 0:  # the state API needs the dashboard; 8265 may be another cluster's
            args.update(include_dashboard=True, dashboard_port=_free_port())
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    sys.stdout.write(json.dumps({"address": cluster.address}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    cluster.shutdown()


if __name__ == "__main__":
    main()
