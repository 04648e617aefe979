"""Group vLLM processes into server trees and find orphans (pure functions).

A tree's top is its top-most vLLM ancestor. A server is *live* while that top is an API
server (`vllm serve`, `-m vllm.entrypoints.openai.api_server`, `VLLM::APIServer_*`).

Any other tree belongs to the process that launched its top, while that process lives: vLLM
run as a library (`LLM(...)` in a script, an AsyncLLM inside an app, a Ray Serve replica)
has the same `VLLM::EngineCore` and `VLLM::Worker` titles under a parent that is no API
server. Such a tree is **embedded** in its launcher (`Placement.owner`) and is never an
orphan. An engine-core, worker, coordinator or resource tracker is an **orphan** only when
its launcher is gone (`launcher`): reparented to init or to a subreaper, its parent a zombie,
or its parent pid now naming a process younger than itself (the pid was reused). It keeps the
GPU and its memory, and nothing will ever stop it.

Processes tagged with the same XPUCTL_RUN_ID belong to the same run even when they left the
process tree (double fork, setsid: `xpuctl serve` is a subreaper, they are reparented to it),
while its API server lives, but only a tag a live run's record vouches for (`Member.run_id`,
proved by host/scan): any process can put the variable in its environment.

A run whose API server died while its supervisor lives is **being stopped** by that
supervisor (`ending`: run id -> run name, from host/scan): it stops what is left of the
tree itself (serve/supervise: the ladder, from the moment it reaps its API server). Its
processes are placed as that run's (`Placement.stopping_by`), never orphans, at every moment
of that window: while the dead API server is still an unreaped zombie, once the supervisor
reaped it and adopted them (a subreaper: their parent is then the supervisor, which is not
their launcher), and while they drain. Once the supervisor is gone too, nothing will stop
them: they are orphans, judged as any other tree.

An orphan's parent is a reaper, and a reaper is a launcher only when it runs vLLM itself:
PID 1, and the init of any PID namespace (a container's, seen from the host with another
pid: `Member.ns_init`, NSpid in /proc/PID/status ends in 1).

Ray (docs/ray.md): the path from a Ray actor up to its run goes through Ray's own
processes (actor -> raylet -> EngineCore when the run started its own Ray). Ray's processes are
part of a run only under one of its vLLM processes (then they go with its tree, orphaned with
it); a cluster's own (top-most is a Ray process) are never orphans. A `ray::RayWorkerProc`
actor whose way up ends in a cluster's raylet is left unplaced here: only Ray's state can tie
it to its driver (xpuctl.ray.actors).
"""

from __future__ import annotations

from typing import NamedTuple

from xpuctl.parse.roles import (
    API_SERVER,
    ENGINE_CORE,
    RAY,
    RAY_WORKER_CANDIDATE,
    RESOURCE_TRACKER,
    SPAWN_CANDIDATE,
    TRACKER_CANDIDATE,
    WORKER,
)


class Member(NamedTuple):
    """A process as the trees need it: every vLLM process (or candidate), every device
    holder, and the parent of each (the launcher of vLLM run as a library)."""

    pid: int
    ppid: int
    session: int
    role: str | None  # may be a candidate (tracker?/spawn?)
    run_id: str | None  # its XPUCTL_RUN_ID, only when a live run's record vouches for it
    zombie: bool = False  # holds nothing; never a live server, never an orphan
    pgrp: int = 0
    start_ticks: int = 0  # /proc/<pid>/stat field 22: with the pid, the process's identity
    blocked: bool = False  # a read of it did not answer: alive, what it is unknown
    # vLLM's or torch's libraries are mapped in it (read for PID 1 and namespace inits only:
    # init, a container's non-reaping PID 1, or the program there that runs vLLM as a library)
    runs_vllm: bool = False
    # the init of a PID namespace (pid 1 in its own namespace: NSpid ends in 1), read for the
    # parents of vLLM processes only; PID 1 of the namespace the scan sees is one by its pid
    ns_init: bool = False


class Placement(NamedTuple):
    role: str
    top: int
    orphan: bool
    owner: int | None = None  # the live non-vLLM process the tree is embedded in
    # the run whose live supervisor is stopping it (its API server is gone): never an orphan
    stopping_by: str | None = None


def resolve(members: dict[int, Member],
            ending: dict[str, str] | None = None) -> dict[int, Placement]:
    """Role, tree top and orphan flag of every vLLM process among `members`. `ending`: the
    runs (id -> name) whose API server is gone while their supervisor lives and stops them."""
    roles = _roles(members)
    tops = _tops(members, roles)
    return _placements(members, roles, tops, ending or {})


def _roles(members: dict[int, Member]) -> dict[int, str]:
    """The vLLM (and Ray) roles: the recognised ones, then generic multiprocessing children
    that are vLLM's because their parent, run or session is."""
    roles: dict[int, str] = {
        pid: WORKER if m.role == RAY_WORKER_CANDIDATE else m.role
        for pid, m in members.items()
        if m.role is not None and m.role not in (TRACKER_CANDIDATE, SPAWN_CANDIDATE)
    }
    vllm_sessions = {members[p].session for p, r in roles.items() if r != RAY}
    vllm_runs = {members[p].run_id for p, r in roles.items() if members[p].run_id and r != RAY}
    changed = True
    while changed:
        changed = False
        for pid, m in members.items():
            if pid in roles or m.role not in (TRACKER_CANDIDATE, SPAWN_CANDIDATE):
                continue
            parent_role = roles.get(m.ppid)
            if parent_role == RAY:
                parent_role = None  # Ray's dashboard has multiprocessing children of its own
            related = (
                parent_role is not None
                or (m.run_id is not None and m.run_id in vllm_runs)
                # a tracker that outlived its API server was reparented to init (or to a PID
                # namespace's); only then does sharing a session tie it to vLLM (in a
                # container, everything shares one)
                or (m.role == TRACKER_CANDIDATE and m.session in vllm_sessions
                    and (m.ppid <= 1 or (m.ppid in members and members[m.ppid].ns_init)))
            )
            if not related:
                continue
            if m.role == TRACKER_CANDIDATE:
                roles[pid] = RESOURCE_TRACKER
            elif parent_role == API_SERVER:
                roles[pid] = ENGINE_CORE
            else:
                roles[pid] = WORKER
            changed = True
    return roles


def _tops(members: dict[int, Member], roles: dict[int, str]) -> dict[int, int]:
    """Each process's top-most vLLM ancestor; a resource tracker that outlived its API server
    (ppid 1 or a subreaper) goes to the tree that shares its run id or session."""

    def top_of(pid: int) -> int:
        seen = {pid}
        cur = pid
        while True:
            parent = members[cur].ppid
            if (parent in roles and parent not in seen and not members[parent].zombie
                    and members[parent].start_ticks <= members[cur].start_ticks):
                seen.add(parent)
                cur = parent
            else:  # no vLLM parent, or its pid names a younger process now: the top
                return cur

    tops = {pid: top_of(pid) for pid in roles}
    for pid, role in roles.items():
        if role != RESOURCE_TRACKER or tops[pid] != pid:
            continue
        m = members[pid]
        kin = sorted(
            tops[o]
            for o, r in roles.items()
            if o != pid
            and r not in (RESOURCE_TRACKER, RAY)
            and (
                (m.run_id is not None and members[o].run_id == m.run_id)
                or members[o].session == m.session
            )
        )
        if kin:
            tops[pid] = kin[0]
    return tops


def launcher(members: dict[int, Member], pid: int) -> int | None:
    """The live process that launched `pid`, when its parent still is that process; None when
    the launcher is gone.

    The parent is the launcher unless the kernel reparented `pid` to it, and /proc says that
    only indirectly: a child keeps the session and process group it was started in, while a
    reaper (init, a container's PID 1, a child subreaper such as `systemd --user`,
    containerd-shim, tini or `xpuctl serve`) runs in a session or group of its own. So the
    parent is its launcher when it is alive (a zombie is gone), started no later than it (a
    younger one got the pid of a launcher that died), and shares its session and group, or
    `pid` leads a session or group of its own (started with setsid or setpgid). PID 1 adopts
    what any dead launcher in its namespace left, and a container's PID 1 may have started
    that launcher in its own session and group: it is a launcher only when it runs vLLM
    itself (its libraries are mapped in it: the program a container runs, `LLM(...)` in it)
    and shares both, each seen in this PID namespace (0: led outside it). The init of a
    container's PID namespace adopts the same way (seen from the host it is not pid 1, and
    the orphan shares its session and group: the container's): a launcher on the same
    terms, never by sharing them alone. A parent that did not
    answer a read may be anything: it is presumed alive and the launcher (never an orphan on
    the strength of a read that did not answer)."""
    m = members[pid]
    parent = members.get(m.ppid)
    if m.ppid > 0 and parent is not None and parent.blocked:
        return m.ppid  # it did not answer a read: nothing is judged on it, it may launch it
    if m.ppid <= 0 or parent is None or parent.zombie or parent.start_ticks > m.start_ticks:
        return None
    same = m.session == parent.session and m.pgrp == parent.pgrp
    if m.ppid == 1 or parent.ns_init:
        return m.ppid if same and m.session > 0 and m.pgrp > 0 and parent.runs_vllm else None
    if same or m.session == pid or m.pgrp == pid:
        return m.ppid
    return None  # adopted: its session and group are those of a launcher that is gone


def _placements(members: dict[int, Member], roles: dict[int, str], tops: dict[int, int],
                ending: dict[str, str]) -> dict[int, Placement]:
    live_tops = {
        members[t].run_id: t
        for t in sorted(set(tops.values()))
        if roles[t] == API_SERVER and members[t].run_id and not members[t].zombie
    }
    owners = {t: launcher(members, t) for t in set(tops.values())
              if roles[t] not in (API_SERVER, RAY) and not members[t].zombie}
    out: dict[int, Placement] = {}
    for pid, role in roles.items():
        top = tops[pid]
        untied = roles[top] == RAY or top == pid
        if (role != RAY and roles[top] == RAY) or (
            members[pid].role == RAY_WORKER_CANDIDATE and untied
            and members[pid].run_id not in live_tops
        ):
            continue  # a cluster's actor: tied through Ray's state, if at all
        if role == RAY and roles[top] == RAY:
            out[pid] = Placement(role=RAY, top=top, orphan=False)  # a cluster's own
            continue
        live = roles[top] == API_SERVER and not members[top].zombie
        owner = None
        run_id = members[pid].run_id
        if not live and run_id is not None and run_id in ending:
            # its API server is gone, its run's supervisor lives and is stopping the rest
            out[pid] = Placement(role=role, top=top, orphan=False, stopping_by=ending[run_id])
            continue
        if not live and run_id in live_tops:
            top = live_tops[members[pid].run_id]  # left the tree, but its server is alive
            live = True
        elif not live:
            owner = owners.get(top)
            live = owner is not None  # vLLM as a library: its launcher owns it
        orphan = not live and role != API_SERVER and not members[pid].zombie
        out[pid] = Placement(role=role, top=top, orphan=orphan, owner=owner)
    return out
