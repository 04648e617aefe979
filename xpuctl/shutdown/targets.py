"""The servers a shutdown names: their trees (top, members, devices, port, budget).

A tree is found from a scan (`tree_from_scan`: the top's vLLM processes) or from a run
record (`tree_from_record`: the recorded top while it is the same process, else whatever
carries the run id). `members` lists every live process of a tree at the moment of asking.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xpuctl.actions.signals import Target, target_of
from xpuctl.core.model import Process, Scan
from xpuctl.errors import NotFoundError
from xpuctl.host.processes import live_stats, same_process
from xpuctl.host.procfiles import read_cmdline
from xpuctl.host.scan import RUN_ID_VAR
from xpuctl.host.seam import Host
from xpuctl.output.safetext import safe
from xpuctl.parse.procfs import parse_environ
from xpuctl.parse.roles import API_SERVER, RAY
from xpuctl.parse.vllmargs import port_from_argv, server_reach, shutdown_timeout_from_argv
from xpuctl.state.runs import ACTIVE_STATES, RunRecord

if TYPE_CHECKING:  # types only: http.client is imported where a server is asked
    from xpuctl.host.http import Endpoint


@dataclass
class ServerTree:
    """One server (or orphaned remains of one) to stop."""

    top: Target
    role: str | None
    orphan: bool
    run_id: str | None = None
    session: int | None = None
    devices: tuple[str, ...] = ()
    port: int | None = None
    bind: str | None = None
    shutdown_timeout: int | None = None
    log_path: str | None = None
    record: RunRecord | None = None
    known: list[Target] = field(default_factory=list)
    never_ready: bool = False  # still starting: nothing to drain (ladder.exit_budget)
    #: how the drain watch reaches its /metrics (TLS, a unix socket): from its own options,
    #: never a key (/metrics is open)
    endpoint: Endpoint | None = None

    def reach(self) -> Endpoint | None:
        """The endpoint of the drain watch: its own, else plain HTTP on its port."""
        from xpuctl.host import http

        if self.endpoint is not None:
            return self.endpoint
        return http.endpoint(self.bind, self.port) if self.port else None

    @property
    def name(self) -> str:
        return self.record.name if self.record else f"pid {self.top.pid}"


def tree_from_scan(scan: Scan, top_pid: int, host: Host) -> ServerTree | None:
    top = scan.process(top_pid)
    target = target_of(host, top_pid, top.role or "" if top else "")
    if target is None or top is None:
        return None
    members = [p for p in scan.processes if (p.top or p.pid) == top_pid and not p.is_zombie]
    port, bind = port_from_argv(top.cmdline) if top.role == API_SERVER else (None, None)
    if top.role == API_SERVER and port is None:
        port = 8000
    known = [t for t in (target_of(host, p.pid, p.role or "") for p in members) if t]
    return ServerTree(
        top=target,
        role=top.role,
        orphan=top.orphan or top.role != API_SERVER,
        run_id=top.proven_run,  # a tag alone ties nothing to the tree (ladder.members)
        session=top.session if top.session == top.pid else None,
        devices=tuple(sorted({b for p in members for b in p.devices})),
        port=port,
        bind=bind,
        shutdown_timeout=shutdown_timeout_from_argv(top.cmdline) if top.role == API_SERVER else None,
        known=known,
        endpoint=_endpoint(top) if top.role == API_SERVER else None,
    )


def _endpoint(top: Process) -> Endpoint:
    """How an API server is reached, from its own command line (TLS, a unix socket)."""
    from xpuctl.host import http

    return http.reach_endpoint(server_reach(top.cmdline))


def tree_from_record(rec: RunRecord, scan: Scan, host: Host) -> ServerTree | None:
    """A recorded run: its top if still the same process, else whatever carries its run id."""
    tree = None
    if rec.pid and rec.start_ticks is not None:
        p = scan.process(rec.pid)
        if p is not None and p.start_ticks == rec.start_ticks:
            tree = tree_from_scan(scan, rec.pid, host)
        if tree is None:
            # the recorded top is what xpuctl launched: trust the record over argv shapes
            t = target_of(host, rec.pid, "api-server", rec.start_ticks)
            if t is not None:
                tree = ServerTree(top=t, role=API_SERVER, orphan=False, known=[t])
    if tree is None:
        # what is left of it carries its id, and is younger than its recorded top
        tagged = [p for p in scan.processes if p.run_id == rec.run_id and not p.is_zombie
                  and p.embedded_in is None
                  and (rec.start_ticks is None or p.start_ticks >= rec.start_ticks)]
        if not tagged:
            return None
        tops = sorted({p.top or p.pid for p in tagged})
        tree = tree_from_scan(scan, tops[0], host)
        if tree is None:
            return None
    apply_record(tree, rec)
    return tree


def apply_record(tree: ServerTree, rec: RunRecord) -> None:
    """What the record says of its run wins over what the scan guessed."""
    tree.record = rec
    tree.run_id = rec.run_id
    tree.session = rec.session
    # the devices the run claimed (its lock); another holder elsewhere is not its leftover
    tree.devices = tuple(sorted(rec.devices)) if rec.devices else tree.devices
    tree.port = rec.port
    tree.bind = rec.bind
    tree.shutdown_timeout = rec.shutdown_timeout
    tree.log_path = rec.log_path
    tree.never_ready = rec.state == "starting"


def members(host: Host, tree: ServerTree) -> list[Target]:
    """Every live process of the tree (but this one): known ones, descendants, its session,
    its run id. The whole pass is one call to the host's reader.

    Only /proc/<pid>/stat is read for every process. The environ (for the run id) is read
    only for processes started since the run began, and the cmdline only for members (as a
    label): both reads take the target's mmap lock, which a process stuck in the kernel
    can hold for good, and an unrelated stuck process must not hang a shutdown."""
    found: list[Target] = host.call(_members, tree, os.getpid())
    return found


def _members(host: Host, tree: ServerTree, me: int) -> list[Target]:
    stats = live_stats(host)  # in the reader already: read here
    chosen: set[int] = {t.pid for t in tree.known if t.pid in stats}
    if tree.top.pid in stats:
        chosen.add(tree.top.pid)
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(st.ppid, []).append(pid)
        if tree.session and st.session == tree.session:
            chosen.add(pid)
    if tree.run_id:
        needle = f"{RUN_ID_VAR}={tree.run_id}".encode()
        since = _run_start_ticks(tree)
        for pid, st in stats.items():
            if pid in chosen or st.start_ticks < since:
                continue  # a process older than the run cannot carry its id
            try:
                data = host.read_bytes(f"/proc/{pid}/environ")
            except OSError:
                continue
            if needle in data and parse_environ(data).get(RUN_ID_VAR) == tree.run_id:
                chosen.add(pid)
    stack = list(chosen)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in chosen:
                chosen.add(child)
                stack.append(child)
    chosen.discard(me)
    out = []
    for pid in sorted(chosen):
        argv = read_cmdline(host, pid)
        out.append(Target(pid, stats[pid].start_ticks, argv[0] if argv else stats[pid].comm))
    return out


def _run_start_ticks(tree: ServerTree) -> int:
    """The earliest start (clock ticks since boot) of what we know of the run."""
    ticks = [tree.top.start_ticks, *(t.start_ticks for t in tree.known)]
    if tree.record is not None and tree.record.start_ticks:
        ticks.append(tree.record.start_ticks)
    return min(ticks)


def topmost(host: Host, targets: list[Target]) -> list[Target]:
    """Targets whose parent is not among the targets (alive ones only): one call to the
    host's reader."""
    found: list[Target] = host.call(_topmost, targets)
    return found


def _topmost(host: Host, targets: list[Target]) -> list[Target]:
    pids = {t.pid for t in targets}
    out = []
    for t in targets:
        st = same_process(host, t.pid, t.start_ticks)
        if st is not None and st.ppid not in pids:
            out.append(t)
    return out


def _named_run(host: Host, scan: Scan, records: list[RunRecord], name: str,
               all_: bool) -> ServerTree | None:
    """The run NAME's tree; NotFoundError when there is no such run, or (without --all) it
    has no live process."""
    rec = next((r for r in records if r.name == name), None)
    if rec is None:
        known = f"; known runs: {', '.join(r.name for r in records)}" if records else ""
        raise NotFoundError(f"no run named {name!r}{known}")
    tree = tree_from_record(rec, scan, host)
    if tree is None and not all_:
        from xpuctl.state.live import is_stale

        if is_stale(host, rec):  # nothing of the run lives: the record was never told
            raise NotFoundError(f"run {name!r} is gone: its record is stale (it says "
                                f"{rec.state}, but no process of the run is alive)")
        raise NotFoundError(f"run {name!r} has no live process (state: {rec.state})")
    return tree


def _not_ours(scan: Scan, p: Process) -> bool:
    """Never a tree of this host's: a Ray cluster's own process, or a vLLM Ray actor whose
    live driver runs on another host (its run is stopped there)."""
    top = scan.process(p.top or p.pid) or p
    if top.role == RAY:
        return True
    return p.ray is not None and not p.orphan and (p.top or p.pid) == p.pid


def _tied_tops(scan: Scan, bdfs: tuple[str, ...]) -> set[int]:
    """The tops of the trees tied to the devices: one of its processes holds one, or its
    ZE_AFFINITY_MASK or proven run's record names it."""
    wanted = set(bdfs)
    return {p.top or p.pid for p in scan.processes
            if p.role and not p.is_zombie and p.tied & wanted}


def _nothing_holds(scan: Scan, devices: str, tops: set[int]) -> str:
    """`no vLLM process holds D`, or, when only embedded vLLM does, `no vLLM server holds D:
    vLLM embedded in pid 4242 (python batch.py) does, which is no server: stop that process
    itself`."""
    for p in scan.processes:
        if (p.top or p.pid) in tops and p.embedded_in is not None:
            return (f"no vLLM server holds {devices}: {safe(p.embedded_in.describe(80))} "
                    "does, which is no server: stop that process itself")
    return f"no vLLM process holds {devices}"


def _named_tops(scan: Scan, pid: int | None, port: int | None, device_bdfs: tuple[str, ...],
                all_: bool) -> list[int]:
    """The top pids of the servers --pid, --port, --device and --all name, in that order;
    NotFoundError when one of them names nothing. vLLM embedded in a live process (run as a
    library) is never a server --device or --all names: it belongs to that process."""
    tops: list[int] = []
    if pid is not None:
        p = scan.process(pid)
        if p is None or p.role is None:
            raise NotFoundError(f"pid {pid} is not a vLLM process; xpuctl stops only vLLM servers")
        if p.is_zombie:
            raise NotFoundError(f"pid {pid} is a zombie: it holds nothing and cannot be stopped")
        tops.append(p.top or p.pid)
    if port is not None:
        listening = [scan.process(pt.pid) for pt in scan.ports if pt.port == port and pt.pid]
        found = sorted({pr.top or pr.pid for pr in listening if pr and pr.role})
        if not found:
            raise NotFoundError(f"no vLLM server listens on port {port}")
        tops += found
    embedded = {p.top or p.pid for p in scan.processes if p.embedded_in is not None}
    if device_bdfs:
        tied = _tied_tops(scan, device_bdfs)
        found = sorted(tied - embedded)
        if not found and not all_:
            raise NotFoundError(_nothing_holds(scan, ", ".join(device_bdfs), tied))
        tops += found
    elif all_:
        tops += sorted({p.top or p.pid for p in scan.processes if p.role and not p.is_zombie
                        and not _not_ours(scan, p)} - embedded)
    return tops


def find_trees(
    host: Host,
    scan: Scan,
    records: list[RunRecord],
    name: str | None = None,
    pid: int | None = None,
    port: int | None = None,
    device_bdfs: tuple[str, ...] = (),
    all_: bool = False,
) -> list[ServerTree]:
    """The servers a shutdown request names. NotFoundError (exit 3) when it names nothing."""
    trees: dict[int, ServerTree] = {}

    def add(tree: ServerTree | None) -> None:
        if tree is not None and tree.top.pid not in trees:
            trees[tree.top.pid] = tree

    def record_for(top_pid: int, run_id: str | None) -> RunRecord | None:
        for rec in records:
            if rec.pid == top_pid or (run_id and rec.run_id == run_id):
                return rec
        return None

    if name is not None:
        add(_named_run(host, scan, records, name, all_))
    for top_pid in _named_tops(scan, pid, port, device_bdfs, all_):
        p = scan.process(top_pid)
        rec = record_for(top_pid, p.run_id if p else None)
        tree = tree_from_record(rec, scan, host) if rec else None
        if tree is not None and tree.top.pid != top_pid:
            tree = None  # the record's run is another tree: a tag alone ties nothing to it
        add(tree or tree_from_scan(scan, top_pid, host))
    if all_:
        for rec in records:
            if rec.state in ACTIVE_STATES:
                tree = tree_from_record(rec, scan, host)
                # with --device, --all is every run tied to those devices
                if tree is not None and (not device_bdfs or set(tree.devices) & set(device_bdfs)):
                    add(tree)
    return list(trees.values())
