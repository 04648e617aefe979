"""Render reports: JSON for scripts, Prometheus text for node_exporter, rich tables for people.

JSON and text come from the same dicts, so they always agree. rich is imported only by the
table renderers (it costs ~60 ms to import, and scripts asking for JSON never need it).

Host text: JSON carries it exactly (`to_json`); Prometheus labels go through
`safetext.prom_label`; every cell and line of the tables goes through `safetext.safe` (`_cell`),
and the console that prints them (`safetext.console`) escapes whatever reaches it again.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from xpuctl import __version__
from xpuctl.core.checks import CHECKS, human_bytes
from xpuctl.core.model import Artifact, Device, Finding, Port, Process, Report, RuntimeView, Snapshot
from xpuctl.parse.probes import ProbeResult, result_to_dict
from xpuctl.output.safetext import prom_label, safe

if TYPE_CHECKING:
    from rich.console import Console


def probe_dict(r: ProbeResult) -> dict[str, Any]:
    """A probe's summary: its stored form without the per-device answers (those are shown
    per device, under `runtime`)."""
    data = result_to_dict(r)
    del data["devices"]
    return data


def runtime_dict(v: RuntimeView | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return {
        "source": v.source,
        "memory_used_bytes": v.memory_used_bytes,
        "processes": [{"pid": p.pid, "memory_bytes": p.memory_bytes} for p in v.processes],
        "process_source": v.process_source,
        "state": v.state,
        "lost_reasons": list(v.lost_reasons),
        "visible_bytes": v.visible_bytes,
        "baseline_bytes": v.baseline_bytes,
        "invisible_pids": list(v.invisible_pids),
    }


def device_dict(d: Device, snap: Snapshot) -> dict[str, Any]:
    view = snap.deep.device(d.bdf) if snap.deep else None
    return {
        "index": d.index,
        "bdf": d.bdf,
        "render_node": d.render_node,
        "card_node": d.card_node,
        "driver": d.driver,
        "vendor_id": d.vendor_id,
        "device_id": d.device_id,
        "intel": d.is_intel,
        "memory_used_bytes": snap.memory_used(d.bdf),
        "memory_total_bytes": d.memory_total_bytes,
        "holders": list(snap.holders(d.bdf)),
        "runtime": runtime_dict(view),  # --deep only
        "unattributed_bytes": view.unattributed_bytes if view else None,
    }


def process_dict(p: Process) -> dict[str, Any]:
    return {
        "pid": p.pid,
        "ppid": p.ppid,
        "state": p.state,
        "cmdline": p.command,
        "argv": list(p.cmdline),
        "comm": p.comm,
        "role": p.role,
        "rank": p.rank,
        "orphan": p.orphan,
        "top": p.top,
        "devices": list(p.devices),
        "memory_bytes": p.memory_bytes,
        "run_id": p.run_id,
        "uid": p.uid,
        "threads": p.threads,
        "session": p.session,
        "start_time": p.start_time,
        "wchan": p.wchan,
    }


def artifact_dict(a: Artifact) -> dict[str, Any]:
    return {
        "path": a.path,
        "kind": a.kind,
        "stale": a.stale,
        "reason": a.reason,
        "open_by": list(a.open_by),
        "owner_uid": a.owner_uid,
        "size_bytes": a.size_bytes,
        "age_seconds": round(a.age_seconds, 1) if a.age_seconds is not None else None,
    }


def port_dict(p: Port) -> dict[str, Any]:
    return {
        "port": p.port,
        "address": p.address,
        "pid": p.pid,
        "state": p.state,
        "role": p.role,
        "orphan": p.orphan,
    }


def finding_dict(f: Finding) -> dict[str, Any]:
    return {
        "check": f.check,
        "severity": f.severity,
        "device": f.device,
        "pids": list(f.pids),
        "paths": list(f.paths),
        "message": f.message,
        "remedy": f.remedy,
    }


def doctor_dict(report: Report) -> dict[str, Any]:
    snap = report.snapshot
    return {
        "schema": "xpuctl.doctor/1",
        "version": __version__,
        "root": snap.root,
        "taken_at": snap.taken_at,
        "status": report.status,
        "devices": [device_dict(d, snap) for d in snap.devices],
        "processes": [process_dict(p) for p in snap.processes],
        "artifacts": [artifact_dict(a) for a in snap.artifacts],
        "ports": [port_dict(p) for p in snap.ports],
        "findings": [finding_dict(f) for f in report.findings],
        "unreadable_processes": snap.unreadable,
        "probes": [probe_dict(r) for r in snap.deep.probes] if snap.deep else [],
    }


def to_json(data: dict[str, Any]) -> str:
    """Exact text, printable ASCII only: non-ASCII as \\uXXXX, and a byte that was not UTF-8
    (read as a lone surrogate U+DC80-U+DCFF, "surrogateescape") as \\udcXX, which a reader
    turns back into the byte (README, "JSON output"). Never raw bytes, never a crash."""
    return json.dumps(data, indent=2, sort_keys=False, ensure_ascii=True)


# -- Prometheus text exposition (node_exporter textfile collector) ----------------------


def _value(value: float) -> str:
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
    snap = report.snapshot
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{prom_label(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{lab}}} {_value(value)}" if lab else f"{name} {_value(value)}")

    metric("xpuctl_build_info", "gauge", "xpuctl version.", [({"version": __version__}, 1)])
    metric("xpuctl_doctor_last_run_timestamp_seconds", "gauge", "When doctor ran.", [({}, snap.taken_at)])
    metric(
        "xpuctl_doctor_status",
        "gauge",
        "1 for the current status (clean, busy, dirty).",
        [({"status": s}, 1.0 if report.status == s else 0.0) for s in ("clean", "busy", "dirty")],
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


# -- rich tables for people ------------------------------------------------------------

def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // (size // 60 if unit != 'd' else 3600)}" + (
                "h" if unit == "d" else ("m" if unit == "h" else "s")
            )
    return f"{s}s"


_SEV_STYLE = {"fail": "bold red", "warn": "yellow", "info": "cyan"}
_STATUS_STYLE = {"clean": "bold green", "busy": "bold cyan", "dirty": "bold red"}


def _cell(value: object) -> Any:
    """A table cell holding host text: escaped (safetext.safe), never read as markup."""
    from rich.text import Text

    return Text(safe(value))


def _dev_label(snap: Snapshot, bdf: str) -> str:
    """The Level Zero index when there is one (short), else the BDF."""
    d = snap.device(bdf)
    if d is None or d.index is None:
        return bdf
    return str(d.index)


def devices_table(snap: Snapshot) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = Table(title="Devices", title_justify="left", expand=False)
    deep_cols = ("device used", "unattributed", "state") if snap.deep else ()
    right = ("#", "memory used", "total", "device used", "unattributed")
    for col in ("#", "BDF", "node", "driver", "id", "memory used", "total", "holders", *deep_cols):
        t.add_column(col, justify="right" if col in right else "left", no_wrap=True)
    for d in snap.devices:
        holders = snap.holders(d.bdf)
        view = snap.deep.device(d.bdf) if snap.deep else None
        extra = () if not snap.deep else (
            "-" if view is None or view.memory_used_bytes is None
            else f"{human_bytes(view.memory_used_bytes)} ({view.source})",
            "-" if view is None or view.unattributed_bytes is None else human_bytes(view.unattributed_bytes),
            "-" if view is None else (Text("lost", style="bold red") if view.state == "lost" else "ok"),
        )
        t.add_row(
            "-" if d.index is None else str(d.index),
            _cell(d.bdf),
            _cell((d.render_node or d.card_node or "-").rsplit("/", 1)[-1]),
            _cell(d.driver or "?"),
            _cell(f"{d.vendor_id}:{d.device_id}"),
            human_bytes(snap.memory_used(d.bdf)) if snap.memory_used(d.bdf) is not None else "-",
            human_bytes(d.memory_total_bytes) if d.memory_total_bytes else "-",
            ", ".join(map(str, holders)) or "-",
            *extra,
        )
    return t


def probes_line(snap: Snapshot) -> Any:
    """One line naming each deep probe and whether it answered (a rich Text, no markup)."""
    if snap.deep is None:
        return None
    from rich.text import Text

    line = Text("deep probes: ")
    for n, r in enumerate(snap.deep.probes):
        if n:
            line.append(", ")
        line.append(f"{r.name} ")
        if r.available:
            line.append("ok", style="green")
            line.append(f" {r.seconds or 0:.2f}s")
        elif r.timed_out:
            line.append("timed out", style="yellow")
        else:
            line.append("unavailable", style="dim")
    why = [f"{r.name}: {safe(r.reason or '?')}" for r in snap.deep.probes if not r.available]
    if why:
        line.append("  (" + "; ".join(why) + ")")
    return line


def processes_table(snap: Snapshot, title: str = "Processes", width: int = 120) -> Any:
    """A ps-style listing (rich's Table squeezes short columns when a command is long)."""
    from rich.text import Text

    heads = ["PID", "PPID", "S", "ROLE", "DEV", "MEMORY", "RUN", "COMMAND"]
    rows = []
    for p in snap.processes:
        rows.append(
            [
                str(p.pid),
                str(p.ppid),
                safe(p.state + (f"({p.wchan})" if p.wchan else ""), 64),
                safe((p.role or "-") + (f" {p.rank}" if p.rank else "") + (" ORPHAN" if p.orphan else ""), 64),
                safe(",".join(_dev_label(snap, b) for b in p.devices) or "-", 64),
                human_bytes(p.memory_bytes) if p.memory_bytes is not None else "-",
                safe((p.run_id or "-")[:8]),
                safe(p.command),
            ]
        )
    orphan = [False] + [p.orphan for p in snap.processes]
    widths = [max([len(heads[i])] + [len(r[i]) for r in rows]) for i in range(7)]
    role_at = sum(w + 2 for w in widths[:3])
    out = Text()
    out.append(title, style="bold")
    for i, r in enumerate([heads, *rows]):
        cells = [c.rjust(w) if j < 2 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))]
        head = "  ".join(cells) + "  "
        room = max(12, width - len(head))
        cmd = r[7] if len(r[7]) <= room else r[7][: room - 1] + "…"
        line = Text(head + cmd)
        if i == 0:
            line.stylize("bold")
        elif orphan[i]:
            at = role_at + r[3].rfind(" ORPHAN") + 1
            line.stylize("bold red", at, at + len("ORPHAN"))
        out.append("\n")
        out.append_text(line)
    return out


def run_dict(r: Any) -> dict[str, Any]:
    return {"name": r.name, "state": r.state, "age_seconds": r.age_seconds, "pid": r.pid,
            "port": r.port, "devices": list(r.devices), "run_id": r.run_id}


def runs_table(rows: list[Any]) -> Any:
    """xpuctl's runs (from their records): name, state, age, pid, port, devices."""
    from rich.text import Text

    heads = ["NAME", "STATE", "AGE", "PID", "PORT", "DEVICES"]
    cells = [[safe(r.name), r.state, human_age(r.age_seconds), str(r.pid or "-"), str(r.port),
              ",".join(r.devices) or "-"] for r in rows]
    widths = [max([len(heads[i])] + [len(c[i]) for c in cells]) for i in range(len(heads))]
    out = Text("Runs", style="bold")
    for i, row in enumerate([heads, *cells]):
        out.append("\n")
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        out.append(line, style="bold" if i == 0 else None)
    return out


def print_devices(console: Console, snap: Snapshot) -> None:
    """The devices table, or a plain sentence where it would be empty."""
    if not any(d.is_intel for d in snap.devices):
        console.print("no Intel GPU found", highlight=False)
    if snap.devices:
        console.print(devices_table(snap))


def findings_table(findings: tuple[Finding, ...] | list[Finding]) -> Any:
    """Severity, check id, then the message; a long message wraps under itself (a hanging
    indent), and the remedy follows on its own line in the same column. Host text is
    escaped (safe) and printed as plain text, never as rich markup."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)  # "  FAIL"
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for f in findings:
        grid.add_row(Text("  " + f.severity.upper().ljust(4), style=_SEV_STYLE[f.severity]),
                     Text(f.check), Text(safe(f.message)))
        if f.remedy:
            fix = Text("fix: ", style="dim")
            fix.append(safe(f.remedy), style="bold")
            grid.add_row("", "", fix)
    return grid


def print_doctor(console: Console, report: Report) -> None:
    from rich.text import Text

    snap = report.snapshot
    print_devices(console, snap)
    line = probes_line(snap)
    if line:
        console.print(line, highlight=False)
    if snap.processes:
        console.print(processes_table(snap, width=console.width), no_wrap=True, crop=True)
    stale = [a for a in snap.artifacts if a.stale]
    if stale:
        from rich.table import Table

        t = Table(title="Stale files", title_justify="left")
        for col in ("path", "kind", "owner", "size", "age"):
            t.add_column(col)
        for a in stale:
            t.add_row(
                _cell(a.path),
                _cell(a.kind),
                str(a.owner_uid),
                human_bytes(a.size_bytes),
                human_age(a.age_seconds),
            )
        console.print(t)
    if report.findings:
        console.print(Text("Findings", style="bold"))
        console.print(findings_table(report.findings))
    status = report.status
    bare = " (no Intel GPU found)" if any(f.check == "no-device" for f in report.findings) else ""
    console.print(Text.assemble("status: ", (status, _STATUS_STYLE[status]), bare))
