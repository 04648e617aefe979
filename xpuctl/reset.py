"""reset: plan → confirm → clean leftovers (orphans, stale files) → verify.

Live servers are never touched (use `xpuctl shutdown`). A device reset (PCI function reset
through sysfs) is a last resort: root only, one named device, and only when nothing holds it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from xpuctl.checks import Options, evaluate
from xpuctl.cleanup import Removal, may_delete, removable, remove
from xpuctl.errors import UsageError
from xpuctl.host import Host
from xpuctl.model import Artifact, Report
from xpuctl.safetext import safe
from xpuctl.scan import DEFAULT_PORT, take_snapshot
from xpuctl.stop import StopResult, Tree, stop, tree_from_snapshot
from xpuctl.supervisor import can_signal


@dataclass
class Plan:
    orphan_trees: list[Tree]
    orphan_pids: list[int]
    files: list[Artifact]
    pending_files: list[Artifact]  # held only by orphans: removed if stale once they stop
    skipped_files: list[tuple[Artifact, str]]
    device_reset: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.orphan_trees or self.files or self.pending_files or self.device_reset)


@dataclass
class Outcome:
    plan: Plan
    stopped: StopResult | None
    removed: list[Removal]
    device_reset: list[tuple[str, bool, str]]
    after: Report


def make_plan(host: Host, bdfs: tuple[str, ...], port: int | None, device_reset: bool) -> Plan:
    snap = take_snapshot(host, port=port or DEFAULT_PORT)
    wanted = set(bdfs)
    notes: list[str] = []
    orphans = [
        p for p in snap.processes
        if p.orphan and not p.is_zombie and (not wanted or not p.devices or wanted & set(p.devices))
    ]
    tops = sorted({p.top or p.pid for p in orphans})
    trees: list[Tree] = []
    if tops and not can_signal(host):
        notes.append("orphans found, but this root's /proc is not the live one: they cannot be stopped from here")
    elif tops:
        for top in tops:
            tree = tree_from_snapshot(snap, top, host)
            if tree is not None:
                tree.orphan = True
                trees.append(tree)
    orphan_pids = sorted(p.pid for p in orphans)
    files = removable(snap)
    skipped = [(a, f"owned by uid {a.owner_uid}") for a in snap.artifacts if a.stale and not may_delete(a.owner_uid)]
    pending = [
        a for a in snap.artifacts
        if not a.stale and a.kind != "cache" and a.open_by and set(a.open_by) <= set(orphan_pids)
        and may_delete(a.owner_uid)
    ]
    resets: list[str] = []
    if device_reset:
        if os.geteuid() != 0:
            raise UsageError("--device-reset needs root")
        if not host.live:
            raise UsageError("--device-reset works on the live host only (no --root)")
        if len(bdfs) != 1:
            raise UsageError("--device-reset needs exactly one --device")
        resets = list(bdfs)
    return Plan(trees, orphan_pids, files, pending, skipped, resets, notes)


def execute(
    host: Host,
    plan: Plan,
    bdfs: tuple[str, ...],
    port: int | None,
    kill_after: float,
    timeout: float | None,
    say: Callable[[str], None],
) -> Outcome:
    stopped = None
    if plan.orphan_trees:
        stopped = stop(
            host, plan.orphan_trees, timeout=timeout, kill_after=kill_after, release_timeout=10.0,
            on_event=lambda ev: say(f"{ev.t:7.2f}s  {ev.phase:<18} {safe(ev.detail)}"),
        )
    fresh = take_snapshot(host, port=port or DEFAULT_PORT)
    removed = remove(host, plan.files + plan.pending_files, fresh)
    for r in removed:
        if r.removed:
            say(f"removed {safe(r.path)} ({r.kind}, {r.size_bytes} bytes)")
        elif r.reason != "already gone":
            say(f"kept {safe(r.path)}: {safe(r.reason)}")
    resets: list[tuple[str, bool, str]] = []
    for bdf in plan.device_reset:
        holders = take_snapshot(host, port=None, want_env=False).holders(bdf)
        if holders:
            resets.append((bdf, False, f"still held by {', '.join(map(str, holders))}"))
            continue
        path = f"/sys/bus/pci/devices/{bdf}/reset"
        try:
            with open(host.path(path), "w") as fh:
                fh.write("1")
            resets.append((bdf, True, "PCI function reset"))
        except OSError as exc:
            resets.append((bdf, False, exc.strerror or str(exc)))
    for bdf, ok, why in resets:
        say(f"device reset {safe(bdf)}: {'done' if ok else 'not done'} ({safe(why)})")
    after = evaluate(
        take_snapshot(host, port=port or DEFAULT_PORT),
        Options(devices=bdfs, port=port or DEFAULT_PORT, port_explicit=port is not None),
    )
    return Outcome(plan, stopped, removed, resets, after)
