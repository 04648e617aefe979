"""The JSON documents of every command (`xpuctl.doctor/1`, `xpuctl.ps/1`, ...), built from
typed records, and the one JSON writer.

Host text is carried exactly: `to_json` writes ASCII only, a byte that was not UTF-8 as its
`\\udcXX` escape (README, "JSON output"). Tables and plain lines are drawn from the same
records (`tables`, `lines`), so the three forms always agree.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

from xpuctl import __version__
from xpuctl.core.collective import CollectiveResult
from xpuctl.core.model import (
    Artifact,
    Container,
    Device,
    Finding,
    Port,
    Process,
    RayActor,
    Report,
    RuntimeView,
    Scan,
    Unreadable,
)
from xpuctl.core.runrecords import Health, RunRow, Unread
from xpuctl.output import jsontext
from xpuctl.output.shapes import RebindPlan, Rebound, ResetDone, ResetPlan, Stopped, Tree

if TYPE_CHECKING:  # types only: the watch's judgement is imported where a run is shown, a
    # probe's parser where --deep's results are (a plain doctor has none)
    from xpuctl.core.watch import Judged
    from xpuctl.parse.probes import ProbeResult

#: A value of a JSON document, as `to_json` writes it (a tuple is an array).
Json: TypeAlias = "str | int | float | bool | Sequence[Json] | Mapping[str, Json] | None"
#: A JSON object: a command's document, or a part of one.
Document: TypeAlias = "dict[str, Json]"


def probe_dict(r: ProbeResult) -> Document:
    """A probe's summary: its stored form without the per-device answers (those are shown
    per device, under `runtime`)."""
    from xpuctl.parse.probes import result_to_dict

    data = result_to_dict(r)
    del data["devices"]
    return data


def runtime_dict(v: RuntimeView | None) -> Document | None:
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
        "health": v.health,  # Sysman's health extension: ok | warning | critical | failed
    }


def holder_containers(scan: Scan, bdf: str) -> list[Document]:
    """Each holder of a device with its container (null when it runs in none)."""
    out: list[Document] = []
    for pid in scan.holders(bdf):
        p = scan.process(pid)
        out.append({"pid": pid, "container": container_dict(p.container if p else None)})
    return out


def device_dict(d: Device, scan: Scan) -> Document:
    view = scan.deep.device(d.bdf) if scan.deep else None
    return {
        "index": d.index,
        "bdf": d.bdf,
        "render_node": d.render_node,
        "card_node": d.card_node,
        "driver": d.driver,
        "vendor_id": d.vendor_id,
        "device_id": d.device_id,
        "intel": d.is_intel,
        "survivability": d.survivability,  # xe's survivability_mode: Boot | Runtime | unknown
        "health": d.health,  # xe's gpu_health: ok | warning | critical | unknown; None: no file
        "memory_used_bytes": scan.memory_used(d.bdf),  # fdinfo: shared buffers counted once
        "memory_shared_bytes": scan.memory_shared(d.bdf),  # fdinfo drm-shared, per client, summed
        "memory_resident_bytes": scan.memory_resident(d.bdf),  # fdinfo drm-resident
        "memory_source": scan.memory_source(d.bdf),  # fdinfo | sysfs-clients (i915 backport)
        "memory_total_bytes": d.memory_total_bytes,
        "holders": list(scan.holders(d.bdf)),
        "holder_containers": holder_containers(scan, d.bdf),
        "unknown_holders": list(scan.unknown_holders(d.bdf)),
        "runtime": runtime_dict(view),  # --deep only
        "unattributed_bytes": view.unattributed_bytes if view else None,
        **kernel_dict(d, scan),
    }


def kernel_dict(d: Device, scan: Scan) -> Document:
    """What the kernel said of the device: declared wedged (and not initialised since), a
    pending crash dump."""
    event = scan.kernel.wedged(d.bdf) if scan.kernel is not None else None
    dump = next((c for c in scan.coredumps if c.bdf == d.bdf), None)
    return {
        "wedged": {"since_boot_seconds": round(event.record.seconds, 6),
                   "record": event.record.text} if event is not None else None,
        "coredump": {"path": dump.path, "age_seconds": dump.age_seconds} if dump else None,
    }


def process_dict(p: Process) -> Document:
    argv, cut = p.shown_argv  # capped (docs/output.md): cut is the bytes not shown
    return {
        "pid": p.pid,
        "ppid": p.ppid,
        "state": p.state,
        "cmdline": " ".join(argv) if p.cmdline else p.command,
        "argv": list(argv),
        "argv_truncated": cut,
        "comm": p.comm,
        "role": p.role,
        "rank": p.rank,
        "orphan": p.orphan,
        "top": p.top,
        "devices": list(p.devices),
        "memory_bytes": p.memory_bytes,
        "run_id": p.run_id,
        "run_proven": p.run_proven,  # a live run's record vouches for run_id
        # its API server is gone and this run's live supervisor is stopping it (no orphan)
        "stopping_by": p.stopping_by,
        # vLLM run as a library: the live process the tree belongs to (never an orphan)
        "embedded_in": ({"pid": p.embedded_in.pid, "command": p.embedded_in.command,
                         "blocked": p.embedded_in.blocked}
                        if p.embedded_in is not None else None),
        "uid": p.uid,
        "threads": p.threads,
        "session": p.session,
        "start_time": p.start_time,
        "wchan": p.wchan,
        "ray": ray_dict(p.ray),
        "blocked": p.blocked,
        "container": container_dict(p.container),
    }


def container_dict(c: Container | None) -> Document | None:
    """The container or pod a process runs in (null: none, or its cgroup names none)."""
    if c is None:
        return None
    return {"runtime": c.runtime, "id": c.id, "name": c.name, "pod": c.pod, "namespace": c.namespace}


def ray_dict(actor: RayActor | None) -> Document | None:
    """The Ray actor a process runs (null when it is none, or Ray was not asked)."""
    if actor is None:
        return None
    return {"actor_id": actor.actor_id, "name": actor.name, "class_name": actor.class_name,
            "job_id": actor.job_id, "node_id": actor.node_id, "driver_pid": actor.driver_pid,
            "driver_gone": actor.driver_gone}


def artifact_dict(a: Artifact) -> Document:
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


def port_dict(p: Port) -> Document:
    return {
        "port": p.port,
        "address": p.address,
        "pid": p.pid,
        "state": p.state,
        "role": p.role,
        "orphan": p.orphan,
        "kind": p.kind,  # oneccl-kvs: oneCCL's KVS listener (its process maps libccl)
    }


def blocked_dicts(scan: Scan) -> list[dict[str, str]]:
    """Every read that did not answer within the bound, processes' and sysfs' alike."""
    return [{"path": i.source, "reason": i.reason} for i in scan.blocked]


def unreadable_dict(u: Unreadable) -> Document:
    return {
        "pid": u.pid,
        "command": u.command,
        "comm": u.comm,
        "state": u.state,
        "wchan": u.wchan,
        "file": u.file,
        "reason": u.reason,
        "blocked": u.blocked,
        "fds_known": u.fds_known,
    }


def finding_dict(f: Finding) -> Document:
    return {
        "check": f.check,
        "severity": f.severity,
        "device": f.device,
        "pids": list(f.pids),
        "paths": list(f.paths),
        "message": f.message,
        "remedy": f.remedy,
    }


def doctor_dict(report: Report) -> Document:
    scan = report.scan
    return {
        "schema": "xpuctl.doctor/1",
        "version": __version__,
        "root": scan.root,
        "taken_at": scan.taken_at,
        "status": report.status,
        "devices": [device_dict(d, scan) for d in scan.devices],
        "processes": [process_dict(p) for p in scan.processes],
        "artifacts": [artifact_dict(a) for a in scan.artifacts],
        "ports": [port_dict(p) for p in scan.ports],
        "findings": [finding_dict(f) for f in report.findings],
        "unreadable_processes": [unreadable_dict(u) for u in scan.unreadable_processes],
        "blocked_reads": blocked_dicts(scan),
        "probes": [probe_dict(r) for r in scan.deep.probes] if scan.deep else [],
        "collective": collective_dict(scan.collective) if scan.collective else None,
        "shm": scan.shm._asdict() if scan.shm else None,  # /dev/shm: path, size_bytes, free_bytes
        # --deep: the software stack, each {name, version, source, why} (why: it is unknown)
        "versions": [v._asdict() for v in scan.deep.versions] if scan.deep else None,
    }


def collective_dict(r: CollectiveResult) -> Document:
    """`doctor --collective`'s result (issue 21's shape)."""
    return {
        "verdict": r.verdict, "proof": r.proof, "backend": r.backend,
        "world_size": r.world_size,
        "seconds": r.seconds, "stuck_phase": r.stuck_phase, "reason": r.reason,
        "ranks": [{"rank": k.rank, "device": k.device, "bdf": k.bdf, "phase": k.phase,
                   "returncode": k.returncode, "error": k.error} for k in r.ranks],
        "alone": [{"bdf": a.bdf, "verdict": a.verdict, "phase": a.phase} for a in r.alone],
    }


def to_json(data: Document) -> str:
    """Exact text, printable ASCII only: non-ASCII as \\uXXXX, and a byte that was not UTF-8
    (read as a lone surrogate U+DC80-U+DCFF, "surrogateescape") as \\udcXX, which a reader
    turns back into the byte (README, "JSON output"). Never raw bytes, never a crash."""
    return jsontext.dumps(data)



def run_dict(r: RunRow, now: float | None = None) -> Document:
    """One run of `ps --json`; a stale one (state "stale") also says what its record still
    says; `health` is the record's (null: an xpuctl without the watch)
    with `healthy` and `status` as `xpuctl health` judges it at `now`."""
    health = r.health
    out: Document = {
        "name": r.name, "state": r.state, "age_seconds": r.age_seconds, "pid": r.pid,
        "port": r.port, "devices": list(r.devices), "run_id": r.run_id,
        "recorded_state": r.recorded_state, "health": None,
        "vllm_exit_code": r.exit_code,  # vLLM's own status once it exited (serve's is apart)
    }
    if health is not None:
        from xpuctl.core.watch import judge

        seen = judge(r.state, health, time.time() if now is None else now)
        out["health"] = {**health.to_dict(), "healthy": seen.healthy, "status": seen.status}
    return out


def health_document(name: str, state: str, health: Health | None, seen: Judged,
                    now: float) -> Document:
    """`xpuctl health --json`: one object; `health` is the record's field (null: an xpuctl
    without the watch), `seen` how it is judged at `now`."""
    return {"schema": "xpuctl.health/1", "name": name, "healthy": seen.healthy,
            "status": seen.status, "detail": seen.detail, "state": state,
            "health": health.to_dict() if health is not None else None,
            "checked_seconds_ago": round(max(0.0, now - health.checked_at), 3)
            if health is not None else None}


def unread_run_dict(u: Unread) -> Document:
    """A run record (or directory of records, `name` null) that could not be read."""
    return {"path": u.path, "name": u.name, "damaged": u.damaged, "why": u.why}


def ps_document(runs: Sequence[RunRow], processes: Sequence[Process], scan: Scan | None = None,
                unread: Sequence[Unread] = ()) -> Document:
    """`ps --json`; `scan`: the scan, for what it could not read; `unread`: the run records
    that could not be read."""
    return {"schema": "xpuctl.ps/1", "runs": [run_dict(r) for r in runs],
            "unread_runs": [unread_run_dict(u) for u in unread],
            "processes": [process_dict(p) for p in processes],
            "unreadable_processes": [unreadable_dict(u) for u in scan.unreadable_processes] if scan else [],
            "blocked_reads": blocked_dicts(scan) if scan else []}


def devices_document(scan: Scan, baseline: list[tuple[str, int | None, str]] | None) -> Document:
    """`devices --json`; `baseline` is what --record-baseline recorded (None: not asked)."""
    data: Document = {"schema": "xpuctl.devices/1",
                            "devices": [device_dict(d, scan) for d in scan.devices],
                            "unreadable_processes": [unreadable_dict(u) for u in scan.unreadable_processes],
                            "blocked_reads": blocked_dicts(scan)}
    if scan.deep is not None:
        data["probes"] = [probe_dict(r) for r in scan.deep.probes]
    if baseline is not None:
        data["baseline"] = [{"bdf": b, "memory_used_bytes": n, "note": note} for b, n, note in baseline]
    return data


def shutdown_target_dicts(trees: Sequence[Tree],
                          members: Mapping[int, list[int]]) -> list[Document]:
    """The servers a shutdown stops (or would stop), with the processes it waits for."""
    return [
        {
            "name": t.name,
            "top": t.top.pid,
            "role": t.role,
            "orphan": t.orphan,
            "run_id": t.run_id,
            "devices": list(t.devices),
            "port": t.port,
            "shutdown_timeout": t.shutdown_timeout,
            "processes": members[t.top.pid],
        }
        for t in trees
    ]


def shutdown_plan_document(targets: Sequence[Document], dry_run: bool,
                           skipped: Sequence[str] = ()) -> Document:
    """`skipped`: what a read that did not answer kept out of the plan (ladder.skipped_lines)."""
    return {"schema": "xpuctl.shutdown/1", "dry_run": dry_run, "targets": targets, "events": [],
            "verdict": "planned" if targets else "nothing", "skipped": list(skipped)}


def shutdown_document(targets: Sequence[Document], result: Stopped,
                      resolve_seconds: float | None, audit: Document) -> Document:
    return {
        "schema": "xpuctl.shutdown/1",
        "dry_run": False,
        "targets": targets,  # the processes the ladder waited for
        "events": [{"t": e.t, "phase": e.phase, "detail": e.detail} for e in result.events],
        "resolve_seconds": round(resolve_seconds, 3) if resolve_seconds is not None else None,
        "verdict": result.verdict,
        "survivors": result.survivors,
        "holders": result.holders,
        "stuck": [{"pid": p, "wchan": w} for p, w in result.stuck],
        "skipped": [e.detail for e in result.events if e.phase == "skipped"],
        "ports_busy": result.port_busy,
        "audit": audit,
    }


def reset_plan_dict(plan: ResetPlan, kill_holders: bool, advice: Sequence[Finding]) -> Document:
    return {
        "orphans": [{"top": t.top.pid, "devices": list(t.devices)} for t in plan.orphan_trees],
        "orphan_pids": plan.orphan_pids,
        "files": [artifact_dict(f) for f in plan.files],
        "files_after_orphans": [artifact_dict(f) for f in plan.pending_files],
        "skipped": [{"path": f.path, "why": why} for f, why in plan.skipped_files],
        "device_reset": plan.device_reset,
        "holders": [{"pid": h.pid, "command": h.command, "devices": list(h.devices),
                     "stop": kill_holders and h.why_not is None, "why_not": h.why_not}
                    for h in plan.holders],
        "notes": plan.notes,
        "advice": [finding_dict(f) for f in advice],
    }


def reset_plan_document(plan: Document, dry_run: bool) -> Document:
    return {"schema": "xpuctl.reset/1", "dry_run": dry_run, "plan": plan}


def reset_document(plan: Document, outcome: ResetDone, audit: Document) -> Document:
    return {
        "schema": "xpuctl.reset/1",
        "dry_run": False,
        "plan": plan,
        "stopped": outcome.stopped.verdict if outcome.stopped else None,
        "removed": [r.path for r in outcome.removed if r.removed],
        "kept": [{"path": r.path, "why": r.reason} for r in outcome.removed if not r.removed],
        "device_reset": [{"bdf": b, "done": ok, "detail": why} for b, ok, why in outcome.device_reset],
        "status": outcome.after.status,
        "findings": [finding_dict(f) for f in outcome.after.findings],
        "audit": audit,
    }


def rebind_plan_dict(plan: RebindPlan) -> Document:
    d = plan.device
    return {
        "device": d.index, "bdf": d.bdf, "driver": plan.driver, "nodes": list(plan.nodes),
        "writes": [{"path": path, "value": d.bdf} for path in (plan.unbind, plan.bind)],
        "holders": [{"pid": h.pid, "command": h.command, "stoppable": h.why_not is None,
                     "why_not": h.why_not} for h in plan.holders],
        "refused": plan.refused,
        "wedge_method": plan.wedge_method,  # the kernel log's WEDGED=<method>, when it says
        "sysman_health": plan.sysman_health,  # Sysman's health extension: ok … failed
    }


def rebind_plan_document(plan: RebindPlan, dry_run: bool) -> Document:
    """`reset --rebind --json` when nothing was written: a dry run, or refused."""
    return {"schema": "xpuctl.reset/1", "dry_run": dry_run, "rebind": rebind_plan_dict(plan)}


def rebind_document(plan: RebindPlan, out: Rebound, audit: Document) -> Document:
    """`reset --rebind --json` after the writes: the plan, what was done, the check after."""
    return {
        **rebind_plan_document(plan, False),
        "writes": [{"path": w.path, "done": w.done, "detail": w.detail} for w in out.writes],
        "nodes_gone": out.gone, "render_node": out.back, "missing": list(out.missing),
        "status": out.after.status if out.after else None,
        "findings": [finding_dict(f) for f in out.after.findings] if out.after else [],
        "audit": audit,
    }
