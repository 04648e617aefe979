"""The runs still running: records that say starting, ready or stopping, checked against /proc.

A record that says starting, ready or stopping while neither its vLLM top process nor its
supervisor lives is **stale**: the run is gone (its supervisor was SIGKILLed, the host
rebooted under a persistent state directory) and the record was never told. `ps` shows
such a run as `stale`, `shutdown NAME` says the run is gone, and doctor warns
(`run-records`), with the records that could not be read at all.
"""

from __future__ import annotations

import os
import stat
import time
from typing import NamedTuple

from xpuctl.core.runrecords import RecordedRun, RecordIssue, RunHealth, RunRow, Unread
from xpuctl.errors import UsageError
from xpuctl.host.processes import same_process
from xpuctl.host.seam import Host
from xpuctl.state.regular import kind_of
from xpuctl.state.runs import (
    ACTIVE_STATES,
    RunRecord,
    ensure_state_dir,
    list_records,
    read_runs,
    state_shown,
)
from xpuctl.state.statedir import ROOT_STATE_DIR

STALE = "stale"  # the state shown for a record whose run is gone


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
                    tuple(str(d) for d in r.devices or ()), r.name)
        for r in records if r.state in ACTIVE_STATES and isinstance(r.run_id, str) and r.run_id
    )


def run_alive(host: Host, rec: RunRecord) -> bool:
    """The run's supervisor or its vLLM top process is still running.

    The supervisor's start time is not recorded, but it started before vLLM did: a process
    under its pid that started later is another process."""
    if rec.pid and rec.start_ticks is not None and same_process(host, rec.pid, rec.start_ticks):
        return True
    if not rec.supervisor_pid:
        return False
    sup = same_process(host, rec.supervisor_pid)
    if sup is None:
        return False
    return rec.start_ticks is None or sup.start_ticks <= rec.start_ticks


def is_stale(host: Host, rec: RunRecord) -> bool:
    """The record says the run is active, and nothing of it runs."""
    return rec.state in ACTIVE_STATES and not run_alive(host, rec)


def _row(host: Host, r: RunRecord, now: float) -> RunRow:
    def alive(pid: int, ticks: int) -> bool:
        return pid > 0 and same_process(host, pid, ticks) is not None

    age = now - r.started_at if r.started_at else None
    if not run_alive(host, r):
        return RunRow(r.name, STALE, age, r.pid, r.port, tuple(r.devices), r.run_id, r.state,
                      r.health, r.exit_code)
    shown = state_shown(r, alive)  # an abandoned stop is not one
    return RunRow(r.name, shown, age, r.pid, r.port, tuple(r.devices), r.run_id, None, r.health,
                  r.exit_code)


def live_runs(host: Host, state_dir: str) -> list[RunRow]:
    """The records that say starting, ready or stopping and whose API server or supervisor
    still runs (a record left by a killed supervisor is not a run)."""
    rows = [_row(host, r, time.time()) for r in active_records(state_dir)]
    return [r for r in rows if r.state != STALE]


class RunsShown(NamedTuple):
    """What `ps` lists of the state directory: its active runs (stale ones said so), and the
    records (or directories of records) it could not read."""

    rows: list[RunRow]
    unread: list[Unread]


def runs_shown(host: Host, state_dir: str, euid: int | None = None) -> RunsShown:
    """The active runs of `state_dir`, stale ones included as `stale`, and what could not be
    read. Not root (`euid`): root's own state directory too, when it is another one: its
    runs are this host's, and when it may not be listed the listing says so."""
    euid = os.geteuid() if euid is None else euid
    dirs = [state_dir]
    if euid != 0 and os.path.abspath(state_dir) != ROOT_STATE_DIR and os.path.isdir(ROOT_STATE_DIR):
        dirs.append(ROOT_STATE_DIR)
    rows: list[RunRow] = []
    unread: list[Unread] = []
    now = time.time()
    for d in dirs:
        found = read_runs(d)
        rows += [_row(host, r, now) for r in found.records if r.state in ACTIVE_STATES]
        unread += found.unread
    return RunsShown(rows, unread)


def record_issues(host: Host, state_dir: str) -> tuple[RecordIssue, ...]:
    """doctor's view of the state directory's records: the stale ones, and those that could
    not be read (damaged, or not ours to read)."""
    found = read_runs(state_dir)
    out = [RecordIssue(u.path, u.name, "damaged" if u.damaged else "unreadable", u.why)
           for u in found.unread]
    for sub in ("locks", "logs"):  # serve refuses a state directory where one is a file
        path = os.path.join(state_dir, sub)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISDIR(mode):
            out.append(RecordIssue(path, None, "damaged", f"{kind_of(mode)}, not a directory"))
    for r in found.records:
        if is_stale(host, r):
            out.append(RecordIssue(os.path.join(state_dir, "runs", f"{r.name}.json"), r.name,
                                   STALE, f"it says {r.state}, but neither its vLLM process "
                                   "nor its supervisor runs"))
    return tuple(out)


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
