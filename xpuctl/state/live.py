"""The runs still running: records that say starting, ready or stopping, checked against /proc."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

from xpuctl.core.model import RecordedRun
from xpuctl.host.processes import same_process
from xpuctl.host.seam import Host
from xpuctl.state.runs import ACTIVE_STATES, RunRecord, list_records, state_shown


def active_records(state_dir: str) -> list[RunRecord]:
    return [r for r in list_records(state_dir) if r.state in ACTIVE_STATES]


def recorded_runs(state_dir: str | None) -> tuple[RecordedRun, ...]:
    """What the records of the runs that may still run (starting, ready, stopping) say of
    their processes: the proof a scan needs before it counts an XPUCTL_RUN_ID tag
    (host/scan). No state directory: no run, no tag counts."""
    if not state_dir or not os.path.isdir(state_dir):
        return ()
    return recorded(list_records(state_dir))


def recorded(records: list[RunRecord]) -> tuple[RecordedRun, ...]:
    """`recorded_runs` of records already read (those not active are left out)."""
    return tuple(
        RecordedRun(r.run_id, r.pid, r.start_ticks, r.supervisor_pid,
                    tuple(str(d) for d in r.devices or ()))
        for r in records if r.state in ACTIVE_STATES and isinstance(r.run_id, str) and r.run_id
    )


class RunRow(NamedTuple):
    """One run for `xpuctl ps`: its record's state and its age."""

    name: str
    state: str  # starting | ready | stopping
    age_seconds: float | None  # since launch
    pid: int | None
    port: int
    devices: tuple[str, ...]
    run_id: str


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
        out.append(RunRow(r.name, shown, age, r.pid, r.port, tuple(r.devices), r.run_id))
    return out
