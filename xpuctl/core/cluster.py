"""A Ray cluster's answers to `doctor|ps|devices --ray`, typed: one `NodeResult` per node, in a
`ClusterResult`.

Each node returns its document (`xpuctl.doctor/1`, `xpuctl.ps/1` or `xpuctl.devices/1`, as the
command writes it on one host) and, for doctor, its metric families. `node_result` reads that
answer once, at the boundary: the findings, the metrics and (ps, devices) the processes and
devices become the model's records, so that output/ renders a node with the same tables and
Prometheus code as one host. The document itself is kept as the node wrote it: it goes into
the `xpuctl.cluster/1` document unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from xpuctl.core import raynode
from xpuctl.core.model import Device, DrmClient, Finding, Launcher, Process, RayActor, Scan
from xpuctl.core.raynode import RayNodeFacts

_RANK = {"clean": 0, "ok": 0, "busy": 1, "dirty": 2, "error": 3}


class Sample(NamedTuple):
    labels: dict[str, str]
    value: float


class Family(NamedTuple):
    """One Prometheus gauge family: its name, help text and samples."""

    name: str
    help: str
    samples: tuple[Sample, ...]


class NodeResult(NamedTuple):
    node_id: str
    ip: str | None
    hostname: str | None
    status: str  # the doctor's (clean, busy, dirty, unknown), ok (ps, devices), error
    exit_code: int
    seconds: float | None  # the node's own command, from its scan to its document
    error: str | None  # why the node gave no answer
    document: dict[str, Any] | None  # the node's own document, as it wrote it
    findings: tuple[Finding, ...] = ()
    metrics: tuple[Family, ...] = ()
    scan: Scan | None = None  # ps and devices: the processes and devices the node listed
    ray: RayNodeFacts | None = None  # doctor: whether Ray can give vLLM the node's Intel GPUs

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

    @property
    def failing(self) -> tuple[NodeResult, ...]:
        return tuple(n for n in self.nodes if n.exit_code != 0)


def node_result(command: str, raw: dict[str, Any]) -> NodeResult:
    """One node's entry of the child's answer ({node_id, ip, hostname, result | error})."""
    result = raw.get("result") or {}
    error = raw.get("error")
    doc = result.get("document") if not error else None
    node_id, ip = str(raw["node_id"]), raw.get("ip")
    if error or not isinstance(doc, dict):
        return NodeResult(node_id, ip, raw.get("hostname"), "error", 1, None,
                          str(error or "no document"), None)
    status = str(doc.get("status") or "ok") if command == "doctor" else "ok"
    code = int(result.get("exit_code") or 0)
    facts = raynode.facts_of(raw.get("resources"), result.get("ray"), doc) \
        if command == "doctor" else None
    said = raynode.findings(facts)  # warnings and an info: the node's code stays its own
    return NodeResult(
        node_id, ip, result.get("hostname") or raw.get("hostname"), status, code,
        result.get("seconds"), None, doc,
        findings=(*(finding_of(f) for f in doc.get("findings", [])), *said),
        metrics=tuple(family_of(m) for m in result.get("metrics") or []),
        scan=scan_of(doc) if command != "doctor" else None, ray=facts,
    )


def finding_of(d: dict[str, Any]) -> Finding:
    return Finding(str(d["check"]), str(d["severity"]), str(d["message"]), d.get("remedy"),
                   d.get("device"), tuple(d.get("pids") or ()), tuple(d.get("paths") or ()))


def family_to_data(f: Family) -> list[Any]:
    """A family as a node sends it: [name, help, [[labels, value], ...]]."""
    return [f.name, f.help, [[s.labels, s.value] for s in f.samples]]


def family_of(data: list[Any]) -> Family:
    name, help_, samples = data
    return Family(str(name), str(help_), tuple(
        Sample({str(k): str(v) for k, v in labels.items()}, float(value))
        for labels, value in samples))


def _ray(d: dict[str, Any] | None) -> RayActor | None:
    if not d:
        return None
    return RayActor(d["actor_id"], d.get("name"), d.get("class_name"), d.get("job_id"),
                    d.get("node_id"), None, d.get("driver_pid"), bool(d.get("driver_gone")))


def process_of(d: dict[str, Any]) -> Process:
    """A process of a node's document (what the document does not carry is zero)."""
    return Process(
        pid=int(d["pid"]), ppid=int(d.get("ppid") or 0), state=str(d.get("state") or "?"),
        comm=str(d.get("comm") or ""), cmdline=tuple(d.get("argv") or ()),
        start_time=d.get("start_time"), start_ticks=0, session=int(d.get("session") or 0),
        pgrp=0, threads=int(d.get("threads") or 0), uid=d.get("uid"), role=d.get("role"),
        rank=d.get("rank"), orphan=bool(d.get("orphan")), top=d.get("top"),
        run_id=d.get("run_id"), devices=tuple(d.get("devices") or ()),
        memory_bytes=d.get("memory_bytes"), wchan=d.get("wchan"), ray=_ray(d.get("ray")),
        blocked=d.get("blocked"),
        cmdline_bytes=_argv_bytes(d), embedded_in=_launcher(d.get("embedded_in")),
        run_proven=bool(d.get("run_proven")),
    )


def _argv_bytes(d: dict[str, Any]) -> int:
    """The whole command line's length: what the node showed and what it cut."""
    from xpuctl.parse.procfs import argv_bytes

    cut = d.get("argv_truncated")
    return argv_bytes(tuple(d.get("argv") or ())) + (cut if isinstance(cut, int) else 0)


def _launcher(d: dict[str, Any] | None) -> Launcher | None:
    if not isinstance(d, dict) or not isinstance(d.get("pid"), int):
        return None
    return Launcher(d["pid"], str(d.get("command") or "?"), bool(d.get("blocked")))


def device_of(d: dict[str, Any]) -> Device:
    return Device(str(d["bdf"]), d.get("vendor_id"), d.get("device_id"), d.get("driver"),
                  d.get("render_node"), d.get("card_node"), (), d.get("memory_total_bytes"),
                  d.get("index"), d.get("survivability"),
                  d.get("health") if isinstance(d.get("health"), str) else None)


def scan_of(doc: dict[str, Any]) -> Scan:
    """The devices and processes of a node's ps or devices document, as a Scan for the
    tables; each device's memory in use is the node's own de-duplicated figure (one client
    per device carries it)."""
    devices = tuple(device_of(d) for d in doc.get("devices", []))
    clients = tuple(DrmClient(d["bdf"], None, d.get("driver"), d["memory_used_bytes"], (), "")
                    for d in doc.get("devices", []) if d.get("memory_used_bytes") is not None)
    return Scan(root=str(doc.get("root") or ""), taken_at=float(doc.get("taken_at") or 0.0),
                devices=devices, processes=tuple(process_of(p) for p in doc.get("processes", [])),
                clients=clients, dmabufs=(), artifacts=(), ports=(), issues=(), unreadable=0)
