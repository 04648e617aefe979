"""The runs still running: records that say starting, ready or stopping, checked against /proc."""

from __future__ import annotations

import time
from typing import NamedTuple

from xpuctl.core.model import Health, RunHealth
from xpuctl.errors import UsageError
from xpuctl.host.processes import same_process
from xpuctl.host.seam import Host
from xpuctl.state.runs import (
    ACTIVE_STATES,
    RunRecord,
    ensure_state_dir,
    list_records,
    state_shown,
)


def active_records(state_dir: str) -> list[RunRecord]:
    return [r for r in list_records(state_dir) if r.state in ACTIVE_STATES]


class RunRow(NamedTuple):
    """One run for `xpuctl ps`: its record's state and its age."""

    name: str
    state: str  # starting | ready | stopping
    age_seconds: float | None  # since launch
    pid: int | None
    port: int
    devices: tuple[str, ...]
    run_id: str
    health: Health | None = None  # serve's watch: its last verdict and check (core/watch.py)


def live_runs(host: Host, state_dir: str) -> list[RunRow]:
    """The records that say starting, ready or stopping and whose API server or supervisor
    still runs (a record left by a killed supervisor is not a run)."""

    def alive(pid: int | None, ticks: int | None = None) -> bool:
        return pid is not None and pid > 0 and same_process(host, pid, ticks) is not None

    now = time.time()
    out = []
    for r in active_records(state_dir):
        if not (alive(r.pid, r.start_ticks) or alive(r.supervisor_pid)):
            continue
        age = now - r.started_at if r.started_at else None
        shown = state_shown(r, alive)  # an abandoned stop is not one
        out.append(RunRow(r.name, shown, age, r.pid, r.port, tuple(r.devices), r.run_id,
                          r.health))
    return out


def run_healths(host: Host, state_dir: str | None) -> tuple[RunHealth, ...]:
    """The live runs of the state directory with their recorded health (doctor); none when
    the directory is not one to trust (not ours, or writable by others: ensure_state_dir)."""
    if not state_dir or not host.proc_is_live:
        return ()
    try:
        state_dir = ensure_state_dir(state_dir, create=False)
    except UsageError:
        return ()
    return tuple(RunHealth(r.name, r.state, r.devices, r.health) for r in live_runs(host, state_dir))
