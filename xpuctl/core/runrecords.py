"""Typed records of what the state directory says of serve's runs: a run and its age for
`xpuctl ps`, its recorded health (serve's watch, core/watch.py), the records doctor warns about
and those that could not be read. No I/O."""

from __future__ import annotations

import math
from typing import NamedTuple


class RecordedRun(NamedTuple):
    """A live run as its record names it (state/runs): the proof an `XPUCTL_RUN_ID` tag needs.
    A tag counts only on the recorded process (pid and start ticks), on its supervisor's
    descendants while that supervisor lives, or on the recorded process's descendants."""

    run_id: str
    pid: int | None  # the process serve launched (the top)
    start_ticks: int | None  # and its start, in clock ticks since boot
    supervisor_pid: int | None
    devices: tuple[str, ...] = ()  # the BDFs the run claimed
    name: str | None = None  # the run's name (what `xpuctl ps` and doctor call it)


class RecordIssue(NamedTuple):
    """A run record of the state directory that doctor warns about (state/live)."""

    path: str
    name: str | None  # the run's name; None: the directory of records itself
    kind: str  # "stale" (its run is gone) | "damaged" (no record) | "unreadable" (EACCES)
    detail: str


class Health(NamedTuple):
    """A run's health as serve's watch last judged it: the run record's `health` field
    (core/watch.py judges it; docs/serve-exits.md)."""

    state: str  # starting | healthy | sleeping | unhealthy | stalled | exited (API server gone)
    since: float  # wall-clock seconds: when the run entered `state`
    reason: str | None  # unhealthy or stalled: why, starting "unhealthy:" or "stalled:"
    checked_at: float  # wall-clock seconds of the watch's last check
    interval: float  # seconds between checks: a check older than three of them proves nothing

    def to_dict(self) -> dict[str, str | float | None]:
        return dict(self._asdict())

    @classmethod
    def from_dict(cls, data: object) -> Health | None:
        """The field as a record holds it; None when it is missing or malformed (a record of
        an xpuctl without the watch has none)."""
        if not isinstance(data, dict):
            return None
        state, reason = data.get("state"), data.get("reason")
        if not isinstance(state, str) or not (reason is None or isinstance(reason, str)):
            return None
        numbers: list[float] = []
        for key in ("since", "checked_at", "interval"):
            n = data.get(key)
            if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
                return None
            numbers.append(float(n))
        return cls(state, numbers[0], reason, numbers[1], numbers[2])


class RunRow(NamedTuple):
    """One run for `xpuctl ps`: its record's state and its age (state/live.py)."""

    name: str
    state: str  # starting | ready | stopping | stale (the record says one of those: gone)
    age_seconds: float | None  # since launch
    pid: int | None
    port: int | None  # None: a unix socket's run (serve --uds)
    devices: tuple[str, ...]
    run_id: str
    recorded_state: str | None = None  # a stale run: the state its record still says
    health: Health | None = None  # serve's watch: its last verdict and check (core/watch.py)
    exit_code: int | None = None  # vLLM's own exit status, once it exited (serve's is apart)


class Unread(NamedTuple):
    """A run record (or the directory of records) that could not be read: where, and why
    (state/runs.py)."""

    path: str
    name: str | None  # the run's name from the file's name; None: the directory itself
    why: str  # "a FIFO", "not JSON: ...", "field 'pid' is a string, not int | None", ...
    damaged: bool  # True: what is there is no record; False: it could not be read (EACCES)

    def line(self) -> str:
        if self.name is None:
            return f"the runs in {self.path} cannot be listed: {self.why}"
        what = "damaged" if self.damaged else "not readable"
        return f"run record {self.path} is {what}: {self.why}"


class RunHealth(NamedTuple):
    """A live run and its recorded health, for doctor (read from the state directory)."""

    name: str
    state: str  # the record's: starting | ready | stopping
    devices: tuple[str, ...]
    health: Health | None
