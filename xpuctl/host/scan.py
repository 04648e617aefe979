"""host → probes → Scan: one scan of everything doctor, ps and shutdown look at."""

from __future__ import annotations

from xpuctl.core.model import (
    Artifact,
    Device,
    DmabufHold,
    DrmClient,
    FileInfo,
    Issue,
    Launcher,
    Port,
    Process,
    RecordedRun,
    Scan,
    Unreadable,
)
from xpuctl.core.oneccl import KVS, kvs_port
from xpuctl.core.rules import CCL_USED, Facts, Starter, judge, match, named_pid
from xpuctl.core.trees import Member
from xpuctl.host.adoption import ending_supervisors, runs_vllm
from xpuctl.host.adoption import place as place_trees
from xpuctl.host.containers import ContainerLookup
from xpuctl.host.devices import scan_devices
from xpuctl.host.drm import dmabufs_held, drm_clients
from xpuctl.host.liveness import Holdings
from xpuctl.host.processes import (
    FdTable,
    RawProcess,
    fill_cmdline,
    own_pids,
    read_optional,
    scan_processes,
    stat_of,
    taken_pass,
)
from xpuctl.host.reads.protocol import BlockedRead
from xpuctl.host.seam import Host
from xpuctl.host.sockdiag import listening_sockets
from xpuctl.parse.envvars import mask_indices
from xpuctl.parse.procfs import (
    ProcStat,
    maps_library,
    parse_boot_time,
    parse_environ,
    parse_status_uid,
    shown_command,
)
from xpuctl.parse.roles import API_SERVER, RAY

RUN_ID_VAR = "XPUCTL_RUN_ID"
DEFAULT_PORT = 8000


def _pass(host: Host, skip: frozenset[int], files: bool) -> tuple[float, FdTable]:
    """(when it was taken, the pass over /proc): the one started ahead, else a new one."""
    ahead = taken_pass(host, skip)
    if ahead is not None:
        return ahead
    return host.now(), scan_processes(host, skip, files=files)


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


def _details(host: Host, pid: int, want_env: bool) -> tuple[int | None, dict[str, str] | None]:
    uid = None
    raw = read_optional(host, f"/proc/{pid}/status", 1 << 16)
    if raw is not None:
        uid = parse_status_uid(raw.decode("utf-8", "replace"))
    env = None
    if want_env:
        data = read_optional(host, f"/proc/{pid}/environ")
        env = parse_environ(data) if data else {}
    return uid, env


def _candidates(host: Host) -> tuple[list[tuple[str, str, FileInfo]], list[Issue]]:
    """The files of /dev/shm and /tmp whose names a rule knows, with their lstat."""
    issues: list[Issue] = []
    candidates: list[tuple[str, str, FileInfo]] = []
    for directory in ("/dev/shm", "/tmp"):
        try:
            names = host.listdir(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            issues.append(Issue(directory, f"cannot list: {exc.strerror or exc}"))
            continue
        for name in names:
            m = match(directory, name)
            if m is None:
                continue
            path = f"{directory}/{name}"
            try:
                info = host.lstat(path)
            except OSError:
                continue
            kind, socket_only = m
            if socket_only and not info.is_socket:
                continue
            candidates.append((path, kind, info))
    return sorted(candidates), issues


def _artifacts(
    host: Host, fds: FdTable, lazy: _Lazy, procs: list[Process], now: float,
    stuck: dict[int, BlockedRead],
) -> tuple[list[Artifact], list[Issue]]:
    candidates, issues = _candidates(host)
    if not candidates:
        return [], issues
    holds = Holdings(host, fds, {path: info for path, _, info in candidates},
                     ccl_wanted=any(kind in CCL_USED for _, kind, _ in candidates))
    vllm = tuple(Starter(p.pid, p.uid, p.start_time) for p in procs
                 if p.role is not None and not p.is_zombie)
    ccl: tuple[Starter, ...] | None = None
    out: list[Artifact] = []
    unjudged = 0
    for path, kind, info in candidates:
        facts = Facts((), (), False, None, vllm)
        if kind != "cache" and (info.is_regular or info.is_socket):
            facts = _facts(holds, lazy, path, kind, info, facts)
            if kind in CCL_USED and not facts.open_by and not facts.mapped_by:
                if ccl is None:
                    ccl = tuple(Starter(pid, holds.uid_of(pid), lazy.start_time(pid))
                                for pid in sorted(set(holds.ccl_users())))
                facts = facts._replace(ccl=ccl)
        verdict = judge(path, kind, info, facts)
        stale, reason = verdict.stale, verdict.reason
        if stale and stuck:
            # a process that did not answer may have it open or mapped, or be the vLLM
            # process whose FileStore it is: nothing is stale on the strength of that
            stale, reason = False, (f"not judged: pid(s) {', '.join(map(str, sorted(stuck)))} "
                                    "did not answer, their open files and mappings are unknown")
        unjudged += bool(verdict.unseen)
        out.append(
            Artifact(
                path=path,
                kind=kind,
                stale=stale,
                reason=reason,
                open_by=tuple(sorted(set(facts.open_by + facts.mapped_by))),
                owner_uid=info.uid,
                size_bytes=info.size,
                age_seconds=max(0.0, now - info.mtime),
                inode=info.inode,
                dev=info.dev,
                kept_by=verdict.kept_by,
                unseen=verdict.unseen,
            )
        )
    if unjudged:
        seen = max(a.unseen for a in out)
        issues.append(Issue("/proc", f"{unjudged} file(s) in /dev/shm and /tmp kept unjudged: "
                                     f"{seen} process(es) that could hold them could not be "
                                     "inspected"))
    return out, issues


def _facts(holds: Holdings, lazy: _Lazy, path: str, kind: str, info: FileInfo,
           facts: Facts) -> Facts:
    """What the host says about one candidate: who has it open or mapped (a socket is never
    mapped), what is bound to it, the process its name's pid names, who went uninspected.

    A regular file that no process found holds is asked once more by its inode, on the
    kernel's /proc: a write lease (Holdings.lease) is refused while any open file
    description of it exists, whoever holds it: a process that could not be inspected, one
    that was handed it over a unix socket, one the pass did not see it in."""
    open_by = holds.open_by(path)
    mapped_by: tuple[int, ...] = ()
    bound: bool | None = False
    bound_by: tuple[int, ...] = ()
    unseen: tuple[int, ...] = ()
    held: bool | None = None
    if info.is_socket:
        bound, bound_by = holds.bound(path)
    elif not open_by:
        mapped_by = holds.mapped_by(path)
        if not mapped_by:
            if holds.host.identity_checked:  # a fake tree's processes are texts: no lease tells
                held = holds.lease(path)
            # refused: anyone uninspected may be the holder; else those who could open it
            unseen = holds.unseen(info, anyone=bool(held))
    named = None
    pid = named_pid(kind, path.rsplit("/", 1)[-1])
    if pid is not None and (raw := holds.fds.procs.get(pid)) is not None and raw.stat.state != "Z":
        named = (pid, lazy.start_time(pid))
    return facts._replace(open_by=open_by, mapped_by=mapped_by, bound=bound, named=named,
                          unseen=unseen, held=held, bound_by=bound_by)


def _kvs_owners(host: Host, port: int, pids: list[int], procs: dict[int, Process],
                cache: dict[int, bool]) -> set[int]:
    """The pids among a listener's owners that prove it is oneCCL's KVS (core/oneccl.py): the
    port is the KVS's and the process maps libccl (its maps read once, bounded)."""
    out = set()
    for pid in pids:
        p = procs.get(pid)
        if not kvs_port(port, p.env if p is not None else None):
            continue
        if pid not in cache:
            data = read_optional(host, f"/proc/{pid}/maps", 64 << 20)
            text = data.decode("utf-8", "surrogateescape") if data else ""
            cache[pid] = maps_library(text, "libccl")
        if cache[pid]:
            out.add(pid)
    return out


def _ports(host: Host, fds: FdTable, procs: dict[int, Process], port: int | None) -> list[Port]:
    listeners = fds.listeners if fds.listeners is not None else listening_sockets(host)
    host.found_listeners(listeners)
    out: list[Port] = []
    seen: set[tuple[int, int | None]] = set()
    serving_found = False
    maps_ccl: dict[int, bool] = {}
    for sock in listeners:
        pids = fds.sockets.get(sock.inode, [])
        owners = [procs.get(pid) for pid in pids]
        # Ray's own listeners (GCS, dashboard, agents) are not the run's ports, even when the
        # run started that Ray
        vllm_owners = [p for p in owners if p is not None and p.role not in (None, RAY)]
        is_serving = port is not None and sock.port == port
        kvs = _kvs_owners(host, sock.port, pids, procs, maps_ccl)
        if not is_serving and not vllm_owners and not kvs:
            continue
        for pid in pids or (None,):
            p = procs.get(pid) if pid is not None else None
            if not is_serving and pid not in kvs and (p is None or p.role in (None, RAY)):
                continue
            key = (sock.port, pid)
            if key in seen:
                continue
            seen.add(key)
            serving_found |= is_serving
            out.append(
                Port(
                    sock.port,
                    sock.address,
                    pid,
                    "listen",
                    p.role if p else None,
                    bool(p and p.orphan),
                    KVS if pid in kvs else None,
                )
            )
    if port is not None and not serving_found:
        out.append(Port(port, None, None, "free"))
    return sorted(out, key=lambda x: (x.port, x.pid or 0))


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
        scan: Scan = host.reader.call(take_scan, host, port, want_env, caller_env, artifacts,
                                      own_pids(host, exclude_pids), runs)
        return scan
    now, fds = _pass(host, own_pids(host, exclude_pids), artifacts)
    devices, issues = scan_devices(host)
    stuck = _stuck(host, fds)
    lazy = _Lazy(host, fds)
    clients, held, dmabufs = _holdings(host, fds, devices)
    procs = _processes(host, fds, lazy, clients, held, stuck, want_env, devices, runs)
    ordered = sorted(procs.values(), key=lambda p: (p.top or p.pid, p.pid))
    found, art_issues = _artifacts(host, fds, lazy, ordered, now, stuck) if artifacts else ([], [])
    issues.extend(art_issues)
    if fds.unreadable:
        issues.append(_unreadable_fds(host, fds.unreadable))
    if fds.malformed:
        issues.append(Issue("/proc", f"could not parse {len(fds.malformed)} process(es)"))
    ports = _ports(host, fds, procs, port)
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


def _processes(host: Host, fds: FdTable, lazy: _Lazy, clients: list[DrmClient],
               held: dict[int, set[str]], stuck: dict[int, BlockedRead], want_env: bool,
               devices: list[Device], runs: tuple[RecordedRun, ...]) -> dict[int, Process]:
    """The processes a scan describes: vLLM ones (and candidates) plus every holder, placed
    in their server trees."""
    _tag_run_leaders(fds, runs)
    relevant: dict[int, RawProcess] = {
        pid: p for pid, p in fds.procs.items() if p.role is not None or pid in held
    }
    details = {pid: _details(host, pid, want_env) for pid in relevant}
    tags = {pid: tag for pid in relevant if (tag := (details[pid][1] or {}).get(RUN_ID_VAR))}
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
    mem_by_pid: dict[int, int] = {}
    for c in clients:
        if c.memory_bytes is not None:
            for pid in c.pids:
                mem_by_pid[pid] = mem_by_pid.get(pid, 0) + c.memory_bytes
    procs: dict[int, Process] = {}
    containers = ContainerLookup(host)
    for pid, raw in relevant.items():
        place = placements.get(pid)
        if place is None and pid not in held:
            continue  # an unrelated multiprocessing helper
        if place is not None and place.role == RAY and placements[place.top].role == RAY \
                and pid not in held:
            continue  # a Ray cluster's own process, no run's: nothing to report
        st = raw.stat
        uid, env = details[pid]
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
            container=containers.of(pid) if pid not in stuck else None,
            cmdline_bytes=raw.cmdline_bytes,
            embedded_in=launchers.get(place.owner) if place and place.owner is not None else None,
            run_proven=pid in proven,
            stopping_by=place.stopping_by if place else None,
            claims=_claims(env, by_run.get(run_id) if pid in proven and run_id else None,
                           devices),
        )
    return procs
