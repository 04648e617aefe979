"""`xpuctl reset --device N --rebind`: the kernel's recovery of a wedged device
(DRM_WEDGE_RECOVERY_REBIND), made safe.

plan (the device, its BDF and driver, the two writes) → refuse while anything holds the
device (unless --kill-holders stops what the reset rules allow) → confirm → write unbind →
wait (bounded) until its DRM nodes are gone → write bind → wait (bounded) until its render
node is back → doctor on that device. Exit 0 when it is back and clean, 1 with what is
missing. Only xe and i915 devices are rebound; under `--root` the writes go below the root.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from xpuctl.actions.driverbind import Write, driver_path, write_bdf
from xpuctl.core.model import Device, Report
from xpuctl.errors import ExitCode, UsageError
from xpuctl.host.devices import scan_devices
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host
from xpuctl.output.lines import event_line
from xpuctl.output.safetext import safe
from xpuctl.reset import find_holders
from xpuctl.shutdown.ladder import stop
from xpuctl.shutdown.targets import ServerTree, tree_from_scan
from xpuctl.state import audit

DRIVERS = ("xe", "i915")
POLL = 0.05


class Blocker(NamedTuple):
    pid: int
    command: str
    why_not: str | None  # None: --kill-holders stops it


class RebindPlan(NamedTuple):
    device: Device
    driver: str
    nodes: tuple[str, ...]  # its DRM nodes now (/dev/dri/...)
    holders: tuple[Blocker, ...]
    trees: tuple[ServerTree, ...]  # what --kill-holders stops first
    kill_holders: bool

    @property
    def refused(self) -> str | None:
        if self.device.survivability is not None:
            return (f"the device is in survivability mode ({self.device.survivability}): a "
                    "rebind cannot bring it back, only a firmware flash can (see `xpuctl "
                    "doctor`)")
        if not self.holders:
            return None
        if not self.kill_holders:
            return "held by " + ", ".join(f"pid {h.pid} ({h.command})" for h in self.holders)
        kept = [h for h in self.holders if h.why_not is not None]
        if kept:
            return "held by " + ", ".join(f"pid {h.pid} ({h.command}: {h.why_not})" for h in kept)
        return None


def make_plan(host: Host, bdfs: tuple[str, ...], kill_holders: bool) -> RebindPlan:
    if len(bdfs) != 1:
        raise UsageError("--rebind needs exactly one --device")
    if host.live and os.geteuid() != 0:
        raise UsageError("--rebind needs root (it writes the driver's unbind and bind files)")
    scan = take_scan(host, port=None, want_env=False, artifacts=False)
    dev = scan.device(bdfs[0])
    if dev is None:
        raise UsageError(f"device {bdfs[0]} is not visible")
    if dev.driver not in DRIVERS:
        raise UsageError(f"device {dev.bdf} has driver {dev.driver or 'none'}: --rebind "
                         f"rebinds {' and '.join(DRIVERS)} devices only")
    bdf = dev.bdf
    pids = sorted(set(scan.holders(bdf)) | set(scan.unknown_holders(bdf)))
    allowed = {h.pid: h for h in find_holders(host, scan, {bdf})}
    blockers: list[Blocker] = []
    trees: list[ServerTree] = []
    tops: set[int] = set()
    for pid in pids:
        p = scan.process(pid)
        command = p.command if p is not None else "?"
        if p is not None and p.role is not None:  # vLLM: only an orphaned tree may be stopped
            if p.embedded_in is not None:
                blockers.append(Blocker(pid, command, f"{p.embedded_in.describe()}: stop that "
                                        "process itself"))
                continue
            if not p.orphan:
                blockers.append(Blocker(pid, command, "a live vLLM server: use xpuctl shutdown"))
                continue
            blockers.append(Blocker(pid, command, None))
            tops.add(p.top or pid)
            continue
        h = allowed.get(pid)
        if h is None:
            blockers.append(Blocker(pid, command, "it did not answer: what it holds is unknown"))
            continue
        blockers.append(Blocker(pid, command, h.why_not))
        if h.why_not is None and h.tree is not None:
            trees.append(h.tree)
    for top in sorted(tops):
        tree = tree_from_scan(scan, top, host)
        if tree is not None:
            tree.orphan = True
            trees.append(tree)
    return RebindPlan(dev, dev.driver, dev.nodes, tuple(blockers), tuple(trees), kill_holders)


def plan_lines(plan: RebindPlan) -> list[str]:
    d = plan.device
    name = f"device {d.index if d.index is not None else '-'} ({d.bdf}, driver {plan.driver})"
    out = [f"rebind {name}:"]
    for h in plan.holders:
        act = "stop first" if plan.kill_holders and h.why_not is None else (h.why_not or "holds it")
        out.append(f"  holder pid {h.pid} ({safe(h.command)}): {safe(act)}")
    nodes = ", ".join(plan.nodes) or "none"
    out.append(f"  write {d.bdf} > {driver_path(plan.driver, 'unbind')}")
    out.append(f"  wait until its DRM nodes are gone ({nodes})")
    out.append(f"  write {d.bdf} > {driver_path(plan.driver, 'bind')}")
    out.append("  wait until its render node is back, then run doctor on it")
    out.append("  a pending crash dump (devcoredump) of the device is lost: save it first")
    if plan.refused and plan.device.survivability is not None:
        out.append(f"refused: {safe(plan.refused)}")
    elif plan.refused:
        out.append(f"refused: {safe(plan.refused)}; stop them first, or --kill-holders")
    return out


def plan_dict(plan: RebindPlan) -> dict[str, Any]:
    d = plan.device
    return {
        "device": d.index, "bdf": d.bdf, "driver": plan.driver, "nodes": list(plan.nodes),
        "writes": [{"path": driver_path(plan.driver, op), "value": d.bdf} for op in ("unbind", "bind")],
        "holders": [{"pid": h.pid, "command": h.command, "stoppable": h.why_not is None,
                     "why_not": h.why_not} for h in plan.holders],
        "refused": plan.refused,
    }


class RebindOutcome(NamedTuple):
    writes: tuple[Write, ...]
    gone: bool  # the nodes went after the unbind
    back: str | None  # its render node after the bind
    missing: tuple[str, ...]  # what is not as it should be
    after: Report | None


def _nodes_left(host: Host, plan: RebindPlan) -> list[str]:
    return [n for n in plan.nodes if host.exists(f"/sys/class/drm/{n.rsplit('/', 1)[-1]}")]


def _render_node(host: Host, bdf: str) -> str | None:
    devices, _ = scan_devices(host)
    return next((d.render_node for d in devices if d.bdf == bdf and d.render_node), None)


def _until(pred: Callable[[], Any], seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(POLL)


def execute(host: Host, plan: RebindPlan, bind_timeout: float, kill_after: float,
            timeout: float | None, say: Callable[[str], None], collective: float | None = None,
            environ: dict[str, str] | None = None) -> RebindOutcome:
    """`collective`: also run the collective check on the device once it is back (its timeout)."""
    from xpuctl.doctor import CollectiveOptions, diagnose

    bdf = plan.device.bdf
    missing: list[str] = []
    if plan.trees:
        stop(host, list(plan.trees), timeout=timeout, kill_after=kill_after, release_timeout=10.0,
             on_event=lambda ev: say(event_line(ev)))
        scan = take_scan(host, port=None, want_env=False, artifacts=False)
        still = sorted(set(scan.holders(bdf)) | set(scan.unknown_holders(bdf)))
        if still:
            return RebindOutcome((), False, None, (
                f"still held by pid(s) {', '.join(map(str, still))}: not unbound",), None)
    unbind = write_bdf(host, plan.driver, "unbind", bdf, bind_timeout)
    say(f"unbind {bdf} from {plan.driver}: {'done' if unbind.done else 'not done'} ({safe(unbind.detail)})")
    if not unbind.done:
        return RebindOutcome((unbind,), False, None, (f"unbind: {unbind.detail}",), None)
    _until(lambda: not _nodes_left(host, plan), bind_timeout)
    left = _nodes_left(host, plan)
    gone = not left
    if left:
        missing.append(f"DRM node(s) {', '.join(left)} still there {bind_timeout:g} s after the unbind")
    bind = write_bdf(host, plan.driver, "bind", bdf, bind_timeout)
    say(f"bind {bdf} to {plan.driver}: {'done' if bind.done else 'not done'} ({safe(bind.detail)})")
    if not bind.done:
        missing.append(f"bind: {bind.detail}")
        return RebindOutcome((unbind, bind), gone, None, tuple(missing), None)
    back = _until(lambda: _render_node(host, bdf), bind_timeout)
    if not back:
        missing.append(f"no render node for {bdf} {bind_timeout:g} s after the bind")
        return RebindOutcome((unbind, bind), gone, None, tuple(missing), None)
    say(f"{bdf} is back as {back}")
    if collective is not None:
        say(f"checking {bdf}: oneCCL init, one all_reduce and destroy (--collective)")
    after = diagnose(host, devices=[bdf], caller_env=environ,
                     collective=CollectiveOptions(collective) if collective is not None else None)
    missing.extend(f"{f.check}: {f.message}" for f in after.findings if f.severity == "fail")
    return RebindOutcome((unbind, bind), gone, back, tuple(missing), after)


def outcome_dict(out: RebindOutcome) -> dict[str, Any]:
    from xpuctl.output.documents import finding_dict

    return {
        "writes": [{"path": w.path, "done": w.done, "detail": w.detail} for w in out.writes],
        "nodes_gone": out.gone, "render_node": out.back, "missing": list(out.missing),
        "status": out.after.status if out.after else None,
        "findings": [finding_dict(f) for f in out.after.findings] if out.after else [],
    }


def run(host: Host, bdfs: tuple[str, ...], *, dry_run: bool, yes: bool, kill_holders: bool,
        kill_after: float, timeout: float | None, bind_timeout: float, collective: float | None,
        state_dir: str | None,
        environ: dict[str, str], as_json: bool, say: Callable[[str], None],
        confirm: Callable[[], bool], write_json: Callable[[dict[str, Any]], object]) -> int:
    """The whole `reset --rebind`; returns the exit code."""
    from xpuctl.output import lines
    from xpuctl.state.statedir import resolve_state_dir

    plan = make_plan(host, bdfs, kill_holders)
    doc: dict[str, Any] = {"schema": "xpuctl.reset/1", "dry_run": dry_run, "rebind": plan_dict(plan)}
    if not as_json:
        for line in plan_lines(plan):
            say(line)
    if dry_run or plan.refused:
        if as_json:
            write_json(doc)
        return int(ExitCode.PROBLEMS if plan.refused and not dry_run else ExitCode.OK)
    if not yes and not confirm():
        return int(ExitCode.PROBLEMS)  # a "no": nothing was changed
    with audit.recording(resolve_state_dir(host, state_dir, environ), "reset") as log:
        out = execute(host, plan, bind_timeout, kill_after, timeout, say, collective, environ)
    warning = lines.audit_warning(log)
    if warning:
        say(warning)
    if as_json:
        write_json({**doc, **outcome_dict(out), "audit": log.summary()})
    else:
        for m in out.missing:
            say(f"missing: {safe(m)}")
        if not out.missing:
            say(f"{plan.device.bdf} is back and clean")
    return int(ExitCode.PROBLEMS if out.missing else ExitCode.OK)
