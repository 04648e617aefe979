"""Plain lines for people: findings, events, plans. No rich: these go through `safetext.emit`.

Each kind of line has one writer here, so the same thing reads the same wherever it is said
(doctor's advice in reset, serve's preflight, a stop's timeline in shutdown, reset and serve,
serve's start-up phases).
Host text in them is escaped with `safe`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from xpuctl.core import waits
from xpuctl.core.model import Finding, Scan
from xpuctl.core.waits import Wait
from xpuctl.output.safetext import safe
from xpuctl.output.shapes import (
    AuditLog,
    DriverWrite,
    RebindPlan,
    Rebound,
    Removed,
    ResetPlan,
    Step,
    Tree,
)


def finding_lines(findings: Iterable[Finding], lead: str = "", fix: str | None = "  fix: ",
                  skip_info: bool = False) -> list[str]:
    """`{lead}{severity} {check}: {message}`, then `{fix}{remedy}` when there is one
    (`fix=None`: no remedy lines)."""
    out = []
    for f in findings:
        if skip_info and f.severity == "info":
            continue
        out.append(f"{lead}{f.severity} {f.check}: {safe(f.message)}")
        if f.remedy and fix is not None:
            out.append(f"{fix}{safe(f.remedy)}")
    return out


def event_line(ev: Step) -> str:
    """One step of a stop's timeline: seconds since it began, the phase, what happened."""
    return f"{ev.t:7.2f}s  {ev.phase:<18} {safe(ev.detail)}"


def found_line(trees: int, resolve_s: float) -> str:
    """shutdown found its trees: how long after its own start (before the first signal)."""
    return f"found {trees} server tree(s) {resolve_s:.2f}s after start"


def phase_line(t: float, label: str) -> str:
    """A start-up phase as it begins: `  12.3s loading model` (tenths: phases last seconds)."""
    return f"{t:6.1f}s {label}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def waiting_for(w: Wait) -> str:
    """What a wait is for, without its time (`draining vllm-8000: 3 requests running`)."""
    subject = safe(w.subject)
    procs = _count(w.processes or 0, "process", "processes")
    if w.phase == waits.DRAIN:
        if w.requests:
            return f"draining {subject}: {_count(w.requests, 'request', 'requests')} running"
        return f"draining {subject}: waiting for {procs}"
    if w.phase == waits.TEARDOWN:
        return f"teardown of {subject}: waiting for {procs}"
    if w.phase == waits.ESCALATION:
        return f"SIGTERM to what is left of {subject}: waiting for {procs}"
    if w.phase == waits.KILL:
        return f"SIGKILL to what is left of {subject}: waiting for {procs}"
    if w.phase == waits.SUPERVISORS:
        return f"waiting for the supervisor of {subject} to exit"
    if w.phase == waits.RELEASE:
        held = f" ({_count(w.processes, 'holder', 'holders')} left)" if w.processes else ""
        return f"release of {subject}: waiting for the devices and port to be free{held}"
    where = (f"collective check, each of {subject} alone" if w.phase == waits.COLLECTIVE_ALONE
             else f"collective check on {subject}")
    return f"{where}: {safe(w.step)}" if w.step else where


def wait_line(w: Wait, now: float, width: int | None = None) -> str:
    """A live countdown's text: what is awaited and the time left, in whole seconds
    (`draining vllm-8000: 3 requests running, 12 s left`); within `width` columns what is
    awaited is cut first, never the time left."""
    what, left = waiting_for(w), f", {w.left(now):.0f} s left"
    if width is not None and len(what) + len(left) > width:
        what = what[: max(1, width - len(left) - 1)] + "…"
    return what + left


def wait_phase_line(w: Wait, now: float) -> str:
    """The one line a wait gets where nothing is redrawn (not a terminal): what it waits
    for and for how long at most (`teardown of vllm-8000: waiting for 3 processes, up to
    8 s`); the collective check's ranks' phase moves within it, so it is left out."""
    return f"{waiting_for(w._replace(step=None))}, up to {w.left(now):.0f} s"


def next_command(devices: Iterable[str], port: int | None, verdict: str) -> str:
    """The one command to run after a failed start or stop: reset when the stop had to
    escalate or left something (what was killed may have left orphans and files: reset
    stops and removes only what its rules allow), else doctor (what is left, if anything,
    and each finding's fix), both scoped to the run's devices (its port when it has none)."""
    devs = ",".join(devices)
    if verdict in ("escalated", "leftovers"):
        return f"xpuctl reset --device {devs}" if devs else "xpuctl reset"
    if devs:
        return f"xpuctl doctor --device {devs}"
    return f"xpuctl doctor --port {port}" if port else "xpuctl doctor"


def next_line(devices: Iterable[str], port: int | None, verdict: str) -> str:
    """`xpuctl: next step: xpuctl reset --device 0000:03:00.0` (said once, at the end)."""
    return f"xpuctl: next step: {safe(next_command(devices, port, verdict))}"


def audit_warning(log: AuditLog) -> str | None:
    """The audit log could not be written: say so (the action itself went ahead), unless a
    warning that covers it was given (`told`)."""
    if not log.lost or log.told:
        return None
    return f"xpuctl: warning: audit log {safe(log.path)}: {log.lost} line(s) not written ({safe(log.error)})"


def shutdown_plan_lines(trees: Sequence[Tree], members: Mapping[int, list[int]]) -> list[str]:
    """`shutdown --dry-run` (and a shutdown that finds nothing); `members`: each tree's
    processes by its top's pid."""
    if not trees:
        return ["nothing to stop"]
    return [
        f"would stop {safe(t.name)}: SIGTERM {t.role} {t.top.pid}"
        f"{' (orphaned)' if t.orphan else ''}, then wait for {len(members[t.top.pid])} process(es) "
        f"{members[t.top.pid]}, devices {safe(', '.join(t.devices)) or '-'}, port {t.port or '-'}"
        for t in trees
    ]


def reset_plan_lines(plan: ResetPlan, kill_holders: bool, advice: Sequence[Finding]) -> list[str]:
    """What reset will do (or would, with --dry-run), then the relaunch advice."""
    out = ["nothing to clean"] if plan.empty else []
    for t in plan.orphan_trees:
        held = safe(", ".join(t.devices)) or "no device"
        out.append(f"stop orphaned vLLM tree {t.top.pid} ({t.role}) holding {held}")
    for h in plan.holders:
        head = f"pid {h.pid} ({safe(h.command, 200)}) holds {safe(', '.join(h.devices))}, not part of a live server"
        if h.why_not is not None:
            out.append(f"holder {head}: not stopped: {safe(h.why_not)}")
        elif kill_holders:
            out.append(f"stop holder {head}")
        else:
            out.append(f"holder {head}: --kill-holders stops it")
    for f in plan.files:
        out.append(f"remove {safe(f.path)} ({f.kind}, uid {f.owner_uid}, {f.size_bytes} bytes): {safe(f.reason)}")
    for f in plan.pending_files:
        out.append(f"remove {safe(f.path)} ({f.kind}) once the orphans keeping it are gone")
    for f, why in plan.skipped_files:
        out.append(f"skip {safe(f.path)}: {safe(why)}")
    for b in plan.device_reset:
        out.append(f"reset device {safe(b)} (PCI function reset) once nothing holds it")
    for n in plan.notes:
        out.append(f"note: {safe(n)}")
    return out + finding_lines(advice, fix="  ")


def removal_line(r: Removed) -> str | None:
    """A file reset removed, or kept and why (None: it was gone already)."""
    if r.removed:
        return f"removed {safe(r.path)} ({r.kind}, {r.size_bytes} bytes)"
    if r.reason == "already gone":
        return None
    return f"kept {safe(r.path)}: {safe(r.reason)}"


def device_reset_line(bdf: str, done: bool, detail: str) -> str:
    return f"device reset {safe(bdf)}: {'done' if done else 'not done'} ({safe(detail)})"


def reset_result_lines(findings: list[Finding], status: str) -> list[str]:
    return [f"still failing: {f.check}: {safe(f.message)}" for f in findings] + [f"status: {status}"]


def rebind_plan_lines(plan: RebindPlan) -> list[str]:
    """What `reset --rebind` will do (or would, with --dry-run), or why it refuses."""
    d = plan.device
    name = f"device {d.index if d.index is not None else '-'} ({d.bdf}, driver {plan.driver})"
    out = [f"rebind {name}:"]
    for h in plan.holders:
        act = "stop first" if plan.kill_holders and h.why_not is None else (h.why_not or "holds it")
        out.append(f"  holder pid {h.pid} ({safe(h.command)}): {safe(act)}")
    nodes = ", ".join(plan.nodes) or "none"
    out.append(f"  write {d.bdf} > {plan.unbind}")
    out.append(f"  wait until its DRM nodes are gone ({nodes})")
    out.append(f"  write {d.bdf} > {plan.bind}")
    out.append("  wait until its render node is back, then run doctor on it")
    out.append("  a pending crash dump (devcoredump) of the device is lost: save it first")
    if plan.refused and plan.hopeless is not None:
        out.append(f"refused: {safe(plan.refused)}")
    elif plan.refused:
        out.append(f"refused: {safe(plan.refused)}; stop them first, or --kill-holders")
    return out


def driver_write_line(op: str, bdf: str, driver: str, write: DriverWrite) -> str:
    """`unbind BDF from xe: done (written)`, `bind BDF to xe: not done (why)`."""
    way = "from" if op == "unbind" else "to"
    done = "done" if write.done else "not done"
    return f"{op} {bdf} {way} {driver}: {done} ({safe(write.detail)})"


def device_back_line(bdf: str, node: str) -> str:
    return f"{bdf} is back as {safe(node)}"


def collective_check_line(bdf: str) -> str:
    """reset --rebind --collective checks one device: no collective, a computation on it."""
    return f"checking {bdf}: an allocation and a computation on the card (--collective)"


def rebind_result_lines(bdf: str, out: Rebound) -> list[str]:
    """What is missing after the rebind, or that the device is back and clean."""
    if out.missing:
        return [f"missing: {safe(m)}" for m in out.missing]
    return [f"{bdf} is back and clean"]


def blocked_lines(scan: Scan) -> list[str]:
    """One line per read that did not answer within the bound (ps, devices, snapshot): which
    process, which file, and that nothing was judged on it."""
    out = []
    for u in scan.unreadable_processes:
        if not u.blocked:
            continue
        what = u.command or (f"[{u.comm}]" if u.comm else "command unknown")
        state = f", state {u.state}" if u.state else ""
        state += f" in {u.wchan}" if u.wchan and u.wchan != "0" else ""
        out.append(safe(f"pid {u.pid} ({what}{state}): {u.file} {u.reason}; "
                        "its role and what it holds are unknown", 400))
    for issue in scan.blocked:
        if not any(u.file == issue.source for u in scan.unreadable_processes):
            out.append(safe(f"{issue.source} {issue.reason}", 400))
    return out
