"""The sweep behind `xpuctl reset` (the command is cli/reset.py): plan → confirm → clean
leftovers (orphans, stale files) → verify.

`run` is the command's flow (the CLI parses, calls it once, renders, maps the exit code):
`make_plan`, the plan told to the caller, its approval (the prompt), `execute` inside the
audit log, each of its steps told as a record (`Told`) the CLI renders.

Live servers are never touched (use `xpuctl shutdown`). A device reset (PCI function reset
through sysfs) is a last resort: root only, one named device, and only when nothing holds it.

Orphans: only trees whose launcher is gone (core/trees); vLLM embedded in a live process
(run as a library) is never planned. With `--device`, only the orphaned trees tied to those
devices (held, or named by ZE_AFFINITY_MASK), and only the files of the orphans it stops: a
stale file whose process is gone is tied to no device, and is kept (docs/safety.md).

Holders: processes that are not vLLM but hold a target device (all Intel GPUs, or the
`--device` ones) are always listed. With `--kill-holders` they are stopped through the same
ladder as orphans (SIGTERM, wait, SIGTERM survivors, SIGKILL), their descendants with them;
never a process of a live server (under it, above it, or whose run id a live run's record
proves), nor the launcher of embedded vLLM, nor xpuctl itself or one of its ancestors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from xpuctl import pausepoint
from xpuctl.actions.cleanup import Removal, may_delete, removable, remove
from xpuctl.actions.signals import can_signal, target_of
from xpuctl.core.checks import Options, evaluate
from xpuctl.core.model import EMPTY_ENV, Artifact, Finding, Process, Report, Scan
from xpuctl.core.runrecords import RecordedRun
from xpuctl.errors import UsageError
from xpuctl.host.processes import live_stats
from xpuctl.host.scan import DEFAULT_PORT, take_scan
from xpuctl.host.seam import Host
from xpuctl.shutdown.ladder import Event, StopResult, skipped_lines, stop
from xpuctl.shutdown.targets import ServerTree, tree_from_scan
from xpuctl.state import audit


class Holder(NamedTuple):
    """A process that holds a target device and is not vLLM."""

    pid: int
    command: str
    devices: tuple[str, ...]
    why_not: str | None  # why it may not be stopped; None: --kill-holders stops it
    tree: ServerTree | None  # what the ladder stops (the holder and its descendants)


@dataclass
class Plan:
    orphan_trees: list[ServerTree]
    orphan_pids: list[int]
    files: list[Artifact]
    pending_files: list[Artifact]  # held only by orphans: removed if stale once they stop
    skipped_files: list[tuple[Artifact, str]]
    device_reset: list[str]
    notes: list[str] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)  # always listed
    kill_holders: bool = False
    runs: tuple[RecordedRun, ...] = ()  # the live runs' records it was planned with

    @property
    def holder_trees(self) -> list[ServerTree]:
        """The holders this reset stops: only with --kill-holders, only the allowed ones."""
        if not self.kill_holders:
            return []
        return [h.tree for h in self.holders if h.why_not is None and h.tree is not None]

    @property
    def empty(self) -> bool:
        return not (self.orphan_trees or self.files or self.pending_files or self.device_reset
                    or self.holder_trees)


def _parents(host: Host) -> dict[int, int]:
    """pid → ppid of every live process (one pass over /proc/*/stat, one call to the reader)."""
    return {pid: st.ppid for pid, st in live_stats(host).items()}


def _ancestry(parents: dict[int, int], pid: int) -> list[int]:
    chain, seen = [], {pid}
    cur = parents.get(pid, 0)
    while cur > 0 and cur not in seen:
        chain.append(cur)
        seen.add(cur)
        cur = parents.get(cur, 0)
    return chain


def find_holders(host: Host, scan: Scan, wanted: set[str]) -> list[Holder]:
    """Non-vLLM processes holding a target device, each with whether it may be stopped."""
    targets = wanted or {d.bdf for d in scan.devices if d.is_intel}
    held = [p for p in scan.processes
            if p.role is None and not p.is_zombie and targets & set(p.devices)]
    if not held:
        return []
    foreign = not can_signal(host)
    serving = {p.pid for p in scan.processes if p.role is not None and not p.orphan and not p.is_zombie}
    launchers = {p.embedded_in.pid for p in scan.processes
                 if p.embedded_in is not None and not p.is_zombie}
    parents = _parents(host) if not foreign else {}
    mine = {os.getpid(), *_ancestry(parents, os.getpid())} if not foreign else set()
    out = []
    for p in held:
        why = ("this root's /proc is not the live one" if foreign
               else _why_not(p, parents, serving, launchers, mine))
        if why is None and p.cmdline and p.cmdline[0].startswith("ray::"):
            # another Ray job's actor (or one Ray could not name): its job owns it, never reset
            why = "a Ray actor: stop it through its Ray job"
        if p.blocked:  # never signalled on the strength of a read that did not answer
            why = f"{p.blocked} did not answer: what it is, is unknown"
        tree = None
        if why is None:
            t = target_of(host, p.pid, p.cmdline[0] if p.cmdline else p.comm, p.start_ticks)
            if t is None:
                why = "already gone"
            else:
                tree = ServerTree(top=t, role=None, orphan=True,
                            devices=tuple(sorted(set(p.devices) & targets)), known=[t])
        out.append(Holder(p.pid, p.command, tuple(sorted(set(p.devices) & targets)), why, tree))
    return out


def _why_not(p: Process, parents: dict[int, int], serving: set[int], launchers: set[int],
             mine: set[int]) -> str | None:
    if p.pid in mine:
        return "xpuctl itself or one of its parents"
    if p.run_proven:  # its XPUCTL_RUN_ID is vouched for by a live run's record; a tag alone is not
        return "it belongs to a live xpuctl run"
    if p.pid in launchers:
        return "it runs vLLM as a library (the vLLM processes under it are its own)"
    if serving & set(_ancestry(parents, p.pid)):
        return "it runs under a live vLLM server"
    for pid in serving:
        if p.pid in _ancestry(parents, pid):
            return "a live vLLM server runs under it"
    return None


class DeviceReset(NamedTuple):
    """A PCI function reset of one device, done or not."""

    bdf: str
    done: bool
    detail: str


@dataclass
class Execution:
    """What `execute` did, and the check after it."""

    plan: Plan
    stopped: StopResult | None
    removed: list[Removal]
    device_reset: list[DeviceReset]
    after: Report


def _kept_only_by(a: Artifact, orphans: set[int]) -> bool:
    """Is this file kept from being stale only by the orphans this reset stops? Then it is
    planned for removal once they are gone (re-judged on a fresh scan first): files they
    hold open or mapped or have a socket bound to, vLLM's FileStore and oneCCL's files (kept
    while a vLLM or oneCCL process of its owner lives; nobody holds them open), and files
    named after one of them (a oneCCL socket, a libfabric region)."""
    return a.kind != "cache" and bool(a.kept_by) and set(a.kept_by) <= orphans


def _orphaned_trees(scan: Scan) -> dict[int, list[Process]]:
    """The orphans (none a zombie) by the top of their tree."""
    trees: dict[int, list[Process]] = {}
    for p in scan.processes:
        if p.orphan and not p.is_zombie:
            trees.setdefault(p.top or p.pid, []).append(p)
    return trees


def _in_scope(scan: Scan, wanted: set[str], notes: list[str]) -> dict[int, list[Process]]:
    """The orphaned trees `--device` names (all of them without it): a tree is tied to a
    device one of its processes holds, or its ZE_AFFINITY_MASK or proven run claims. One
    tied to no device at all is out of scope too: which device it was for is unknown."""
    trees = _orphaned_trees(scan)
    if not wanted:
        return trees
    shown = ", ".join(sorted(wanted))
    out: dict[int, list[Process]] = {}
    for top, procs in sorted(trees.items()):
        tied = frozenset().union(*(p.tied for p in procs))
        if tied & wanted:
            out[top] = procs
        elif tied:
            notes.append(f"skipped: orphaned vLLM tree {top} is tied to {', '.join(sorted(tied))}, "
                         f"not to {shown}")
        else:
            notes.append(f"skipped: orphaned vLLM tree {top} holds no device: which device it "
                         f"was for is unknown (reset without --device stops it)")
    return out


def _embedded_notes(scan: Scan, wanted: set[str]) -> list[str]:
    """vLLM run as a library, on the target devices: never stopped, and said so."""
    out: dict[int, str] = {}
    for p in scan.processes:
        e = p.embedded_in
        if e is None or p.is_zombie or (wanted and not p.tied & wanted):
            continue
        out.setdefault(p.top or p.pid, f"kept: vLLM tree {p.top or p.pid}: {e.describe(200)}: "
                                       + ("not judged" if e.blocked else "not an orphan"))
    return [out[k] for k in sorted(out)]


def make_plan(host: Host, bdfs: tuple[str, ...], port: int | None, device_reset: bool,
              environ: Mapping[str, str], kill_holders: bool = False,
              runs: tuple[RecordedRun, ...] = ()) -> Plan:
    """`environ`: the command's (where Ray is); `runs`: the live runs' records (what proves
    an XPUCTL_RUN_ID)."""
    from xpuctl.ray.actors import with_ray

    # Ray actors of an orphaned driver are orphans of its tree (Ray's state ties them)
    scan = with_ray(host, take_scan(host, port=port or DEFAULT_PORT, runs=runs), environ)
    wanted = set(bdfs)
    notes: list[str] = _embedded_notes(scan, wanted)
    scoped = _in_scope(scan, wanted, notes)
    trees: list[ServerTree] = []
    if scoped and not can_signal(host):
        notes.append("orphans found, but this root's /proc is not the live one: they cannot be stopped from here")
    elif scoped:
        for top in sorted(scoped):
            tree = tree_from_scan(scan, top, host)
            if tree is not None:
                tree.orphan = True
                trees.append(tree)
    orphan_pids = sorted(p.pid for procs in scoped.values() for p in procs)
    files = removable(scan)
    skipped = [(a, f"owned by uid {a.owner_uid}") for a in scan.artifacts if a.stale and not may_delete(a.owner_uid)]
    if wanted and (files or skipped):
        # A stale file's process is gone, and with it what it held: it is tied to no device.
        # With --device only the files of the orphans it stops go (`pending`, below).
        notes.append(f"kept: {len(files) + len(skipped)} stale file(s): a file whose process "
                     "is gone is tied to no device (reset without --device removes them)")
        files, skipped = [], []
    pending = [a for a in scan.artifacts
               if not a.stale and may_delete(a.owner_uid) and _kept_only_by(a, set(orphan_pids))]
    unjudged = [a for a in scan.artifacts if a.unseen and may_delete(a.owner_uid)]
    if unjudged:
        skipped += [(a, a.reason) for a in unjudged]
        notes.append(f"kept: {len(unjudged)} file(s) that {max(a.unseen for a in unjudged)} "
                     "process(es) could hold: they could not be inspected (run as root to judge "
                     "them)")
    stuck = scan.blocked_pids()
    if stuck and pending:
        notes.append(f"skipped: {len(pending)} file(s) held by the orphans are kept: pid(s) "
                     f"{', '.join(map(str, stuck))} did not answer and may use them")
        pending = []
    notes.extend(f"skipped: {line}" for line in skipped_lines(host))
    resets: list[str] = []
    if device_reset:
        if os.geteuid() != 0:
            raise UsageError("--device-reset needs root")
        if not host.live:
            raise UsageError("--device-reset works on the live host only (no --root)")
        if len(bdfs) != 1:
            raise UsageError("--device-reset needs exactly one --device")
        resets = list(bdfs)
    holders = find_holders(host, scan, wanted)
    return Plan(trees, orphan_pids, files, pending, skipped, resets, notes, holders, kill_holders,
                runs)


def execute(
    host: Host,
    plan: Plan,
    bdfs: tuple[str, ...],
    port: int | None,
    kill_after: float,
    timeout: float | None,
    tell: Callable[[Told], None],
) -> Execution:
    """Stop the orphans (and the holders --kill-holders may stop), remove the files, reset
    the device; each step told (`Told`) as it is done."""
    pausepoint.reached("reset-execute")
    stopped = None
    trees = plan.orphan_trees + plan.holder_trees
    if trees:
        stopped = stop(host, trees, timeout=timeout, kill_after=kill_after, release_timeout=10.0,
                       on_event=tell)
    pausepoint.reached("reset-removing")
    fresh = take_scan(host, port=port or DEFAULT_PORT, runs=plan.runs)
    removed = remove(host, plan.files + plan.pending_files, fresh)
    for r in removed:
        tell(r)
    resets: list[DeviceReset] = []
    for bdf in plan.device_reset:
        now = take_scan(host, port=None, want_env=False)
        holders = sorted(set(now.holders(bdf)) | set(now.unknown_holders(bdf)))
        if holders:
            resets.append(DeviceReset(bdf, False, f"still held by {', '.join(map(str, holders))}"))
            continue
        path = f"/sys/bus/pci/devices/{bdf}/reset"
        try:
            with open(host.path(path), "w") as fh:
                fh.write("1")
            resets.append(DeviceReset(bdf, True, "PCI function reset"))
        except OSError as exc:
            resets.append(DeviceReset(bdf, False, exc.strerror or str(exc)))
        audit.record("device-reset", {"bdf": bdf, "path": path},
                     "done" if resets[-1].done else f"not done: {resets[-1].detail}")
    for done in resets:
        tell(done)
    after = evaluate(
        take_scan(host, port=port or DEFAULT_PORT, runs=plan.runs),
        Options(devices=bdfs, port=port or DEFAULT_PORT, port_explicit=port is not None),
    )
    return Execution(plan, stopped, removed, resets, after)


# -- the flow: request → plan → approval → execution → outcome ------------------------------


class Request(NamedTuple):
    """What to clean and how (the command's arguments)."""

    devices: tuple[str, ...] = ()  # --device specs, resolved against the host
    port: int | None = None
    dry_run: bool = False
    timeout: float | None = None  # seconds to wait for orphans after SIGTERM
    kill_after: float = 10.0
    device_reset: bool = False
    kill_holders: bool = False
    environ: Mapping[str, str] = EMPTY_ENV  # the command's environment (where Ray is)


class Planned(NamedTuple):
    """The plan, told before anything is done (with the relaunch advice to show with it)."""

    plan: Plan
    advice: list[Finding]


#: What `run` tells as it goes: the plan, then the steps of its execution: the stop of the
#: orphans and holders (the ladder's steps), each file removed or kept, each device reset.
Told = Planned | Event | Removal | DeviceReset


@dataclass
class Outcome:
    plan: Plan
    advice: list[Finding]
    executed: Execution | None = None  # None: a dry run, an empty plan, or not approved
    audit: audit.Sink | None = None  # the execution's audit log

    @property
    def remaining(self) -> list[Finding]:
        """What still fails after the execution."""
        if self.executed is None:
            return []
        return [f for f in self.executed.after.findings if f.severity == "fail"]


def run(host: Host, request: Request, state_dir: str | None,
        on_event: Callable[[Told], None],
        approve: Callable[[Plan], bool] | None = None) -> Outcome:
    """Plan; tell it (`Planned`); unless it is a dry run or empty, ask `approve` (None: approved,
    --yes) and execute it with every signal and deletion in the audit log, telling each step
    (`Told`). `state_dir` (resolved) holds the audit log and the last run's record."""
    from xpuctl.core.checks import last_run_findings
    from xpuctl.host.devices import resolve_device_specs
    from xpuctl.state.lastrun import last_run
    from xpuctl.state.live import recorded_runs

    bdfs = resolve_device_specs(host, list(request.devices))
    plan = make_plan(host, bdfs, request.port, request.device_reset, request.environ,
                     request.kill_holders, recorded_runs(state_dir))
    advice = last_run_findings(last_run(state_dir))
    on_event(Planned(plan, advice))
    out = Outcome(plan, advice)
    if request.dry_run or (not plan.empty and approve is not None and not approve(plan)):
        return out
    if not plan.empty:
        with audit.recording(state_dir, "reset") as log:
            out.executed = execute(host, plan, bdfs, request.port, request.kill_after,
                                   request.timeout, on_event)
        out.audit = log
    _note_clean(state_dir, bdfs, out)
    return out


def _note_clean(state_dir: str | None, bdfs: tuple[str, ...], out: Outcome) -> None:
    """A reset that leaves its devices clean (nothing failing after it, or nothing to clean
    and no holder) proves them clean: an unclean end of the last run on them no longer asks
    serve for the collective check (state/lastrun.py). Every device when no --device."""
    from xpuctl.state.lastrun import note_clean

    clean = not out.remaining if out.executed is not None else not out.plan.holders
    if clean:
        note_clean(state_dir, bdfs or None, "reset")
