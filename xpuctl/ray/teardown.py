"""The Ray part of stopping a run on an existing cluster (shutdown, reset, serve's own stop).

Before the first signal, the run's actors are listed (the jobs whose driver is one of the
run's processes: its EngineCore). After the ladder stopped the driver (Ray reaps the actors
of a dead driver), `settle` proves them gone on every node; those still alive after the
teardown budget are killed through Ray by name (named actors, and only of the run's jobs),
then by pid on this node with the usual identity check. Never `ray stop`, never the
cluster's raylet or GCS, never another job's actor. Every ray.kill is in the audit log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from xpuctl.errors import RayError
from xpuctl.host.programs import interpreter_of
from xpuctl.ray import bridge
from xpuctl.ray.launch import LOCAL, actors_of
from xpuctl.state import audit

POLL = 0.5


class _Passive(Exception):
    """Watching only: nothing is sent."""


class RayRun(NamedTuple):
    """One run's actors on a cluster, as listed before any signal."""

    address: str
    python: str
    environ: dict[str, str]
    actors: list[dict[str, Any]]  # actor_id, name, namespace, job_id, node_id, ip, pid


def cluster_of_record(record: Any) -> str | None:
    cluster = getattr(record, "ray_cluster", None) if record is not None else None
    return cluster if cluster and cluster != LOCAL else None


def list_run(record: Any, driver_pids: set[int], environ: dict[str, str]) -> RayRun | None:
    """The run's actors (None when it is not a run on an existing cluster); RayError when
    the cluster cannot be asked."""
    address = cluster_of_record(record)
    if address is None:
        return None
    python = bridge.ray_python(environ, interpreter_of(list(record.command or [])))
    state = bridge.call("state", {}, address, python, timeout=15.0, environ=environ)
    return RayRun(address, python, environ, actors_of(state, driver_pids))


def alive(run: RayRun) -> list[dict[str, Any]]:
    """The run's actors Ray still lists as alive."""
    state = bridge.call("state", {}, run.address, run.python, timeout=15.0, environ=run.environ)
    ids = {a.get("actor_id") for a in state.get("actors", [])}
    return [a for a in run.actors if a["actor_id"] in ids]


def wait_gone(run: RayRun, seconds: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + seconds
    left = alive(run)
    while left and time.monotonic() < deadline:
        time.sleep(POLL)
        left = alive(run)
    return left


def kill_named(run: RayRun, actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ray.kill each named actor, checked to be of its job; unnamed ones are left to the pid
    step. Audited, one line per actor."""
    named = [a for a in actors if a.get("name")]
    if not named:
        return []
    answer = bridge.call("kill", {"actors": [{"name": a["name"], "namespace": a.get("namespace"),
                                              "job_id": a.get("job_id")} for a in named]},
                         run.address, run.python, timeout=20.0, environ=run.environ)
    by_name = {r.get("name"): r for r in answer.get("actors", [])}
    for a in named:
        r = by_name.get(a["name"], {})
        audit.record("ray-kill", {"actor_id": a["actor_id"], "name": a["name"],
                                  "job_id": a.get("job_id"), "node_id": a.get("node_id"),
                                  "pid": a.get("pid"), "address": run.address},
                     "sent" if r.get("killed") else f"not sent: {r.get('reason', 'no answer')}")
    return [a for a in named if by_name.get(a["name"], {}).get("killed")]


def settle(run: RayRun, budget: float, kill_pid: Callable[[dict[str, Any]], bool],
           emit: Callable[[str, str], None], passive: bool = False) -> list[dict[str, Any]]:
    """After the driver was stopped: wait `budget` for Ray to reap the actors, then ray.kill
    by name, then SIGKILL by pid on this node (`kill_pid` checks identity and audits).
    `passive`: someone else is stopping the run: only wait and look. Returns the actors
    still alive (the run's leftovers)."""
    try:
        left = wait_gone(run, budget)
        if not left:
            emit("ray-gone", f"all {len(run.actors)} Ray actor(s) of the run are gone")
            return []
        if passive:
            raise _Passive
        killed = kill_named(run, left)
        if killed:
            emit("ray-kill", "ray.kill " + ", ".join(a["name"] for a in killed))
            left = wait_gone(run, 5.0)
        by_pid = [a for a in left if a.get("pid") and kill_pid(a)]
        if by_pid:
            emit("sigkill", "SIGKILL to Ray actor(s) " + ", ".join(str(a["pid"]) for a in by_pid))
            left = wait_gone(run, 5.0)
    except _Passive:
        pass
    except RayError as exc:
        emit("ray", f"cannot prove the run's Ray actors gone: {exc}")
        return list(run.actors)
    if left:
        emit("ray-actors", "still alive: " + ", ".join(
            f"{a.get('name') or a['actor_id']} (pid {a.get('pid')}, node {str(a.get('node_id'))[:8]})"
            for a in left))
    else:
        emit("ray-gone", f"all {len(run.actors)} Ray actor(s) of the run are gone")
    return left

