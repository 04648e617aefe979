"""`doctor --ray`, `ps --ray`, `devices --ray`: one pinned task per alive node, gathered.

The exit code is the worst node's; a node whose task fails or does not answer in time is a
problem (exit 1), named with its reason. Status per node: the doctor's (clean, busy, dirty),
`ok` for ps and devices, `error` for a node that gave no answer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from xpuctl.ray import bridge

NODE_TIMEOUT = 20.0  # per node, inside the child's deadline
DEADLINE = 28.0  # the whole call: every outcome is known within 30 s
_RANK = {"clean": 0, "ok": 0, "busy": 1, "dirty": 2, "error": 3}


class NodeResult(NamedTuple):
    node_id: str
    ip: str | None
    hostname: str | None
    status: str
    exit_code: int
    document: dict[str, Any] | None
    prometheus: str | None
    error: str | None
    seconds: float | None

    @property
    def short_id(self) -> str:
        return self.node_id[:8]


class ClusterResult(NamedTuple):
    command: str
    address: str
    nodes: tuple[NodeResult, ...]
    seconds: float  # the whole call, child start to answer

    @property
    def exit_code(self) -> int:
        return max((n.exit_code for n in self.nodes), default=1)

    @property
    def status(self) -> str:
        worst = max((n.status for n in self.nodes), key=lambda s: _RANK.get(s, 3), default="error")
        return "dirty" if worst == "error" and self.command == "doctor" else worst


def _node(command: str, raw: dict[str, Any]) -> NodeResult:
    result = raw.get("result") or {}
    error = raw.get("error")
    doc = result.get("document") if not error else None
    if error or not isinstance(doc, dict):
        return NodeResult(raw["node_id"], raw.get("ip"), raw.get("hostname"), "error", 1, None,
                          None, str(error or "no document"), None)
    status = str(doc.get("status") or "ok") if command == "doctor" else "ok"
    return NodeResult(raw["node_id"], raw.get("ip"), result.get("hostname") or raw.get("hostname"),
                      status, int(result.get("exit_code") or 0), doc, result.get("prometheus"),
                      None, result.get("seconds"))


def gather(command: str, options: dict[str, Any], address: str | None,
           environ: dict[str, str], python: str | None = None,
           runner: str = "xpuctl.ray.node") -> ClusterResult:
    """Run `command` on every alive node of the cluster (`runner`'s `run(command, options)`
    as a pinned task); RayError when Ray cannot be asked."""
    where = bridge.ray_address(address, environ)
    answer = bridge.call(
        "cluster", {"command": command, "options": options, "node_timeout": NODE_TIMEOUT,
                    "runner": runner},
        where, python or bridge.ray_python(environ), timeout=DEADLINE, environ=environ,
    )
    nodes = tuple(sorted((_node(command, n) for n in answer.get("nodes", [])),
                         key=lambda n: (n.ip or "", n.node_id)))
    return ClusterResult(command, where, nodes, float(answer.get("elapsed") or 0.0))
