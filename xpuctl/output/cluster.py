"""Render a cluster's answers (`doctor|ps|devices --ray`): the `xpuctl.cluster/1` document,
one section per node for people, and the nodes' Prometheus text with a `node` label.

A result is `xpuctl.ray.cluster.ClusterResult` (a higher layer: read by its fields only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xpuctl.core.model import Finding
from xpuctl.output.safetext import prom_label, safe

if TYPE_CHECKING:
    from rich.console import Console

ClusterResult = Any  # xpuctl.ray.cluster.ClusterResult
NodeResult = Any  # xpuctl.ray.cluster.NodeResult


def cluster_dict(result: ClusterResult) -> dict[str, Any]:
    """Each node's own document under the command's name, or its error."""
    nodes = []
    for n in result.nodes:
        item: dict[str, Any] = {"node_id": n.node_id, "ip": n.ip, "hostname": n.hostname,
                                "status": n.status, "exit_code": n.exit_code,
                                "seconds": n.seconds}
        if n.error is not None:
            item["error"] = n.error
        else:
            item[result.command] = n.document
        nodes.append(item)
    return {"schema": "xpuctl.cluster/1", "command": result.command, "address": result.address,
            "status": result.status, "exit_code": result.exit_code, "nodes": nodes}


def node_heading(n: NodeResult) -> str:
    return f"node {n.short_id}  {n.ip or '?'}  {n.hostname or '?'}  {n.status}"


def node_findings(n: NodeResult) -> list[Finding]:
    doc = n.document or {}
    keys = Finding._fields
    out = []
    for f in doc.get("findings", []):
        fields: dict[str, Any] = {k: (tuple(f[k]) if k in ("pids", "paths") else f[k])
                                  for k in keys if k in f}
        out.append(Finding(**fields))
    return out


def verdict(result: ClusterResult) -> str:
    bad = [n for n in result.nodes if n.exit_code != 0]
    where = ", ".join(f"{n.short_id} ({n.ip or '?'})" for n in bad)
    head = f"cluster {result.address}: {len(result.nodes)} node(s), {result.status}"
    return head + (f"; problems on {where}" if bad else "")


def _rows(n: NodeResult, command: str) -> list[str]:
    """ps and devices on a node: one line per process or device."""
    doc = n.document or {}
    if command == "devices":
        return [f"  {d['bdf']}  {d.get('render_node') or '-'}  holders "
                f"{' '.join(map(str, d.get('holders') or [])) or '-'}" for d in doc.get("devices", [])]
    return [f"  {p['pid']:>7}  {p.get('role') or '-':<12} {p.get('run_id') or '-':<16} "
            f"{' '.join(p.get('devices') or []) or '-':<14} {p.get('cmdline', '')[:60]}"
            for p in doc.get("processes", [])]


def print_cluster(console: Console, result: ClusterResult) -> None:
    from rich.text import Text

    from xpuctl.output.tables import findings_table

    for n in result.nodes:
        style = "green" if n.exit_code == 0 else "red"
        console.print(Text(safe(node_heading(n)), style=f"bold {style}"))
        if n.error is not None:
            console.print(Text("  " + safe(f"no answer: {n.error}"), style="red"))
        elif result.command == "doctor":
            findings = node_findings(n)
            if findings:
                console.print(findings_table(findings))
            else:
                console.print("  nothing to report", highlight=False)
        else:
            for line in _rows(n, result.command) or ["  nothing to report"]:
                console.print(Text(safe(line)), no_wrap=True, crop=True)
    console.print(Text(safe(verdict(result)), style="bold"))


def _with_node(line: str, node: str) -> str:
    """`name{a="b"} 1` -> `name{node="N",a="b"} 1`; `name 1` -> `name{node="N"} 1`."""
    label = f'node="{prom_label(node)}"'
    head, brace, tail = line.partition("{")
    if brace and " " not in head:
        return f"{head}{{{label}{'' if tail.startswith('}') else ','}{tail}"
    name, _, value = line.partition(" ")
    return f"{name}{{{label}}} {value}"


def prometheus(result: ClusterResult) -> str:
    """Every node's doctor metrics with a `node` label (its short id), one HELP/TYPE per
    family, plus one line per node saying whether it answered."""
    families: dict[str, list[str]] = {}
    heads: dict[str, list[str]] = {}
    for n in result.nodes:
        for line in (n.prometheus or "").splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                if len(heads.setdefault(name, [])) < 2 and line not in heads[name]:
                    heads[name].append(line)
                continue
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                families.setdefault(name, []).append(_with_node(line, n.short_id))
    out = ["# HELP xpuctl_cluster_node_up 1 when the node answered the check (doctor --ray).",
           "# TYPE xpuctl_cluster_node_up gauge"]
    for n in result.nodes:
        out.append(f'xpuctl_cluster_node_up{{node="{prom_label(n.short_id)}",'
                   f'node_id="{prom_label(n.node_id)}",ip="{prom_label(n.ip or "")}"}} '
                   f"{0 if n.error else 1}")
    for name, lines in families.items():
        out.extend(heads.get(name, []))
        out.extend(lines)
    return "\n".join(out) + "\n"
