"""serve with `--distributed-executor-backend ray`: which cluster, preflight on every node, and
the nodes a run's actors landed on.

The cluster is RAY_ADDRESS of vLLM's environment (an existing cluster), else "local": vLLM
starts a Ray of its own under its EngineCore (vLLM's `ray.init()` joins a cluster this host
runs when RAY_ADDRESS is unset; set it so that xpuctl knows). A launch onto an existing
cluster first runs doctor on every alive node; a node that fails blocks the launch.
"""

from __future__ import annotations

import socket
from typing import Any

from xpuctl.core.cluster import ClusterResult
from xpuctl.errors import XpuctlError
from xpuctl.output.safetext import safe
from xpuctl.ray import bridge
from xpuctl.ray.cluster import gather

LOCAL = "local"


def uses_ray(argv: list[str]) -> bool:
    """vLLM's `--distributed-executor-backend ray` (or `=ray`) among its arguments."""
    for i, arg in enumerate(argv):
        if arg == "--distributed-executor-backend" and argv[i + 1 : i + 2] == ["ray"]:
            return True
        if arg == "--distributed-executor-backend=ray":
            return True
    return False


def cluster_of(env: dict[str, str]) -> str:
    return env.get("RAY_ADDRESS", "").strip() or LOCAL


def refusal(result: ClusterResult) -> str | None:
    """The preflight's one-line refusal naming every failing node (short id, IP, findings)."""
    bad = result.failing
    if not bad:
        return None
    parts = []
    for n in bad:  # every field is the node's own text: escaped here (safe), one by one
        fails = [f for f in n.findings if f.severity == "fail"]
        what = "; ".join(f"{safe(f.check)}: {safe(f.message)}" for f in fails[:3]) \
            or safe(n.error or n.status)
        parts.append(f"node {safe(n.short_id)} ({safe(n.ip or '?')}): {what}")
    return (f"preflight failed on {len(bad)} of {len(result.nodes)} Ray node(s) of "
            f"{safe(result.address)}: " + " | ".join(parts) +
            " (check with `xpuctl doctor --ray`, clean that node with `xpuctl reset` there, or "
            "start anyway with --force)")


def preflight(address: str, env: dict[str, str], python: str | None) -> ClusterResult:
    """doctor on every alive node of the cluster; XpuctlError (exit 1) naming the failing
    nodes, RayError (exit 6) when the cluster cannot be asked."""
    result = gather("doctor", {}, address, env, python=python)
    message = refusal(result)
    if message:
        raise XpuctlError(message)
    return result


def actors_of(state: dict[str, Any], driver_pids: set[int],
              driver_ip: str | None = None) -> list[dict[str, Any]]:
    """The alive actors whose job's driver is one of `driver_pids` (a run's EngineCore), each
    with its node's IP. `driver_ip`: where those pids live (pids repeat across hosts)."""
    jobs = {j["job_id"] for j in state.get("jobs", [])
            if j.get("driver_pid") in driver_pids and (driver_ip is None or j.get("driver_ip") == driver_ip)}
    ips = {n["node_id"]: n.get("ip") for n in state.get("nodes", [])}
    return [{**a, "ip": ips.get(a.get("node_id"))} for a in state.get("actors", [])
            if a.get("job_id") in jobs]


def run_nodes(cluster: str, env: dict[str, str], python: str | None,
              driver_pids: set[int]) -> list[dict[str, Any]]:
    """The nodes a run's actors run on: [{node_id, ip, actors}] (this host, for a local Ray)."""
    if cluster == LOCAL:
        return [{"node_id": LOCAL, "ip": None, "hostname": socket.gethostname()}]
    state = bridge.call("state", {}, cluster, python or bridge.ray_python(env), timeout=15.0,
                        environ=env)
    nodes: dict[str, dict[str, Any]] = {}
    for a in actors_of(state, driver_pids):
        node = nodes.setdefault(a["node_id"], {"node_id": a["node_id"], "ip": a["ip"], "actors": []})
        node["actors"].append(a.get("name") or a["actor_id"])
    return list(nodes.values())
