"""doctor's Prometheus text exposition, for node_exporter's textfile collector.

Label values go through `safetext.prom_label`; sample values are exact (`sample_value`).
"""

from __future__ import annotations

import math
from typing import Any

from xpuctl import __version__
from xpuctl.core.checks import CHECKS
from xpuctl.core.model import Report
from xpuctl.output.safetext import prom_label


def sample_value(value: float) -> str:
    """A sample value, exact: whole numbers as integers, others as Python's shortest
    round-trip repr (`:g` keeps 6 digits: 8 GiB became 8.58993e+09 and a timestamp lost
    whole minutes)."""
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


def prometheus(report: Report) -> str:
    snap = report.scan
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{prom_label(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{lab}}} {sample_value(value)}" if lab else f"{name} {sample_value(value)}")

    metric("xpuctl_build_info", "gauge", "xpuctl version.", [({"version": __version__}, 1)])
    metric("xpuctl_doctor_last_run_timestamp_seconds", "gauge", "When doctor ran.", [({}, snap.taken_at)])
    metric(
        "xpuctl_doctor_status",
        "gauge",
        "1 for the current status (clean, busy, dirty, unknown).",
        [({"status": s}, 1.0 if report.status == s else 0.0)
         for s in ("clean", "busy", "dirty", "unknown")],
    )
    worst: dict[str, int] = {c: 0 for c in CHECKS}
    rank = {"info": 0, "warn": 1, "fail": 2}
    for f in report.findings:
        worst[f.check] = max(worst[f.check], rank[f.severity])
    metric(
        "xpuctl_doctor_check_ok",
        "gauge",
        "1 when the check found no warning or failure.",
        [({"check": c}, 1.0 if worst[c] == 0 else 0.0) for c in CHECKS],
    )
    metric(
        "xpuctl_doctor_findings",
        "gauge",
        "Findings by check and severity.",
        [
            ({"check": c, "severity": s}, float(sum(1 for f in report.findings if f.check == c and f.severity == s)))
            for c in CHECKS
            for s in ("warn", "fail")
        ],
    )
    devs = [d for d in snap.devices if d.is_intel]
    metric(
        "xpuctl_device_holder_processes",
        "gauge",
        "Processes holding the device open.",
        [({"device": d.bdf}, float(len(snap.holders(d.bdf)))) for d in devs],
    )
    metric(
        "xpuctl_device_orphan_processes",
        "gauge",
        "Orphaned vLLM processes holding the device.",
        [
            ({"device": d.bdf}, float(sum(1 for p in snap.processes if p.orphan and d.bdf in p.devices)))
            for d in devs
        ],
    )
    metric(
        "xpuctl_device_memory_used_bytes",
        "gauge",
        "Device memory held by clients (de-duplicated DRM fdinfo).",
        [({"device": d.bdf}, float(snap.memory_used(d.bdf) or 0)) for d in devs],
    )
    totals = [({"device": d.bdf}, float(d.memory_total_bytes)) for d in devs if d.memory_total_bytes]
    if totals:
        metric("xpuctl_device_memory_total_bytes", "gauge", "Device memory size.", totals)
    if snap.deep is not None:
        metric(
            "xpuctl_probe_available",
            "gauge",
            "1 when the deep probe answered (--deep).",
            [({"probe": r.name}, 1.0 if r.available else 0.0) for r in snap.deep.probes],
        )
        unattributed = [
            ({"device": v.bdf}, float(v.unattributed_bytes))
            for v in snap.deep.devices
            if v.unattributed_bytes is not None
        ]
        # the family is always there with --deep (alerts can name it); a device whose used
        # memory no probe reported has no sample
        metric(
            "xpuctl_device_unattributed_bytes",
            "gauge",
            "Device memory in use that no visible process holds, minus the idle baseline (--deep).",
            unattributed,
        )
    stale = [a for a in snap.artifacts if a.stale]
    metric(
        "xpuctl_stale_files",
        "gauge",
        "Stale shm/IPC files by kind.",
        [({"kind": k}, float(sum(1 for a in stale if a.kind == k))) for k in ("shm", "filestore", "ccl-socket", "zmq-socket")],
    )
    metric("xpuctl_stale_bytes", "gauge", "Bytes in stale files.", [({}, float(sum(a.size_bytes for a in stale)))])
    return "\n".join(lines) + "\n"

