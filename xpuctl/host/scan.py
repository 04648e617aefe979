"""host → probes → Scan: one scan of everything doctor, ps and shutdown look at."""

from __future__ import annotations

from collections.abc import Callable

from xpuctl.core.model import (
    Device,
    DmabufHold,
    DrmClient,
    Issue,
    Launcher,
    Process,
    Scan,
    Unreadable,
)
from xpuctl.core.runrecords import RecordedRun
from xpuctl.core.trees import Member, Placement
from xpuctl.host.adoption import ending_supervisors, runs_vllm
from xpuctl.host.adoption import place as place_trees
from xpuctl.host.artifacts import judge_files
from xpuctl.host.containers import ContainerLookup
from xpuctl.host.devices import scan_devices
from xpuctl.host.drm import dmabufs_held, drm_clients
from xpuctl.host.ports import ports_of
from xpuctl.host.processes import (
    FdTable,
    RawProcess,
    facts_of,
    fill_cmdline,
    own_pids,
    scan_processes,
    stat_of,
)
from xpuctl.host.procfiles import read_optional
from xpuctl.host.reads.protocol import BlockedRead
from xpuctl.host.seam import Host
from xpuctl.parse.envvars import mask_indices
from xpuctl.parse.procfs import (
    ProcStat,
    parse_boot_time,
    shown_command,
)
from xpuctl.parse.roles import API_SERVER, RAY

RUN_ID_VAR = "XPUCTL_RUN_ID"
DEFAULT_PORT = 8000


def _pass(host: Host, skip: frozenset[int], files: bool, env: bool) -> tuple[float, FdTable]:
    """(when it was taken, the pass over /proc)."""
    return host.now(), scan_processes(host, skip, files=files, env=env)


class _Lazy:
    """Host reads that only some scans need: done once, on first use."""

    def __init__(self, host: Host, fds: FdTable) -> None:
        self.host = host
        self.fds = fds
        self._boot: float | bool | None = False

    def boot_time(self) -> float | None:
        if self._boot is False:
            try:
                self._boot = parse_boot_time(self.host.read_text("/proc/stat", 1 << 20))
            except OSError:
                self._boot = None
        return self._boot

    def start_time(self, pid: int) -> float | None:
        """When a process of the pass started (None: unknown)."""
        boot = self.boot_time()
        raw = self.fds.procs.get(pid)
        if boot is None or raw is None:
            return None
        return boot + raw.stat.start_ticks / self.host.clk_tck


def _tag_run_leaders(fds: FdTable, runs: tuple[RecordedRun, ...]) -> None:
    """The process `xpuctl serve` launched (its record names its pid and start ticks) is the
    top of that vLLM run even when its argv is not one we recognise (a wrapper script). A
    session leader that merely carries XPUCTL_RUN_ID is not: anyone can set a variable."""
    for r in runs:
        proc = fds.procs.get(r.pid) if r.pid else None
        if (proc is not None and proc.role is None and proc.stat.state != "Z"
                and proc.stat.start_ticks == r.start_ticks):
            proc.role = API_SERVER


def _anchors(fds: FdTable, runs: tuple[RecordedRun, ...]) -> dict[int, str]:
    """pid -> run id of the processes live runs' records name. A run is live while its
    recorded top is the same process (pid and start ticks); then its supervisor is one too,
    while it lives (a process alive since before the top started, at the recorded
    supervisor's pid, is that supervisor: a pid names one process at a time). Once the top
    is gone the run is ending, and what is left of it is judged like any other process."""
    out: dict[int, str] = {}
    for r in runs:
        top = fds.procs.get(r.pid) if r.pid else None
        if (top is None or r.start_ticks is None or top.stat.state == "Z"
                or top.stat.start_ticks != r.start_ticks):
            continue
        out[top.pid] = r.run_id
        sup = fds.procs.get(r.supervisor_pid) if r.supervisor_pid else None
        if sup is not None and sup.stat.state != "Z" and sup.stat.start_ticks <= r.start_ticks:
            out.setdefault(sup.pid, r.run_id)
    # a run whose top is gone while its supervisor lives is being stopped by it: what it left
    # is still its own (core/trees, `ending`)
    for sup_pid, r in ending_supervisors(fds, runs).items():
        out.setdefault(sup_pid, r.run_id)
    return out


def _proven(fds: FdTable, tags: dict[int, str], runs: tuple[RecordedRun, ...]) -> set[int]:
    """The tagged processes whose XPUCTL_RUN_ID a live run's record vouches for: the
    recorded process itself, or a descendant of it or of its supervisor (a process that left
    the run's tree is reparented to the supervisor, a subreaper: still its descendant)."""
    anchors = _anchors(fds, runs) if tags else {}
    out: set[int] = set()
    for pid, tag in tags.items():
        cur, seen = pid, set()
        while cur > 0 and cur not in seen:
            if anchors.get(cur) == tag:
                out.add(pid)
                break
            seen.add(cur)
            raw = fds.procs.get(cur)
            cur = raw.stat.ppid if raw is not None else 0
    return out


def _claims(env: dict[str, str] | None, run: RecordedRun | None,
            devices: list[Device]) -> tuple[str, ...]:
    """The devices a process is tied to without holding them: those its ZE_AFFINITY_MASK
    names (Level Zero indices), and those its proven run's record claimed."""
    out = set(run.devices) if run is not None else set()
    mask = (env or {}).get("ZE_AFFINITY_MASK")
    indices = mask_indices(mask) if mask is not None else None
    if indices:
        out.update(d.bdf for d in devices if d.index is not None and d.index in indices)
    return tuple(sorted(out))


def _stuck(host: Host, fds: FdTable) -> dict[int, BlockedRead]:
    """pid -> the first of its files that did not answer (host/reads/)."""
    stuck: dict[int, BlockedRead] = {}
    for b in host.blocked_reads():
        if b.pid is not None:
            stuck.setdefault(b.pid, b)
    if stuck:
        fds.malformed[:] = [pid for pid in fds.malformed if pid not in stuck]
    return stuck


def _wchan(host: Host, pid: int) -> str | None:
    w = read_optional(host, f"/proc/{pid}/wchan", 256)
    return (w.decode("ascii", "replace").strip() or None) if w else None


def _unreadable(host: Host, fds: FdTable, stuck: dict[int, BlockedRead]) -> list[Unreadable]:
    """The processes that did not answer a read, then those whose fds we may not read."""
    out = []
    for pid, b in sorted(stuck.items()):
        raw = fds.procs.get(pid)
        st = raw.stat if raw is not None else None
        argv = raw.cmdline if raw is not None else None
        out.append(Unreadable(
            pid, shown_command(argv, raw.cmdline_bytes) if raw and argv else None,
            st.comm if st else None,
            st.state if st else None, _wchan(host, pid), b.path, b.reason, True,
            raw is not None and raw.fds_readable and pid not in fds.unreadable))
    for pid in sorted(set(fds.unreadable) - set(stuck)):
        raw = fds.procs.get(pid)
        st = raw.stat if raw is not None else None
        out.append(Unreadable(pid, shown_command(raw.cmdline, raw.cmdline_bytes)
                              if raw and raw.cmdline else None,
                              st.comm if st else None, st.state if st else None, None,
                              f"/proc/{pid}/fd", "its open files could not be listed", False,
                              False))
    return out


def _unreadable_fds(host: Host, pids: list[int]) -> Issue:
    """The processes whose fds could not be read. Not root: others' processes, and running
    as root is the remedy. Root refused too (Yama's ptrace_scope 3, an LSM, a process of
    another user namespace, or PID 1 of some sandboxes): nothing xpuctl can do, and what they
    may hold is kept, never judged (docs/safety.md)."""
    reason = f"could not read the fds of {len(pids)} process(es)"
    if not host.inspected_as_root:
        return Issue("/proc", reason)
    shown = ", ".join(map(str, sorted(pids)[:8])) + (", ..." if len(pids) > 8 else "")
    return Issue("/proc", f"{reason} even as root (pids {shown})",
                 "the kernel refuses them even to root (ptrace restrictions: Yama's "
                 "ptrace_scope, an LSM, another user namespace); what they may hold is kept, "
                 "never judged")


def take_scan(
    host: Host,
    port: int | None = DEFAULT_PORT,
    want_env: bool = True,
    caller_env: dict[str, str] | None = None,
    artifacts: bool = True,
    exclude_pids: frozenset[int] = frozenset(),
    runs: tuple[RecordedRun, ...] = (),
) -> Scan:
    """One scan. `artifacts=False` skips /dev/shm and /tmp (a release check needs only
    holders and ports). `exclude_pids` (live /proc only): our own helpers, e.g. deep probes.
    `runs`: the live runs' records (state/live.recorded_runs), the only proof of a
    process's XPUCTL_RUN_ID; without them no tag counts.

    Every read is bounded: the scan runs in the host's reader (host/reads/), and a
    process with a file that did not answer is listed in `unreadable_processes`, never
    judged: its role is unknown, a device it may hold is not free, no file is stale."""
    if host.reader is not None:
        scan: Scan = request_scan(host, port, want_env, caller_env, artifacts, exclude_pids,
                                  runs)()
        return scan
    now, fds = _pass(host, own_pids(host, exclude_pids), artifacts, want_env)
    devices, issues = scan_devices(host)
    stuck = _stuck(host, fds)
    lazy = _Lazy(host, fds)
    clients, held, dmabufs = _holdings(host, fds, devices)
    procs = _processes(host, fds, lazy, clients, held, stuck, want_env, devices, runs)
    ordered = sorted(procs.values(), key=lambda p: (p.top or p.pid, p.pid))
    found, art_issues = judge_files(host, fds, lazy.start_time, ordered, now, stuck) \
        if artifacts else ([], [])
    issues.extend(art_issues)
    if fds.unreadable:
        issues.append(_unreadable_fds(host, fds.unreadable))
    if fds.malformed:
        issues.append(Issue("/proc", f"could not parse {len(fds.malformed)} process(es)"))
    ports = ports_of(host, fds, procs, port)
    return Scan(
        root=host.origin,
        taken_at=now,
        devices=tuple(devices),
        processes=tuple(ordered),
        clients=tuple(clients),
        dmabufs=tuple(dmabufs),
        artifacts=tuple(found),
        ports=tuple(ports),
        issues=tuple(issues),
        unreadable=len(fds.unreadable),
        caller_env=dict(caller_env) if caller_env is not None else {},
        unreadable_processes=tuple(_unreadable(host, fds, stuck)),
        blocked=tuple(Issue(b.path, b.reason) for b in host.blocked_reads()),
    )


def request_scan(
    host: Host,
    port: int | None = DEFAULT_PORT,
    want_env: bool = True,
    caller_env: dict[str, str] | None = None,
    artifacts: bool = True,
    exclude_pids: frozenset[int] = frozenset(),
    runs: tuple[RecordedRun, ...] = (),
) -> Callable[[], Scan]:
    """`take_scan`, asked for now: the function returned waits for the Scan. With a reader
    the scan is taken there while this process goes on (doctor loads what judges a scan
    meanwhile); without one it is taken here, at once."""
    if host.reader is None:
        scan = take_scan(host, port, want_env, caller_env, artifacts, exclude_pids, runs)
        return lambda: scan
    return host.reader.submit(take_scan, host, port, want_env, caller_env, artifacts,
                              own_pids(host, exclude_pids), runs)


def _holdings(host: Host, fds: FdTable, devices: list[Device]
              ) -> tuple[list[DrmClient], dict[int, set[str]], list[DmabufHold]]:
    """The DRM clients, each process's devices (through a DRM fd or a dma-buf), the dma-bufs."""
    clients, held = drm_clients(host, fds, devices)
    dmabufs = dmabufs_held(host, fds, devices, held)
    for b in dmabufs:
        held.setdefault(b.pid, set())
        if b.bdf:
            held[b.pid].add(b.bdf)
    return clients, held, dmabufs


def _member(pid: int, st: ProcStat, role: str | None, run_id: str | None,
            blocked: bool) -> Member:
    return Member(pid, st.ppid, st.session, role, run_id, st.state == "Z", st.pgrp,
                  st.start_ticks, blocked)


def _parents(host: Host, fds: FdTable, relevant: dict[int, RawProcess],
             stuck: dict[int, BlockedRead]) -> dict[int, Member]:
    """The parents of the processes a scan describes (the launcher of vLLM run as a library
    is one), those left out of the pass (ours) read now: core/trees judges whether each is
    still the process that launched its child. One that did not answer is not read again."""
    out: dict[int, Member] = {}
    for p in relevant.values():
        ppid = p.stat.ppid
        if ppid <= 0 or ppid in relevant or ppid in out:
            continue
        raw = fds.procs.get(ppid)
        if raw is None and ppid in stuck:
            out[ppid] = Member(ppid, 0, 0, None, None, blocked=True)
            continue
        st = raw.stat if raw is not None else stat_of(host, ppid)
        if st is not None:
            out[ppid] = _member(ppid, st, None, None, ppid in stuck)
            if (ppid == 1 and ppid not in stuck and st.session > 0
                    and (p.stat.session, p.stat.pgrp) == (st.session, st.pgrp)):
                # only then can PID 1 be its launcher (core/trees.launcher)
                out[ppid] = out[ppid]._replace(runs_vllm=runs_vllm(host, ppid))
    return out


def _launcher_of(host: Host, fds: FdTable, pid: int, stuck: dict[int, BlockedRead]) -> Launcher:
    raw = fds.procs.get(pid)
    if raw is None or pid in stuck:
        return Launcher(pid, f"[{raw.stat.comm}]" if raw is not None else "?", pid in stuck)
    argv = fill_cmdline(host, raw)
    return Launcher(pid, " ".join(argv) if argv else f"[{raw.stat.comm}]")


def _memory_by_pid(clients: list[DrmClient]) -> dict[int, int]:
    """The device memory each pid's DRM clients hold, where fdinfo says."""
    out: dict[int, int] = {}
    for c in clients:
        if c.memory_bytes is not None:
            for pid in c.pids:
                out[pid] = out.get(pid, 0) + c.memory_bytes
    return out


def _reported(place: Placement | None, placements: dict[int, Placement], holds: bool) -> bool:
    """Is a process of the pass one the scan describes? Not an unrelated multiprocessing
    helper (no place in a tree), nor a Ray cluster's own process that is no run's, unless it
    holds a device."""
    if holds:
        return True
    return place is not None and not (place.role == RAY and placements[place.top].role == RAY)


def _processes(host: Host, fds: FdTable, lazy: _Lazy, clients: list[DrmClient],
               held: dict[int, set[str]], stuck: dict[int, BlockedRead], want_env: bool,
               devices: list[Device], runs: tuple[RecordedRun, ...]) -> dict[int, Process]:
    """The processes a scan describes: vLLM ones (and candidates) plus every holder, placed
    in their server trees."""
    _tag_run_leaders(fds, runs)
    relevant: dict[int, RawProcess] = {
        pid: p for pid, p in fds.procs.items() if p.role is not None or pid in held
    }
    facts = {pid: facts_of(host, p, want_env) for pid, p in relevant.items()}
    tags = {pid: tag for pid in relevant if (tag := (facts[pid][1] or {}).get(RUN_ID_VAR))}
    proven = _proven(fds, tags, runs)
    members = _parents(host, fds, relevant, stuck)
    members.update({pid: _member(pid, p.stat, p.role, tags[pid] if pid in proven else None,
                                 pid in stuck)
                    for pid, p in relevant.items()})
    placements = place_trees(host, fds, members, runs, set(stuck))
    by_run = {r.run_id: r for r in runs}
    launchers = {o: _launcher_of(host, fds, o, stuck)
                 for o in {pl.owner for pl in placements.values() if pl.owner is not None}}
    boot = lazy.boot_time()
    mem_by_pid = _memory_by_pid(clients)
    procs: dict[int, Process] = {}
    containers = ContainerLookup(host)
    for pid, raw in relevant.items():
        place = placements.get(pid)
        if not _reported(place, placements, pid in held):
            continue
        st = raw.stat
        uid, env, cgroup = facts[pid]
        run_id = tags.get(pid)
        procs[pid] = Process(
            pid=pid, ppid=st.ppid, state=st.state, comm=st.comm,
            cmdline=tuple(fill_cmdline(host, raw)),
            start_time=(boot + st.start_ticks / host.clk_tck) if boot is not None else None,
            start_ticks=st.start_ticks, session=st.session, pgrp=st.pgrp, threads=st.threads,
            uid=uid,
            role=place.role if place else None,
            rank=raw.rank,
            orphan=place.orphan if place else False,
            top=place.top if place else None,
            run_id=run_id,
            devices=tuple(sorted(held.get(pid, ()))),
            memory_bytes=mem_by_pid.get(pid),
            wchan=_wchan(host, pid) if st.state == "D" else None,
            env=env,
            blocked=stuck[pid].path if pid in stuck else None,
            container=containers.of(cgroup) if pid not in stuck else None,
            cmdline_bytes=raw.cmdline_bytes,
            embedded_in=launchers.get(place.owner) if place and place.owner is not None else None,
            run_proven=pid in proven,
            stopping_by=place.stopping_by if place else None,
            claims=_claims(env, by_run.get(run_id) if pid in proven and run_id else None,
                           devices),
        )
    return procs
