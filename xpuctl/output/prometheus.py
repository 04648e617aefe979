"""doctor's Prometheus text exposition, for node_exporter's textfile collector.

Label values go through `safetext.prom_label`; sample values are exact (`sample_value`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from xpuctl import __version__
from xpuctl.core.checks import CHECKS
from xpuctl.core.cluster import Family, Sample
from xpuctl.core.model import Device, Report, Scan
from xpuctl.core.rules import STALE_KINDS
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


#: (labels, value) of each sample; a label value is written as str() gives it
Samples = Sequence[tuple[Mapping[str, object], float]]
# (name, help, samples): every family is a gauge; `families` types them
_Family = tuple[str, str, Samples]
STATUSES = ("clean", "busy", "dirty", "unknown")


def prometheus(report: Report) -> str:
    return exposition(families(report))


def families(report: Report) -> list[Family]:
    """doctor's metric families, typed (a Ray node sends these with its document)."""
    raw = [*_doctor_families(report), *_device_families(report.scan), *_file_families(report.scan),
           *_run_families(report.scan)]
    return [Family(name, help_, tuple(Sample({k: str(v) for k, v in labels.items()}, float(value))
                                      for labels, value in samples))
            for name, help_, samples in raw]


def exposition(fams: list[Family]) -> str:
    """The text exposition: one HELP and TYPE per family, then its samples."""
    lines: list[str] = []
    for f in fams:
        lines.append(f"# HELP {f.name} {f.help}")
        lines.append(f"# TYPE {f.name} gauge")
        for s in f.samples:
            lab = ",".join(f'{k}="{prom_label(v)}"' for k, v in s.labels.items())
            value = sample_value(s.value)
            lines.append(f"{f.name}{{{lab}}} {value}" if lab else f"{f.name} {value}")
    return "\n".join(lines) + "\n"


def _doctor_families(report: Report) -> list[_Family]:
    worst: dict[str, int] = dict.fromkeys(CHECKS, 0)
    rank = {"info": 0, "warn": 1, "fail": 2}
    for f in report.findings:
        worst[f.check] = max(worst[f.check], rank[f.severity])
    count = {(f.check, f.severity): 0 for f in report.findings}
    for f in report.findings:
        count[(f.check, f.severity)] += 1
    return [
        ("xpuctl_build_info", "xpuctl version.", [({"version": __version__}, 1)]),
        ("xpuctl_doctor_last_run_timestamp_seconds", "When doctor ran.", [({}, report.scan.taken_at)]),
        ("xpuctl_doctor_status", "1 for the current status (clean, busy, dirty, unknown).",
         [({"status": s}, 1.0 if report.status == s else 0.0) for s in STATUSES]),
        ("xpuctl_doctor_check_ok", "1 when the check found no warning or failure.",
         [({"check": c}, 1.0 if worst[c] == 0 else 0.0) for c in CHECKS]),
        ("xpuctl_doctor_findings", "Findings by check and severity.",
         [({"check": c, "severity": s}, float(count.get((c, s), 0))) for c in CHECKS for s in ("warn", "fail")]),
    ]


def _device_families(scan: Scan) -> list[_Family]:
    devs = [d for d in scan.devices if d.is_intel]
    out: list[_Family] = [
        ("xpuctl_device_holder_processes", "Processes holding the device open.",
         [({"device": d.bdf}, float(len(scan.holders(d.bdf)))) for d in devs]),
        ("xpuctl_device_orphan_processes", "Orphaned vLLM processes holding the device.",
         [({"device": d.bdf}, float(sum(1 for p in scan.processes if p.orphan and d.bdf in p.devices)))
          for d in devs]),
        ("xpuctl_device_memory_used_bytes", "Device memory held by clients (de-duplicated DRM fdinfo).",
         [({"device": d.bdf}, float(scan.memory_used(d.bdf) or 0)) for d in devs]),
    ]
    for name, what, fn in (
            ("xpuctl_device_memory_shared_bytes", "Device memory in DRM fdinfo drm-shared, summed over clients.",
             scan.memory_shared),
            ("xpuctl_device_memory_resident_bytes", "Device memory in DRM fdinfo drm-resident, summed over clients.",
             scan.memory_resident)):
        samples = [({"device": d.bdf}, float(v)) for d in devs if (v := fn(d.bdf)) is not None]
        if samples:
            out.append((name, what, samples))
    out.append(("xpuctl_device_container_holder_processes",
                ("Processes holding the device, by the container and pod they run in (empty "
                 "labels: on the host); they sum to xpuctl_device_holder_processes."),
                _holder_samples(scan, devs)))
    health = _health_samples(scan, devs)
    if health:
        out.append(("xpuctl_device_health",
                    ("The card's own health, the worse of xe's gpu_health and Level Zero "
                     "Sysman's (--deep): 0 ok, 1 warning, 2 critical, 3 failed; `source` says "
                     "which. No sample for a card that tells nothing."), health))
    totals = [({"device": d.bdf}, float(d.memory_total_bytes)) for d in devs if d.memory_total_bytes]
    if totals:
        out.append(("xpuctl_device_memory_total_bytes", "Device memory size.", totals))
    if scan.deep is not None:
        out.append(("xpuctl_probe_available", "1 when the deep probe answered (--deep).",
                    [({"probe": r.name}, 1.0 if r.available else 0.0) for r in scan.deep.probes]))
        # the family is always there with --deep (alerts can name it); a device whose used
        # memory no probe reported has no sample
        out.append(("xpuctl_device_unattributed_bytes",
                    "Device memory in use that no visible process holds, minus the idle baseline (--deep).",
                    [({"device": v.bdf}, float(v.unattributed_bytes))
                     for v in scan.deep.devices if v.unattributed_bytes is not None]))
    c = scan.collective
    if c is not None and c.verdict != "unavailable":
        # every device of the group is 0 when the group hung or failed: that is what a
        # launch on them does (the finding names the card at fault from the runs alone)
        out.append(("xpuctl_collective_ok",
                    ("1 when oneCCL init, an all_reduce and destroy passed on the device's "
                     "group (--collective; one device: an allocation and a computation on it)."),
                    [({"device": b}, 1.0 if c.verdict == "ok" else 0.0) for b in c.bdfs]))
    return out


def _health_samples(scan: Scan, devs: list[Device]) -> Samples:
    """One sample per card that tells its health (parse/health.py's scale)."""
    from xpuctl.parse.health import RANK

    out: list[tuple[Mapping[str, object], float]] = []
    for d in devs:
        view = scan.deep.device(d.bdf) if scan.deep else None
        told = [(h, src) for h, src in ((d.health, "gpu_health"),
                                        (view.health if view else None, "sysman"))
                if h in RANK]
        if told:
            level, src = max(told, key=lambda t: RANK[t[0]])
            out.append(({"device": d.bdf, "source": src}, float(RANK[level])))
    return out


def _holder_samples(scan: Scan, devs: list[Device]) -> Samples:
    """One sample per device and container holding it (no pid label: one series per process
    would grow without bound), so an alert names what an operator can act on."""
    out: list[tuple[Mapping[str, object], float]] = []
    for d in devs:
        counts: dict[tuple[str, str, str, str], int] = {}
        for pid in scan.holders(d.bdf):
            p = scan.process(pid)
            c = p.container if p else None
            key = ((c.runtime or "", c.namespace or "", c.pod or "", c.name or c.id[:12])
                   if c else ("", "", "", ""))
            counts[key] = counts.get(key, 0) + 1
        for (runtime, namespace, pod, container), n in counts.items():
            out.append(({"device": d.bdf, "runtime": runtime, "namespace": namespace, "pod": pod,
                         "container": container}, float(n)))
    return out


def _file_families(scan: Scan) -> list[_Family]:
    stale = [a for a in scan.artifacts if a.stale]
    return [
        ("xpuctl_stale_files", "Stale shm/IPC files by kind.",
         [({"kind": k}, float(sum(1 for a in stale if a.kind == k))) for k in STALE_KINDS]),
        ("xpuctl_stale_bytes", "Bytes in stale files.", [({}, float(sum(a.size_bytes for a in stale)))]),
    ]


def _run_families(scan: Scan) -> list[_Family]:
    """Each live run's health as serve's watch recorded it (`xpuctl health` says the same);
    a run without a recorded health (an xpuctl without the watch) has no sample."""
    from xpuctl.core.watch import judge

    samples: list[tuple[Mapping[str, object], float]] = []
    for run in scan.runs:
        seen = judge(run.state, run.health, scan.taken_at)
        if seen.status != "unknown":
            samples.append(({"run": run.name}, 1.0 if seen.healthy else 0.0))
    what = ("1 when the run's watch found it healthy within three intervals (serve's "
            "--health-interval); 0 when unhealthy, stalled, stopping or not checked.")
    return [("xpuctl_run_healthy", what, samples)] if samples else []
