"""The shutdown ladder: drain the servers' trees (found by shutdown/targets), escalate, prove
the GPU is free.

1. SIGTERM to the top process only (vLLM coordinates its own teardown; a group signal
   makes workers die before the drain ends).
2. Watch the drain: in-flight requests from /metrics, vLLM's `[shutdown]` log phases.
3. Wait up to the run's shutdown timeout plus a margin for the whole tree: every recorded,
   descendant, same-session and XPUCTL_RUN_ID-tagged process. A server that never became
   ready has nothing to drain: it gets its teardown timeout only (`exit_budget`).
4. SIGTERM to survivors, then after `kill_after` SIGKILL (identity re-checked every time).
5. Wait until no process holds the tree's devices and its port is free.

A run on an existing Ray cluster (its record names the cluster): its actors are children of
the cluster's raylets, not of the run. They are listed before the first signal; the driver
(EngineCore) is stopped first, in the steps above, and Ray reaps the actors of a dead driver;
the Ray step then proves them gone on every node, killing through Ray by name, then by pid
on this node, what outlived the teardown budget (xpuctl.ray.teardown). In escalation, Ray
actor processes of the tree are signalled after everything else: the driver goes first.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpuctl import pausepoint
from xpuctl.actions.signals import Target, survivors, wait_gone
from xpuctl.core import waits
from xpuctl.core.waits import Wait
from xpuctl.host.processes import stat_of, still_running
from xpuctl.host.procfiles import read_cmdline
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host
from xpuctl.host.sockdiag import listening_sockets
from xpuctl.shutdown.logtail import LogTail
from xpuctl.shutdown.targets import ServerTree, members, topmost

if TYPE_CHECKING:  # types only: imported where used
    from xpuctl.ray.teardown import RayRun

DRAIN_MARGIN = 10.0  # seconds on top of vLLM's own shutdown timeout
DEFAULT_SHUTDOWN_TIMEOUT = 5  # what vLLM >= 0.25 forces on XPU when none is given
KILL_WAIT = 5.0  # seconds to wait for SIGKILLed processes before calling them survivors


@dataclass
class Event:
    t: float
    phase: str
    detail: str


@dataclass
class StopResult:
    trees: list[ServerTree]
    events: list[Event]
    verdict: str  # clean | escalated | leftovers
    survivors: list[int]
    holders: list[int]
    stuck: list[tuple[int, str | None]]  # D-state holders and their wchan
    port_busy: list[int]
    members: dict[int, list[int]]  # top pid -> the tree's processes when the ladder began


class _Ladder:
    """The state one run of the ladder shares between its steps (see `stop`)."""

    def __init__(self, host: Host, trees: list[ServerTree], on_event: Callable[[Event], None] | None,
                 poll: float, passive: bool, yield_to: Callable[[], bool] | None,
                 tails: dict[str, LogTail],
                 on_wait: Callable[[Wait | None], None] | None = None) -> None:
        self.host = host
        self.trees = trees
        self.on_event = on_event
        self.on_wait = on_wait
        self.waiting: Wait | None = None
        self.poll = poll
        self.passive = passive
        self.yield_to = yield_to
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self.escalated = False
        self.everyone: dict[int, Target] = {}
        self.first_members: dict[int, list[int]] = {}
        self.pending: list[Target] = []
        self.tails = {id(tree): tails.get(tree.log_path or "") or LogTail(tree.log_path)
                      for tree in trees}
        self.ray_runs: list[tuple[ServerTree, RayRun]] = []
        self.ray_targets: dict[int, Target] = {}  # the runs' actors on this node, identified
        self.ray_left: list[int] = []  # pids (or 0) of actors that outlived everything
        self.signalled: dict[int, bool] = {}  # tops the caller sent SIGTERM already
        self.hurry: Callable[[], None] | None = None  # the caller's hook at each wait

    def emit(self, phase: str, detail: str) -> None:
        ev = Event(round(time.monotonic() - self.t0, 3), phase, detail)
        self.events.append(ev)
        if self.on_event:
            self.on_event(ev)

    def awaiting(self, phase: str, deadline: float, processes: int | None = None,
                 requests: int | None = None) -> None:
        """Tell `on_wait` what the ladder waits for now, when that changed (not part of the
        timeline: a caller draws it as a countdown)."""
        if self.on_wait is None:
            return
        names = ", ".join(dict.fromkeys(t.name for t in self.trees))
        w = Wait(phase, names, deadline, processes, requests)
        if w != self.waiting:
            self.waiting = w
            self.on_wait(w)

    def awaited(self) -> None:
        """Nothing is awaited any more (until the next `awaiting`)."""
        if self.on_wait is not None and self.waiting is not None:
            self.waiting = None
            self.on_wait(None)

    def wait_gone(self, phase: str, targets: list[Target], seconds: float) -> list[Target]:
        """`actions.signals.wait_gone`, in slices when someone is shown the countdown, so
        that the number of processes left is told as it falls."""
        if self.on_wait is None:
            return wait_gone(self.host, targets, seconds, self.poll)
        deadline = time.monotonic() + seconds
        left = survivors(self.host, targets)
        while left:
            self.check_hurry()
            self.awaiting(phase, deadline, processes=len(left))
            left = wait_gone(self.host, left, min(0.25, max(0.0, deadline - time.monotonic())),
                             self.poll)
            if time.monotonic() >= deadline:
                break
        self.awaited()
        return left

    def vllm_lines(self) -> None:
        for tree in self.trees:
            for phase in self.tails[id(tree)].new_phases():
                self.emit("vllm", phase)

    def check_hurry(self) -> None:
        """The caller's hook, between two steps of a wait (never inside a read of the host):
        it may raise to end the ladder there (serve's second Ctrl-C: kill now)."""
        if self.hurry is not None:
            self.hurry()

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
    for line in skipped_lines(ld.host):
        ld.emit("skipped", line)


def skipped_lines(host: Host) -> list[str]:
    """What a command did not act on because a read did not answer (host/reads/):
    nothing is signalled or deleted on the strength of such a read."""
    out = []
    for b in host.blocked_reads():
        whose = f"pid {b.pid}: " if b.pid is not None else ""
        out.append(f"{whose}{b.path} {b.reason}; nothing is done on the strength of it")
    return out


def _find_ray_actors(ld: _Ladder) -> None:
    """A run on an existing Ray cluster: its actors, listed before any signal (its driver's
    pid is what ties them to it)."""
    if not any(getattr(t.record, "ray_cluster", None) not in (None, "local") for t in ld.trees):
        return  # the common case: no Ray run, nothing more to load
    from xpuctl.errors import RayError
    from xpuctl.ray import teardown

    for tree in ld.trees:
        if teardown.cluster_of_record(tree.record) is None:
            continue
        drivers = set(ld.first_members.get(tree.top.pid, []))
        try:
            run = teardown.list_run(tree.record, drivers, dict(os.environ))
        except RayError as exc:
            ld.emit("ray", f"cannot list the run's Ray actors: {exc}")
            ld.ray_left.append(0)  # nothing proven
            continue
        if run is None:
            continue
        ld.ray_runs.append((tree, run))
        nodes = sorted({f"{str(a.get('node_id'))[:8]} ({a.get('ip') or '?'})" for a in run.actors})
        ld.emit("ray", f"{len(run.actors)} Ray actor(s) of {tree.name} on "
                       f"{', '.join(nodes) or 'no node'} ({run.address})")
        for a in run.actors:
            st = stat_of(ld.host, a["pid"]) if a.get("pid") else None
            argv = read_cmdline(ld.host, a["pid"]) if st is not None else []
            if st is not None and argv and argv[0].startswith("ray::"):
                ld.ray_targets[a["pid"]] = Target(a["pid"], st.start_ticks, argv[0])
    # the Ray step owns them: through Ray by name first, by pid only after that
    ld.pending = [t for t in ld.pending if t.pid not in ld.ray_targets]


def _ray_settle(ld: _Ladder) -> None:
    """5a. The runs' actors gone on every node (Ray reaps them once their driver is gone);
    what outlives the teardown budget is killed through Ray, then by pid here."""
    if not ld.ray_runs:
        return
    from xpuctl.ray import teardown

    def kill_pid(actor: dict[str, Any]) -> bool:
        target = ld.ray_targets.get(actor.get("pid") or -1)
        return target is not None and target.send(ld.host, signal.SIGKILL)

    for tree, run in ld.ray_runs:
        budget = float(tree.record.teardown_timeout) if tree.record else float(DEFAULT_SHUTDOWN_TIMEOUT)
        left = teardown.settle(run, budget, kill_pid, ld.emit,
                               passive=ld.passive)
        ld.ray_left.extend(a.get("pid") or 0 for a in left)


def _sigterm_tops(ld: _Ladder) -> None:
    """1. SIGTERM to each top only; a gone top's remains get it at their top-most survivor
    (a SIGTERM to an orphaned EngineCore stops its workers in order)."""
    if ld.passive:
        return
    for tree in ld.trees:
        sent = ld.signalled[tree.top.pid] if tree.top.pid in ld.signalled else \
            tree.top.send(ld.host, signal.SIGTERM)
        if sent:
            ld.emit("sigterm", f"SIGTERM to {tree.role or 'process'} {tree.top.pid} ({tree.name})")
            continue
        ld.emit("gone", f"{tree.top.pid} had already exited")
        rest = [m for m in ld.everyone.values() if m.pid != tree.top.pid]
        for t in topmost(ld.host, rest):
            if "resource_tracker" in t.label:
                continue
            if t.send(ld.host, signal.SIGTERM):
                ld.emit("sigterm", f"SIGTERM to {t.pid} ({t.label}), top of what is left")


def exit_budget(tree: ServerTree) -> float:
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
    phase = waits.TEARDOWN if all(t.never_ready for t in ld.trees) else waits.DRAIN
    if phase == waits.TEARDOWN:
        ld.emit("teardown", f"never ready, nothing to drain: waiting up to {budget:g}s for "
                f"{len(ld.everyone)} process(es) to exit")
    else:
        ld.emit("drain", f"waiting up to {budget:g}s for {len(ld.everyone)} process(es) to exit")
    deadline = time.monotonic() + budget
    last_flight: dict[int, int | None] = {}
    next_probe = 0.0
    while True:
        known = [n for n in last_flight.values() if n is not None]
        if ld.pending:  # gone already (a fast teardown): nothing to count down
            ld.awaiting(phase, deadline, len(ld.pending), sum(known) if known else None)
        ld.pending = wait_gone(ld.host, ld.pending, min(0.25, max(0.0, deadline - time.monotonic())),
                               ld.poll)
        now = time.monotonic()
        ld.vllm_lines()
        if not ld.pending or now >= deadline:
            break
        ld.check_hurry()
        ld.check_yield()
        if now >= next_probe:
            next_probe = now + 0.5
            if phase == waits.DRAIN and ld.on_wait is not None and (
                    (last_flight and not any(last_flight.values()))
                    or not any(not t.never_ready and t.top.alive(ld.host) for t in ld.trees)):
                # no request left, or the tops are gone: what is left is vLLM's teardown
                phase = waits.TEARDOWN
            for tree in ld.trees:
                reach = tree.reach()
                if reach and not tree.orphan and not tree.never_ready and tree.top.alive(ld.host):
                    from xpuctl.host import http  # only when there is a drain to watch

                    n = http.in_flight(reach, 0.3)
                    if n is not None and n != last_flight.get(tree.top.pid):
                        last_flight[tree.top.pid] = n
                        ld.emit("in-flight", f"{n} request(s) running or waiting on :{tree.port}")
    ld.awaited()
    if ld.pending:
        ld.emit("timeout", f"{len(ld.pending)} process(es) still alive after {budget:g}s")


def _late_joiners(ld: _Ladder) -> None:
    """Tagged processes that appeared during the wait join the survivors."""
    for tree in ld.trees:
        for t in members(ld.host, tree):
            if t.pid not in ld.everyone:
                ld.everyone[t.pid] = t
                ld.pending.append(t)
    ld.pending = survivors(ld.host, ld.pending)


def _escalate(ld: _Ladder, kill_after: float, skip_drain: bool) -> None:
    """4. SIGTERM to the survivors, then after `kill_after` SIGKILL (identity re-checked)."""
    ld.check_yield()
    if ld.passive:
        return
    _driver_first(ld, kill_after)
    if ld.pending and kill_after > 0 and not skip_drain:
        ld.escalated = True
        sent = [t for t in reversed(ld.pending) if t.send(ld.host, signal.SIGTERM)]
        if sent:
            ld.emit("sigterm-survivors", "SIGTERM to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        ld.pending = ld.wait_gone(waits.ESCALATION, ld.pending, kill_after)
    if ld.pending:
        ld.escalated = True
        sent = [t for t in reversed(ld.pending) if t.send(ld.host, signal.SIGKILL)]
        if sent:
            ld.emit("sigkill", "SIGKILL to " + ", ".join(f"{t.pid} ({t.label})" for t in sent))
        ld.pending = ld.wait_gone(waits.KILL, ld.pending, KILL_WAIT)


def _driver_first(ld: _Ladder, kill_after: float) -> None:
    """Ray actors among the survivors wait: their driver goes first (SIGTERM, then SIGKILL),
    and Ray reaps a dead driver's actors; only those left after that are signalled."""
    actors = [t for t in ld.pending if t.label.startswith("ray::")]
    others = [t for t in ld.pending if not t.label.startswith("ray::")]
    if not actors or not others:
        return
    ld.escalated = True
    for sig, wait in ((signal.SIGTERM, kill_after), (signal.SIGKILL, KILL_WAIT)):
        sent = [t for t in reversed(others) if t.send(ld.host, sig)]
        if sent:
            ld.emit("sigterm-survivors" if sig == signal.SIGTERM else "sigkill",
                    f"{signal.Signals(sig).name} to " + ", ".join(f"{t.pid} ({t.label})" for t in sent)
                    + " first (Ray reaps a dead driver's actors)")
        others = ld.wait_gone(waits.ESCALATION if sig == signal.SIGTERM else waits.KILL,
                              others, wait)
        if not others:
            break
    ld.pending = others + ld.wait_gone(waits.KILL, actors, KILL_WAIT)


def _running(host: Host, pids: list[int]) -> list[int]:
    """The pids still running, in one call to the host's reader."""
    return [p for p, ok in zip(pids, still_running(host, [(p, None) for p in pids]), strict=True) if ok]


def _await_supervisors(ld: _Ladder, release_timeout: float) -> None:
    """4b. A run's supervisor (serve, or its --detach process) keeps the run's device and port
    locks until it has checked the release itself and exited: wait for it, within the
    release budget, so a serve started right after this shutdown finds them free. Nothing
    is sent to it; our own supervisor (serve stopping its own run) is not waited for."""
    pids = sorted({t.record.supervisor_pid for t in ld.trees
                   if t.record is not None and t.record.supervisor_pid
                   and t.record.supervisor_pid != os.getpid()})
    deadline = time.monotonic() + release_timeout
    waiting = _running(ld.host, pids)
    while waiting and time.monotonic() < deadline:
        ld.awaiting(waits.SUPERVISORS, deadline, len(waiting))
        time.sleep(ld.poll)
        waiting = _running(ld.host, waiting)
    ld.awaited()
    for pid in pids:
        if pid in waiting:
            ld.emit("supervisor", f"supervisor {pid} still runs: the run's locks are still held")
        else:
            ld.emit("supervisor", f"supervisor {pid} exited: the run's locks are free")


def _verify_release(ld: _Ladder, release_timeout: float) -> StopResult:
    """5. Wait until no process holds the trees' devices and their ports are free."""
    ld.vllm_lines()
    if not ld.pending:
        ld.emit("exited", f"all {len(ld.everyone)} process(es) are gone")
    devices = sorted({b for t in ld.trees for b in t.devices})
    ports = sorted({t.port for t in ld.trees if t.port})
    deadline = time.monotonic() + release_timeout
    while True:
        scan = take_scan(ld.host, port=None, want_env=False, artifacts=False)
        holders = sorted({pid for b in devices for pid in scan.holders(b)})
        unknown = sorted({pid for b in devices for pid in scan.unknown_holders(b)})
        busy_ports = sorted({s.port for s in listening_sockets(ld.host) if s.port in ports}) if ports else []
        if (not holders and not busy_ports) or time.monotonic() >= deadline:
            break
        ld.awaiting(waits.RELEASE, deadline, len(holders))
        time.sleep(0.1)
    ld.awaited()
    stuck = [(p.pid, p.wchan) for p in scan.processes if p.pid in holders and p.state == "D"]
    holders = sorted(set(holders) | set(unknown))
    if devices:
        if unknown:
            ld.emit("unknown", f"{', '.join(devices)} may be held by {', '.join(map(str, unknown))}, "
                    "which did not answer a read: release not verified")
        if holders:
            ld.emit("holders", f"{', '.join(devices)} still held by {', '.join(map(str, holders))}")
        else:
            ld.emit("released", f"{', '.join(devices)} released")
    if busy_ports:
        ld.emit("port", f"port(s) {', '.join(map(str, busy_ports))} still in use")
    for pid, wchan in stuck:
        ld.emit("stuck", f"{pid} is in D state in {wchan or '?'}")
    left = [t.pid for t in survivors(ld.host, ld.pending)] + [p for p in ld.ray_left if p]
    leftovers = bool(left or holders or busy_ports or ld.ray_left)
    verdict = "leftovers" if leftovers else ("escalated" if ld.escalated else "clean")
    ld.emit("verdict", verdict)
    return StopResult(ld.trees, ld.events, verdict, left, holders, stuck, busy_ports,
                      ld.first_members)


def stop(
    host: Host,
    trees: list[ServerTree],
    timeout: float | None = None,
    kill_after: float = 10.0,
    release_timeout: float = 30.0,
    on_event: Callable[[Event], None] | None = None,
    skip_drain: bool = False,
    poll: float = 0.05,
    passive: bool = False,
    yield_to: Callable[[], bool] | None = None,
    signalled: dict[int, bool] | None = None,
    tails: dict[str, LogTail] | None = None,
    on_wait: Callable[[Wait | None], None] | None = None,
    hurry: Callable[[], None] | None = None,
) -> StopResult:
    """Run the ladder on `trees`, step by step (each step a function named for what it
    does; the events it emits are the timeline): `_find_members`, `_find_ray_actors`,
    `_sigterm_tops`, `_wait_exit`, `_late_joiners`, `_escalate`, `_ray_settle`,
    `_await_supervisors`, `_verify_release`.

    `timeout` overrides `exit_budget`. `passive`: send nothing, only wait and verify
    (someone else is already stopping them); `yield_to()` returning True turns passive
    midway. `skip_drain`: no SIGTERM and no wait, straight to SIGKILL. `signalled`: tops
    already sent their SIGTERM by the caller (top pid -> whether it was sent), before the
    members were listed: step 1 does not send to them again; `tails`: their logs, read from
    before that signal on (by log path). `on_wait` hears what each wait is for and its
    deadline as it changes, and None when it ends (core/waits.py: a caller's countdown).
    `hurry()` is called between the steps of each wait: it may raise to end the ladder there
    (at a point where no read of the host is half done)."""
    ld = _Ladder(host, trees, on_event, poll, passive, yield_to, tails or {}, on_wait)
    ld.signalled = dict(signalled or {})
    ld.hurry = hurry
    _find_members(ld)
    if not ld.signalled:  # else the caller reached it, before its signal
        pausepoint.reached("shutdown-found")
    _find_ray_actors(ld)
    if not skip_drain:
        _sigterm_tops(ld)
        _wait_exit(ld, timeout)
    _late_joiners(ld)
    _escalate(ld, kill_after, skip_drain)
    _late_joiners(ld)  # spawned while the others were signalled (a start cut short): they
    if ld.pending:     # are the run's too, and go the same way, at once
        _escalate(ld, 0, True)
    _ray_settle(ld)
    if not passive:
        _await_supervisors(ld, release_timeout)
    return _verify_release(ld, release_timeout)


