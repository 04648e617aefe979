"""`doctor --ray`, `ps --ray`, `devices --ray`: one pinned task per alive node, gathered.

The exit code is the worst node's; a node whose task fails or does not answer in time is a
problem (exit 1), named with its reason. Status per node: the doctor's (clean, busy, dirty),
`ok` for ps and devices, `error` for a node that gave no answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xpuctl.core.cluster import ClusterResult, node_result
from xpuctl.ray import bridge

NODE_TIMEOUT = 20.0  # per node, inside the child's deadline
DEADLINE = 28.0  # the whole call: every outcome is known within 30 s


def gather(command: str, options: dict[str, Any], address: str | None,
           environ: Mapping[str, str], python: str | None = None,
           runner: str = "xpuctl.node") -> ClusterResult:
    """Run `command` on every alive node of the cluster (`runner`'s `run(command, options)`
    as a pinned task); RayError when Ray cannot be asked."""
    env = dict(environ)
    where = bridge.ray_address(address, env)
    answer = bridge.call(
        "cluster", {"command": command, "options": options, "node_timeout": NODE_TIMEOUT,
                    "runner": runner},
        where, python or bridge.ray_python(env), timeout=DEADLINE, environ=env,
    )
    nodes = tuple(sorted((node_result(command, n) for n in answer.get("nodes", [])),
                         key=lambda n: (n.ip or "", n.node_id)))
    return ClusterResult(command, where, nodes, float(answer.get("elapsed") or 0.0))
