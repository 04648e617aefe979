"""The shutdown ladder: find a server's tree, drain it, escalate, prove the GPU is free.

1. SIGTERM to the top process only (vLLM coordinates its own teardown; a group signal
   makes workers die before the drain ends).
2. Watch the drain: in-flight requests from /metrics, vLLM's `[shutdown]` log phases.
3. Wait up to the run's shutdown timeout plus a margin for the whole tree: every recorded,
   descendant, same-session and XPUCTL_RUN_ID-tagged process. A server that never became
   ready has nothing to drain: it gets its teardown timeout only (`exit_budget`).
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

from xpuctl.host.seam import Host
from xpuctl.core.model import Snapshot
from xpuctl.parse.procfs import parse_environ
from xpuctl.parse.roles import API_SERVER
from xpuctl.host.processes import list_pids, read_cmdline, stat_of
from xpuctl.state.runs import RunRecord
from xpuctl.host.scan import RUN_ID_VAR, listening_sockets, take_snapshot
from xpuctl.actions.signals import Target, target_of, wait_gone

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
    never_ready: bool = False  # still starting: nothing to drain (stop.exit_budget)

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
    tree.never_ready = rec.state == "starting"
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


class _Ladder:
    """The state one run of the ladder shares between its steps (see `stop`)."""

    def __init__(self, host: Host, trees: list[Tree], on_event: Callable[[Event], None] | None,
                 poll: float, passive: bool, yield_to: Callable[[], bool] | None) -> None:
        self.host = host
        self.trees = trees
        self.on_event = on_event
        self.poll = poll
        self.passive = passive
        self.yield_to = yield_to
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self.escalated = False
        self.everyone: dict[int, Target] = {}
        self.first_members: dict[int, list[int]] = {}
        self.pending: list[Target] = []
        self.tails = {id(tree): _LogTail(tree.log_path) for tree in trees}

    def emit(self, phase: str, detail: str) -> None:
        ev = Event(round(time.monotonic() - self.t0, 3), phase, detail)
        self.events.append(ev)
        if self.on_event:
            self.on_event(ev)

    def vllm_lines(self) -> None:
        for tree in self.trees:
            for phase in self.tails[id(tree)].new_phases():
                self.emit("vllm", phase)

    def check_yield(self) -> None:
        if not self.passive and self.yield_to is not None and self.yield_to():
            self.passive = True
            self.emit("yield", "another xpuctl is stopping this run: watching only")


def _find_members(ld: _Ladder) -> None:
    """Every process of every tree, once, before the first signal."""
    for tree in ld.trees:
        found = members(ld.host, tree)
        ld.first_members[tree.top.pid] = [t.pid for t in found]
        for t in found:
            ld.everyone[t.pid] = t
    ld.pending = list(ld.everyone.values())


def _sigterm_tops(ld: _Ladder) -> None:
    """1. SIGTERM to each top only; a gone top's remains get it at their top-most survivor
    (a SIGTERM to an orphaned EngineCore stops its workers in order)."""
    if ld.passive:
        return
    for tree in ld.trees:
        if tree.top.send(ld.host, signal.SIGTERM):
            ld.emit("sigterm", f"SIGTERM to {tree.role or 'process'} {tree.top.pid} ({tree.name})")
            continue
        ld.emit("gone", f"{tree.top.pid} had already exited")
        rest = [m for m in ld.everyone.values() if m.pid != tree.top.pid]
        for t in _topmost(ld.host, rest):
            if "resource_tracker" in t.label:
                continue
            if t.send(ld.host, signal.SIGTERM):
                ld.emit("sigterm", f"SIGTERM to {t.pid} ({t.label}), top of what is left")


def exit_budget(tree: Tree) -> float:
    """How long a tree gets to exit after its SIGTERM: the run's shutdown timeout plus a
    margin; a server that never became ready has nothing to drain and gets its teardown
    budget only."""
    if tree.never_ready:
        if tree.record is not None:
            return float(tree.record.teardown_timeout)
        return float(DEFAULT_SHUTDOWN_TIMEOUT)
    st = tree.shutdown_timeout if tree.shutdown_timeout is not None else DEFAULT_SHUTDOWN_TIMEOUT
    return st + DRAIN_MARGIN


def _wait_exit(ld: _Ladder, timeout: float | None) -> None:
    """2-3. Wait for the whole set, watching the drain (in-flight requests, vLLM's lines)."""
    budget = timeout if timeout is not None else max(exit_budget(t) for t in ld.trees)
    if all(t.never_ready for t in ld.trees):
        ld.emit("teardown", f"never ready, nothing to drain: waiting up to {budget:g}s for "
                f"{len(ld.everyone)} process(es) to exit")
    else:
        ld.emit("drain", f"waiting up to {budget:g}s for {len(ld.everyone)} process(es) to exit")
    deadline = time.monotonic() + budget
    last_flight: dict[int, int | None] = {}
    next_probe = 0.0
    while True:
        ld.pending = wait_gone(ld.host, ld.pending, min(0.25, max(0.0, deadline - time.monotonic())),
                               ld.poll)
        now = time.monotonic()
        ld.vllm_lines()
        if not ld.pending or now >= deadline:
            break
        ld.check_yield()
        if now >= next_probe:
            next_probe = now + 0.5
            for tree in ld.trees:
                if tree.port and not tree.orphan and not tree.never_ready and tree.top.alive(ld.host):
                    from xpuctl.host import http  # only when there is a drain to watch

                    n = http.in_flight(http.local_host(tree.bind), tree.port, 0.3)
                    if n is not None and n != last_flight.get(tree.top.pid):
                        last_flight[tree.top.pid] = n
                        ld.emit("in-flight", f"{n} request(s) running or waiting on :{tree.port}")
    if ld.pending:
        ld.emit("timeout", f"{len(ld.pending)} process(es) still alive after {budget:g}s")


def _late_joiners(ld: _Ladder) -> None:
    """Tagged processes that appeared during the wait join the survivors."""
    for tree in ld.trees:
        for t in members(ld.host, tree):
            if t.pid not in ld.everyone:
                ld.everyone[t.pid] = t
                ld.pending.append(t)
    ld.pending = [t for t in ld.pending if t.alive(ld.host)]


def _escalate(ld: _Ladder, kill_after: float, skip_drain: bool) -> None:
    """4. SIGTERM to the survivors, then after `kill_after` SIGKILL (identity re-checked)."""
    ld.check_yield()
    if ld.passive:
        return
    if ld.pending and kill_after > 0 and not skip_drain:
        ld.escalated = True
        sent = [t for t in reversed(ld.pending) if t.send(ld.host, signal.SIGTERM)]
        if sent:
            ld.emit("sigterm-survivors", "SIGTERM to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        ld.pending = wait_gone(ld.host, ld.pending, kill_after, ld.poll)
    if ld.pending:
        ld.escalated = True
        sent = [t for t in reversed(ld.pending) if t.send(ld.host, signal.SIGKILL)]
        if sent:
            ld.emit("sigkill", "SIGKILL to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        ld.pending = wait_gone(ld.host, ld.pending, KILL_WAIT, ld.poll)


def _verify_release(ld: _Ladder, release_timeout: float) -> StopResult:
    """5. Wait until no process holds the trees' devices and their ports are free."""
    ld.vllm_lines()
    if not ld.pending:
        ld.emit("exited", f"all {len(ld.everyone)} process(es) are gone")
    devices = sorted({b for t in ld.trees for b in t.devices})
    ports = sorted({t.port for t in ld.trees if t.port})
    deadline = time.monotonic() + release_timeout
    while True:
        snap = take_snapshot(ld.host, port=None, want_env=False, artifacts=False)
        holders = sorted({pid for b in devices for pid in snap.holders(b)})
        busy_ports = sorted({s.port for s in listening_sockets(ld.host) if s.port in ports}) if ports else []
        if (not holders and not busy_ports) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    stuck = [(p.pid, p.wchan) for p in snap.processes if p.pid in holders and p.state == "D"]
    if devices:
        if holders:
            ld.emit("holders", f"{', '.join(devices)} still held by {', '.join(map(str, holders))}")
        else:
            ld.emit("released", f"{', '.join(devices)} released")
    if busy_ports:
        ld.emit("port", f"port(s) {', '.join(map(str, busy_ports))} still in use")
    for pid, wchan in stuck:
        ld.emit("stuck", f"{pid} is in D state in {wchan or '?'}")
    survivors = [t.pid for t in ld.pending if t.alive(ld.host)]
    leftovers = bool(survivors or holders or busy_ports)
    verdict = "leftovers" if leftovers else ("escalated" if ld.escalated else "clean")
    ld.emit("verdict", verdict)
    return StopResult(ld.trees, ld.events, verdict, survivors, holders, stuck, busy_ports,
                      ld.first_members)


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
    """Run the ladder on `trees`, step by step (each step a function named for what it
    does; the events it emits are the timeline): `_find_members`, `_sigterm_tops`,
    `_wait_exit`, `_late_joiners`, `_escalate`, `_verify_release`.

    `timeout` overrides `exit_budget`. `passive`: send nothing, only wait and verify
    (someone else is already stopping them); `yield_to()` returning True turns passive
    midway. `skip_drain`: no SIGTERM and no wait, straight to SIGKILL."""
    ld = _Ladder(host, trees, on_event, poll, passive, yield_to)
    _find_members(ld)
    if not skip_drain:
        _sigterm_tops(ld)
        _wait_exit(ld, timeout)
    _late_joiners(ld)
    _escalate(ld, kill_after, skip_drain)
    return _verify_release(ld, release_timeout)


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
