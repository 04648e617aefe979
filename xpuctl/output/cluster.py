"""Render a cluster's answers (`doctor|ps|devices --ray`) from the typed records of
`core.cluster`: the `xpuctl.cluster/1` document, one section per node for people (the same
tables as on one host), and the nodes' Prometheus families with a `node` label.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from xpuctl.core.cluster import ClusterResult, Family, NodeResult, Sample
from xpuctl.output.safetext import safe

if TYPE_CHECKING:
    from rich.console import Console

    from xpuctl.output.documents import Document


def cluster_dict(result: ClusterResult) -> Document:
    """Each node's own document under the command's name, or its error."""
    nodes = []
    for n in result.nodes:
        item: Document = {"node_id": n.node_id, "ip": n.ip, "hostname": n.hostname,
                                "status": n.status, "exit_code": n.exit_code,
                                "seconds": n.seconds}
        if n.error is not None:
            item["error"] = n.error
        else:
            item[result.command] = n.document
        if n.ray is not None:  # doctor: Ray's "GPU" resource and the node's Intel GPUs
            item["ray"] = {**n.ray._asdict(), "gpu_is_intel": n.ray.gpu_is_intel,
                           "findings": [f._asdict() for f in n.findings if f.check == "ray-gpus"]}
        nodes.append(item)
    return {"schema": "xpuctl.cluster/1", "command": result.command, "address": result.address,
            "status": result.status, "exit_code": result.exit_code, "nodes": nodes}


def node_heading(n: NodeResult) -> str:
    return f"node {n.short_id}  {n.ip or '?'}  {n.hostname or '?'}  {n.status}"


def verdict(result: ClusterResult) -> str:
    where = ", ".join(f"{n.short_id} ({n.ip or '?'})" for n in result.failing)
    head = f"cluster {result.address}: {len(result.nodes)} node(s), {result.status}"
    return head + (f"; problems on {where}" if where else "")


def _print_node(console: Console, n: NodeResult, command: str) -> None:
    from rich.text import Text

    from xpuctl.output.tables import findings_table, print_devices, processes_table

    if n.error is not None:
        console.print(Text("  " + safe(f"no answer: {n.error}"), style="red"))
    elif command == "doctor" and n.findings:
        console.print(findings_table(n.findings))
    elif command == "ps" and n.scan is not None and n.scan.processes:
        console.print(processes_table(n.scan, "vLLM processes", console.width), no_wrap=True,
                      crop=True)
    elif command == "devices" and n.scan is not None:
        print_devices(console, n.scan)
    else:
        console.print("  nothing to report", highlight=False)


def print_cluster(console: Console, result: ClusterResult) -> None:
    from rich.text import Text

    for n in result.nodes:
        style = "green" if n.exit_code == 0 else "red"
        console.print(Text(safe(node_heading(n)), style=f"bold {style}"))
        _print_node(console, n, result.command)
    console.print(Text(safe(verdict(result)), style="bold"))


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _remote(f: Family) -> Family | None:
    """A node's family as this host prints it: the text came from another machine. Its help
    is escaped (`safe`: a newline as \\n and a backslash doubled, as the exposition format
    wants, any other control character visibly); a family or a label whose name is not a
    Prometheus name is dropped (xpuctl never makes one; label values are escaped by the
    exposition itself)."""
    if not _METRIC_NAME.fullmatch(f.name):
        return None
    samples = tuple(s._replace(labels={k: v for k, v in s.labels.items()
                                       if _LABEL_NAME.fullmatch(k) and k != "node"})
                    for s in f.samples)
    return f._replace(help=safe(f.help, 512), samples=samples)


def cluster_families(result: ClusterResult) -> list[Family]:
    """One line per node saying whether it answered, then every node's doctor families,
    merged by name (the first node's help text), each sample with its node's `node` label
    (the short id) first."""
    up = Family("xpuctl_cluster_node_up", "1 when the node answered the check (doctor --ray).",
                tuple(Sample({"node": n.short_id, "node_id": n.node_id, "ip": n.ip or ""},
                             0.0 if n.error else 1.0) for n in result.nodes))
    merged: dict[str, Family] = {}
    for n in result.nodes:
        for f in filter(None, map(_remote, n.metrics)):
            samples = tuple(Sample({"node": n.short_id, **s.labels}, s.value) for s in f.samples)
            have = merged.get(f.name)
            merged[f.name] = f._replace(samples=samples) if have is None else \
                have._replace(samples=have.samples + samples)
    return [up, *merged.values()]


def prometheus(result: ClusterResult) -> str:
    from xpuctl.output.prometheus import exposition

    return exposition(cluster_families(result))
