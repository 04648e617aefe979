"""Run records and device locks in the state directory.

State directory (found by state/statedir): created 0700; refused when owned by
someone else or writable by group/others (a shared /tmp must not let another user forge a
run record that makes root signal an arbitrary pid). Records are written atomically
(temp file + rename). Locks are flock()s held by the supervising process for the whole run,
so they vanish with it, even after SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from xpuctl.core.model import Health
from xpuctl.errors import LockedError, UsageError
from xpuctl.state import atomic
from xpuctl.state.flock import flock_within

ACTIVE_STATES = ("starting", "ready", "stopping")  # a run that may still have processes
STATES = (*ACTIVE_STATES, "stopped", "failed")


def ensure_state_dir(path: str, create: bool = True) -> str:
    """Create (0700) or validate the state directory. UsageError when unsafe."""
    path = os.path.abspath(path)
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"state directory {path}: {exc.strerror or exc}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise UsageError(f"state directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"state directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UsageError(
            f"state directory {path} is owned by uid {st.st_uid}, not {os.geteuid()}; refusing it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UsageError(
            f"state directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            "refusing it"
        )
    for sub in ("runs", "locks", "logs"):
        os.makedirs(os.path.join(path, sub), mode=0o700, exist_ok=True)
    return path


@dataclass
class RunRecord:
    name: str
    run_id: str
    pid: int | None
    start_ticks: int | None
    session: int | None
    command: list[str]
    devices: list[str]
    port: int
    bind: str  # vLLM's bind address (--host); records written before it was named say "host"
    shutdown_timeout: int | None
    drain_timeout: float
    teardown_timeout: float
    log_path: str
    state: str = "starting"
    exit_code: int | None = None
    supervisor_pid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None  # when /health and /v1/models first answered
    stopped_at: float | None = None
    notes: list[str] = field(default_factory=list)
    # [pid, start ticks] of the process that set state "stopping" (a shutdown, or the
    # supervisor itself): a stopper that died (SIGKILL) is stopping nothing (stop_abandoned)
    stopping_by: list[int] | None = None
    # vLLM on Ray: the cluster (its address, or "local": a Ray of the run's own) and the nodes
    # its actors run on ([{node_id, ip, actors}]), noted once the run is ready
    ray_cluster: str | None = None
    ray_nodes: list[dict[str, Any]] = field(default_factory=list)
    # a failed run: why, in one line, and the last lines vLLM wrote (an exit nobody asked for,
    # even with code 0, is a failure: vLLM can exit 0 after its engine died)
    reason: str | None = None
    last_lines: list[str] = field(default_factory=list)
    # serve's liveness watch: its last verdict and when it checked (core/watch.py); None in
    # a record of an xpuctl without the watch
    health: Health | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["health"] = self.health.to_dict() if self.health is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        known = set(cls.__dataclass_fields__)
        if "bind" not in data and "host" in data:  # a record of an earlier xpuctl
            data = {**data, "bind": data["host"]}
        data = {**data, "health": Health.from_dict(data.get("health"))}
        return cls(**{k: v for k, v in data.items() if k in known})


def stop_abandoned(rec: RunRecord, alive: Callable[[int, int], bool]) -> bool:
    """The record says "stopping" but the process that said so is gone: nobody is stopping
    the run. `alive(pid, start_ticks)` says whether that very process still runs. A record
    without `stopping_by` (written before it existed) is believed."""
    if rec.state != "stopping" or not rec.stopping_by or len(rec.stopping_by) != 2:
        return False
    pid, ticks = rec.stopping_by
    return not alive(int(pid), int(ticks))


def state_shown(rec: RunRecord, alive: Callable[[int, int], bool]) -> str:
    """The state to report: an abandoned "stopping" is the state it interrupted."""
    if stop_abandoned(rec, alive):
        return "ready" if rec.ready_at is not None else "starting"
    return rec.state


def _record_path(state_dir: str, name: str) -> str:
    return os.path.join(state_dir, "runs", f"{name}.json")


def write_record(state_dir: str, rec: RunRecord) -> None:
    atomic.replace(_record_path(state_dir, rec.name), json.dumps(rec.to_dict(), indent=2).encode())


#: Seconds update_record waits for the record's lock (others hold it for a read-modify-write).
RECORD_LOCK_WAIT = 2.0


def update_record(state_dir: str, rec: RunRecord, **changes: Any) -> RunRecord:
    """Apply `changes` to the record on disk (read-modify-write under a lock), so the
    supervisor and a `shutdown` never overwrite each other's fields. Returns the result;
    `rec` is updated too. TimeoutError (an OSError) when the lock is not free within
    RECORD_LOCK_WAIT: its holder is stopped or stuck, and a shutdown must not wait for it."""
    for k, v in changes.items():
        setattr(rec, k, v)
    lock = os.path.join(state_dir, "runs", f".{rec.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not flock_within(fd, fcntl.LOCK_EX, RECORD_LOCK_WAIT):
            raise TimeoutError(errno.ETIMEDOUT, f"the lock of run {rec.name!r} is held", lock)
        disk = read_record(state_dir, rec.name)
        if disk is None or disk.run_id != rec.run_id:
            disk = rec
        for k, v in changes.items():
            setattr(disk, k, v)
        write_record(state_dir, disk)
        return disk
    finally:
        os.close(fd)


def read_record(state_dir: str, name: str) -> RunRecord | None:
    try:
        with open(_record_path(state_dir, name)) as fh:
            return RunRecord.from_dict(json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def list_records(state_dir: str) -> list[RunRecord]:
    out = []
    try:
        names = sorted(os.listdir(os.path.join(state_dir, "runs")))
    except OSError:
        return []
    for fn in names:
        if fn.endswith(".json") and not fn.startswith("."):
            rec = read_record(state_dir, fn[: -len(".json")])
            if rec is not None:
                out.append(rec)
    return out


class Locks:
    """flock()s on state_dir/locks/<key>.lock, held until release() or process death."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "locks")
        self.fds: list[int] = []

    def acquire(self, keys: list[str], owner: str) -> None:
        for key in keys:
            safe = key.replace("/", "_").replace(":", "_")
            path = os.path.join(self.dir, f"{safe}.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                finally:
                    os.close(fd)
                self.release()
                raise LockedError(
                    f"{key} is already claimed by another xpuctl run ({holder or 'unknown'})"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner.encode(), 0)
            self.fds.append(fd)

    def relabel(self, owner: str) -> None:
        """Rewrite who holds the locks (after a fork handed them to another process)."""
        for fd in self.fds:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, owner.encode(), 0)
            except OSError:
                pass

    def release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def find_record(state_dir: str, name: str) -> tuple[str, RunRecord]:
    """(state dir, the run record named `name`); NotFoundError (exit 3) when there is none."""
    from xpuctl.errors import NotFoundError

    sdir = ensure_state_dir(state_dir, create=False)
    rec = read_record(sdir, name) if os.path.isdir(os.path.join(sdir, "runs")) else None
    if rec is None or rec.name != name:
        known = [r.name for r in list_records(sdir)]
        # the names are the user's or a record's text: escaped where the line is printed
        raise NotFoundError(f"no run named {name!r} in {sdir}"
                            + (f"; known runs: {', '.join(known)}" if known else ""))
    return sdir, rec
