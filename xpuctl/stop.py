"""The shutdown ladder: find a server's tree, drain it, escalate, prove the GPU is free.

1. SIGTERM to the top process only (vLLM coordinates its own teardown; a group signal
   makes workers die before the drain ends).
2. Watch the drain: in-flight requests from /metrics, vLLM's `[shutdown]` log phases.
3. Wait up to the run's shutdown timeout plus a margin for the whole tree: every recorded,
   descendant, same-session and XPUCTL_RUN_ID-tagged process.
4. SIGTERM to survivors, then after `kill_after` SIGKILL (identity re-checked every time).
5. Wait until no process holds the tree's devices and its port is free.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xpuctl.host import Host
from xpuctl.model import Snapshot
from xpuctl.parse.procfs import parse_environ
from xpuctl.parse.roles import API_SERVER
from xpuctl.probes.processes import list_pids, read_cmdline, stat_of
from xpuctl.runs import RunRecord
from xpuctl.scan import RUN_ID_VAR, listening_sockets, take_snapshot
from xpuctl.supervisor import Target, target_of, wait_gone

DRAIN_MARGIN = 10.0  # seconds on top of vLLM's own shutdown timeout
DEFAULT_SHUTDOWN_TIMEOUT = 5  # what vLLM >= 0.25 forces on XPU when none is given
KILL_WAIT = 5.0  # seconds to wait for SIGKILLed processes before calling them survivors
_TIMEOUT_ARG = re.compile(r"^--shutdown[-_]timeout(?:=(\d+))?$")
_LOG_MARKERS = ("[shutdown]", "XPUWorker shutdown", "force killing", "sending SIGKILL", "sending SIGTERM")


@dataclass
class Tree:
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

    @property
    def name(self) -> str:
        return self.record.name if self.record else f"pid {self.top.pid}"


@dataclass
class Event:
    t: float
    phase: str
    detail: str


@dataclass
class StopResult:
    trees: list[Tree]
    events: list[Event]
    verdict: str  # clean | escalated | leftovers
    survivors: list[int]
    holders: list[int]
    stuck: list[tuple[int, str | None]]  # D-state holders and their wchan
    port_busy: list[int]
    members: dict[int, list[int]]  # top pid -> the tree's processes when the ladder began


def shutdown_timeout_from_argv(argv: tuple[str, ...] | list[str]) -> int | None:
    for i, arg in enumerate(argv):
        m = _TIMEOUT_ARG.match(arg)
        if not m:
            continue
        value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
        if value.isdigit():
            return int(value)
    return None


def port_from_argv(argv: tuple[str, ...] | list[str]) -> tuple[int | None, str | None]:
    port = host = None
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if arg == "--port" and nxt.isdigit():
            port = int(nxt)
        elif arg.startswith("--port=") and arg[7:].isdigit():
            port = int(arg[7:])
        elif arg == "--host" and nxt:
            host = nxt
        elif arg.startswith("--host="):
            host = arg[7:]
    return port, host


def tree_from_snapshot(snap: Snapshot, top_pid: int, host: Host) -> Tree | None:
    top = snap.process(top_pid)
    target = target_of(host, top_pid, top.role or "" if top else "")
    if target is None or top is None:
        return None
    members = [p for p in snap.processes if (p.top or p.pid) == top_pid and not p.is_zombie]
    port, bind = port_from_argv(top.cmdline) if top.role == API_SERVER else (None, None)
    if top.role == API_SERVER and port is None:
        port = 8000
    known = [t for t in (target_of(host, p.pid, p.role or "") for p in members) if t]
    return Tree(
        top=target,
        role=top.role,
        orphan=top.orphan or top.role != API_SERVER,
        run_id=top.run_id,
        session=top.session if top.session == top.pid else None,
        devices=tuple(sorted({b for p in members for b in p.devices})),
        port=port,
        bind=bind,
        shutdown_timeout=shutdown_timeout_from_argv(top.cmdline) if top.role == API_SERVER else None,
        known=known,
    )


def tree_from_record(rec: RunRecord, snap: Snapshot, host: Host) -> Tree | None:
    """A recorded run: its top if still the same process, else whatever carries its run id."""
    tree = None
    if rec.pid and rec.start_ticks is not None:
        p = snap.process(rec.pid)
        if p is not None and p.start_ticks == rec.start_ticks:
            tree = tree_from_snapshot(snap, rec.pid, host)
        if tree is None:
            # the recorded top is what xpuctl launched: trust the record over argv shapes
            t = target_of(host, rec.pid, "api-server")
            if t is not None and t.start_ticks == rec.start_ticks:
                tree = Tree(top=t, role=API_SERVER, orphan=False, known=[t])
    if tree is None:
        tagged = [p for p in snap.processes if p.run_id == rec.run_id and not p.is_zombie]
        if not tagged:
            return None
        tops = sorted({p.top or p.pid for p in tagged})
        tree = tree_from_snapshot(snap, tops[0], host)
        if tree is None:
            return None
    tree.record = rec
    tree.run_id = rec.run_id
    tree.session = rec.session
    # the devices the run claimed (its lock); another holder elsewhere is not its leftover
    tree.devices = tuple(sorted(rec.devices)) if rec.devices else tree.devices
    tree.port = rec.port
    tree.bind = rec.host
    tree.shutdown_timeout = rec.shutdown_timeout
    tree.log_path = rec.log_path
    return tree


def members(host: Host, tree: Tree) -> list[Target]:
    """Every live process of the tree: known ones, descendants, its session, its run id.

    Only /proc/<pid>/stat is read for every process. The environ (for the run id) is read
    only for processes started since the run began, and the cmdline only for members (as a
    label): both reads take the target's mmap lock, which a process stuck in the kernel
    can hold for good, and an unrelated stuck process must not hang a shutdown."""
    stats = {}
    for pid in list_pids(host):
        st = stat_of(host, pid)
        if st is not None and st.state != "Z":
            stats[pid] = st
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
    chosen.discard(os.getpid())
    out = []
    for pid in sorted(chosen):
        argv = read_cmdline(host, pid)
        out.append(Target(pid, stats[pid].start_ticks, argv[0] if argv else stats[pid].comm))
    return out


def _run_start_ticks(tree: Tree) -> int:
    """The earliest start (clock ticks since boot) of what we know of the run."""
    ticks = [tree.top.start_ticks, *(t.start_ticks for t in tree.known)]
    if tree.record is not None and tree.record.start_ticks:
        ticks.append(tree.record.start_ticks)
    return min(ticks)


class _LogTail:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.offset = 0
        if path:
            try:
                self.offset = os.path.getsize(path)
            except OSError:
                self.path = None

    def new_phases(self) -> list[str]:
        if not self.path:
            return []
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(1 << 20)
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        out = []
        for raw in data[:cut].splitlines():
            line = raw.decode("utf-8", "surrogateescape")  # exact in JSON; escaped when shown
            if line.startswith("xpuctl:"):
                continue  # the supervisor's own lines (a detached run logs here too)
            if any(m in line for m in _LOG_MARKERS):
                idx = line.find("[shutdown]")
                out.append((line[idx:] if idx >= 0 else line.split("] ", 1)[-1]).strip())
        return out


def stop(
    host: Host,
    trees: list[Tree],
    timeout: float | None = None,
    kill_after: float = 10.0,
    release_timeout: float = 30.0,
    on_event: Callable[[Event], None] | None = None,
    skip_drain: bool = False,
    poll: float = 0.05,
    passive: bool = False,
    yield_to: Callable[[], bool] | None = None,
) -> StopResult:
    """Run the ladder on `trees`. `passive`: send nothing, only wait and verify (someone
    else is already stopping them); `yield_to()` returning True turns passive midway."""
    t0 = time.monotonic()
    events: list[Event] = []

    def emit(phase: str, detail: str) -> None:
        ev = Event(round(time.monotonic() - t0, 3), phase, detail)
        events.append(ev)
        if on_event:
            on_event(ev)

    escalated = False
    everyone: dict[int, Target] = {}
    first_members: dict[int, list[int]] = {}
    for tree in trees:
        found = members(host, tree)
        first_members[tree.top.pid] = [t.pid for t in found]
        for t in found:
            everyone[t.pid] = t
    tails = {id(tree): _LogTail(tree.log_path) for tree in trees}

    # 1. SIGTERM to each top only
    if not skip_drain:
        for tree in trees:
            if passive:
                continue
            if tree.top.send(host, signal.SIGTERM):
                emit("sigterm", f"SIGTERM to {tree.role or 'process'} {tree.top.pid} ({tree.name})")
                continue
            emit("gone", f"{tree.top.pid} had already exited")
            # its remains coordinate their own teardown from their top-most survivor
            # (a SIGTERM to an orphaned EngineCore stops its workers in order)
            for t in _topmost(host, [m for m in everyone.values() if m.pid != tree.top.pid]):
                if "resource_tracker" in t.label:
                    continue
                if t.send(host, signal.SIGTERM):
                    emit("sigterm", f"SIGTERM to {t.pid} ({t.label}), top of what is left")

        # 2-3. wait for the whole set, watching the drain
        budget = timeout
        if budget is None:
            budget = max(
                (t.shutdown_timeout if t.shutdown_timeout is not None else DEFAULT_SHUTDOWN_TIMEOUT)
                for t in trees
            ) + DRAIN_MARGIN
        emit("drain", f"waiting up to {budget:g}s for {len(everyone)} process(es) to exit")
        deadline = time.monotonic() + budget
        last_flight: dict[int, int | None] = {}
        next_probe = 0.0
        pending = list(everyone.values())
        while True:
            pending = wait_gone(host, pending, min(0.25, max(0.0, deadline - time.monotonic())), poll)
            now = time.monotonic()
            for tree in trees:
                for phase in tails[id(tree)].new_phases():
                    emit("vllm", phase)
            if not pending or now >= deadline:
                break
            if not passive and yield_to is not None and yield_to():
                passive = True
                emit("yield", "another xpuctl is stopping this run: watching only")
            if now >= next_probe:
                next_probe = now + 0.5
                for tree in trees:
                    if tree.port and not tree.orphan and tree.top.alive(host):
                        from xpuctl import http  # only when there is a drain to watch

                        n = http.in_flight(http.local_host(tree.bind), tree.port, 0.3)
                        if n is not None and n != last_flight.get(tree.top.pid):
                            last_flight[tree.top.pid] = n
                            emit("in-flight", f"{n} request(s) running or waiting on :{tree.port}")
        if pending:
            emit("timeout", f"{len(pending)} process(es) still alive after {budget:g}s")
    else:
        pending = list(everyone.values())

    # late joiners: tagged processes that appeared during the drain
    for tree in trees:
        for t in members(host, tree):
            if t.pid not in everyone:
                everyone[t.pid] = t
                pending.append(t)
    pending = [t for t in pending if t.alive(host)]

    # 4. SIGTERM survivors, then SIGKILL
    if not passive and yield_to is not None and yield_to():
        passive = True
    if passive:
        pass
    elif pending and kill_after > 0 and not skip_drain:
        escalated = True
        sent = [t for t in reversed(pending) if t.send(host, signal.SIGTERM)]
        if sent:
            emit("sigterm-survivors", "SIGTERM to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        pending = wait_gone(host, pending, kill_after, poll)
    if pending and not passive:
        escalated = True
        sent = [t for t in reversed(pending) if t.send(host, signal.SIGKILL)]
        if sent:
            emit("sigkill", "SIGKILL to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        pending = wait_gone(host, pending, KILL_WAIT, poll)
    for tree in trees:
        for phase in tails[id(tree)].new_phases():
            emit("vllm", phase)
    if not pending:
        emit("exited", f"all {len(everyone)} process(es) are gone")

    # 5. release: no holders on the devices, port free
    devices = sorted({b for t in trees for b in t.devices})
    ports = sorted({t.port for t in trees if t.port})
    deadline = time.monotonic() + release_timeout
    while True:
        snap = take_snapshot(host, port=None, want_env=False, artifacts=False)
        holders = sorted({pid for b in devices for pid in snap.holders(b)})
        busy_ports = sorted({s.port for s in listening_sockets(host) if s.port in ports}) if ports else []
        if (not holders and not busy_ports) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    stuck = [(p.pid, p.wchan) for p in snap.processes if p.pid in holders and p.state == "D"]
    if devices:
        if holders:
            emit("holders", f"{', '.join(devices)} still held by {', '.join(map(str, holders))}")
        else:
            emit("released", f"{', '.join(devices)} released")
    if busy_ports:
        emit("port", f"port(s) {', '.join(map(str, busy_ports))} still in use")
    for pid, wchan in stuck:
        emit("stuck", f"{pid} is in D state in {wchan or '?'}")
    survivors = [t.pid for t in pending if t.alive(host)]
    leftovers = bool(survivors or holders or busy_ports)
    verdict = "leftovers" if leftovers else ("escalated" if escalated else "clean")
    emit("verdict", verdict)
    return StopResult(trees, events, verdict, survivors, holders, stuck, busy_ports, first_members)


def _topmost(host: Host, targets: list[Target]) -> list[Target]:
    """Targets whose parent is not among the targets (alive ones only)."""
    pids = {t.pid for t in targets}
    out = []
    for t in targets:
        st = stat_of(host, t.pid)
        if st is not None and st.start_ticks == t.start_ticks and st.state != "Z" and st.ppid not in pids:
            out.append(t)
    return out


def find_trees(
    host: Host,
    snap: Snapshot,
    records: list[RunRecord],
    name: str | None = None,
    pid: int | None = None,
    port: int | None = None,
    device_bdfs: tuple[str, ...] = (),
    all_: bool = False,
) -> list[Tree]:
    """The servers a shutdown request names. NotFoundError (exit 3) when it names nothing."""
    from xpuctl.errors import NotFoundError, UsageError

    trees: dict[int, Tree] = {}

    def add(tree: Tree | None) -> None:
        if tree is not None and tree.top.pid not in trees:
            trees[tree.top.pid] = tree

    def record_for(top_pid: int, run_id: str | None) -> RunRecord | None:
        for rec in records:
            if rec.pid == top_pid or (run_id and rec.run_id == run_id):
                return rec
        return None

    def add_top(top_pid: int) -> None:
        p = snap.process(top_pid)
        rec = record_for(top_pid, p.run_id if p else None)
        add(tree_from_record(rec, snap, host) if rec else tree_from_snapshot(snap, top_pid, host))

    if name is not None:
        rec = next((r for r in records if r.name == name), None)
        if rec is None:
            raise NotFoundError(f"no run named {name!r}" + (f"; known runs: {', '.join(r.name for r in records)}" if records else ""))
        tree = tree_from_record(rec, snap, host)
        if tree is None and not all_:
            raise NotFoundError(f"run {name!r} has no live process (state: {rec.state})")
        add(tree)
    if pid is not None:
        p = snap.process(pid)
        if p is None or p.role is None:
            raise NotFoundError(f"pid {pid} is not a vLLM process; xpuctl stops only vLLM servers")
        if p.is_zombie:
            raise NotFoundError(f"pid {pid} is a zombie: it holds nothing and cannot be stopped")
        add_top(p.top or p.pid)
    if port is not None:
        tops = sorted({pr.top or pr.pid for pt in snap.ports if pt.port == port and pt.pid for pr in [snap.process(pt.pid)] if pr and pr.role})
        if not tops:
            raise NotFoundError(f"no vLLM server listens on port {port}")
        for top in tops:
            add_top(top)
    if device_bdfs:
        tops = sorted({p.top or p.pid for p in snap.processes if p.role and not p.is_zombie and set(p.devices) & set(device_bdfs)})
        if not tops and not all_:
            raise NotFoundError(f"no vLLM process holds {', '.join(device_bdfs)}")
        for top in tops:
            add_top(top)
    if all_:
        for top in sorted({p.top or p.pid for p in snap.processes if p.role and not p.is_zombie}):
            add_top(top)
        for rec in records:
            if rec.state in ("starting", "ready", "stopping"):
                add(tree_from_record(rec, snap, host))
    if name is None and pid is None and port is None and not device_bdfs and not all_:
        raise UsageError("say which server to stop: NAME, --pid, --port, --device or --all")
    return list(trees.values())
