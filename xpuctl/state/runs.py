"""Run records and device locks in the state directory.

State directory (found by state/statedir): created 0700; refused when owned by someone
else or writable by group/others (a shared /tmp must not let another user forge a run
record that makes root signal an arbitrary pid). Records are written atomically (temp file +
rename). Locks are flock()s held by the supervising process for the whole run, so they
vanish with it, even after SIGKILL.

Records are read by one typed reader (`read_runs`, `load_record`): a record is a regular
file of at most `RECORD_MAX_BYTES`, UTF-8 JSON, an object whose every field has the type
its annotation in `RunRecord` says (state/fields) and sane values (a positive pid, a known
state, the name of its file). Anything else is a damaged record, named with its path and
why (`Unread`), never a crash, a hang or an unbounded read. A record that cannot be read
for want of permission (a non-root `ps` on root's runs) is named too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple

from xpuctl.core.runrecords import Health, Unread
from xpuctl.errors import LockedError, UsageError, XpuctlError
from xpuctl.output.safetext import safe
from xpuctl.parse import redact
from xpuctl.state import atomic
from xpuctl.state.fields import FieldError, typed_fields
from xpuctl.state.flock import flock_within
from xpuctl.state.regular import NotRegularError, open_regular, read_regular

ACTIVE_STATES = ("starting", "ready", "stopping")  # a run that may still have processes
STATES = (*ACTIVE_STATES, "stopped", "failed")
SUBDIRS = ("runs", "locks", "logs")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a run's name: also its files' names
#: a record is a few KiB (its command line, the last lines of a failed run); anything past
#: this is not one of ours, and is not read further
RECORD_MAX_BYTES = 1 << 20


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
    for sub in SUBDIRS:
        _subdir(path, sub, create)
    return path


def _subdir(path: str, sub: str, create: bool) -> None:
    """Make `path/sub` (0700) unless it is there; with `create`, UsageError when it cannot
    be made or something else has its name (a file called `runs` is no directory of runs).
    Without, a reader goes on: what it reads there says what is wrong (`read_runs`)."""
    full = os.path.join(path, sub)
    try:
        os.mkdir(full, 0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        if not create:
            return
        raise UsageError(f"state directory {path}: cannot make {sub}/: "
                         f"{exc.strerror or exc}") from None
    if not create:
        return
    try:
        st = os.lstat(full)
    except OSError as exc:
        raise UsageError(f"state directory {path}: {sub}/: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        from xpuctl.state.regular import kind_of

        raise UsageError(f"state directory {path}: {full} is {kind_of(st.st_mode)}, "
                         "not a directory")


@dataclass
class RunRecord:
    name: str
    run_id: str
    pid: int | None
    start_ticks: int | None
    session: int | None
    command: list[str]
    devices: list[str]
    port: int | None  # None: a unix socket's run (serve --uds), which has no TCP port
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

    #: Fields read by a reader of their own instead of their annotation (state/fields): the
    #: watch's verdict is advice, so a malformed one reads as unknown (None), never as a
    #: damaged record.
    FIELD_READERS: ClassVar[dict[str, Callable[[object], object]]] = {"health": Health.from_dict}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["health"] = self.health.to_dict() if self.health is not None else None
        return data

    @classmethod
    def from_dict(cls, data: object, name: str | None = None) -> RunRecord:
        """The record in the JSON `data`, every field typed (state/fields) and checked:
        FieldError (a ValueError) with one line when it is not a record. `name`: the name
        its file says it has."""
        if isinstance(data, dict) and "bind" not in data and "host" in data:
            data = {**data, "bind": data["host"]}  # a record of an earlier xpuctl
        rec = cls(**typed_fields(cls, data, cls.FIELD_READERS))
        why = rec.insane(name)
        if why:
            raise FieldError(why)
        return rec

    def insane(self, name: str | None = None) -> str | None:
        """What is wrong with the values of a well typed record, if anything."""
        if name is not None and self.name != name:
            return f"it names the run {self.name!r}, not {name!r}"
        if not NAME_RE.fullmatch(self.name):
            return "its name is not a run name"
        if self.state not in STATES:
            return f"state {self.state!r} is not one of {', '.join(STATES)}"
        for key in ("pid", "supervisor_pid", "session"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                return f"field {key!r} is {value}, not a pid"
        if self.start_ticks is not None and self.start_ticks < 0:
            return "field 'start_ticks' is negative"
        if self.port is not None and not 0 <= self.port <= 65535:
            return f"field 'port' is {self.port}, not a port"
        if self.stopping_by is not None and len(self.stopping_by) not in (0, 2):
            return "field 'stopping_by' is not [pid, start ticks]"
        return None


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


def _runs_dir(state_dir: str, pinned: PinnedRuns | None) -> str:
    return pinned.runs if pinned is not None else os.path.join(state_dir, "runs")


def write_record(state_dir: str, rec: RunRecord, pinned: PinnedRuns | None = None) -> None:
    """Write `rec` atomically into `state_dir/runs` (into the pinned directory when given:
    see PinnedRuns), its secrets redacted (parse/redact.py `run_record`)."""
    path = os.path.join(_runs_dir(state_dir, pinned), f"{rec.name}.json")
    shown = redact.run_record(rec.to_dict())  # no secret reaches the disk (issue 36 §9)
    atomic.replace(path, json.dumps(shown, indent=2).encode())


class StateDirChangedError(OSError):
    """The state directory is no longer the one a supervisor started with."""


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class PinnedRuns:
    """The state directory a supervisor started with, held: its `runs/` open as a directory
    descriptor, and the device and inode of both. Records are written through the
    descriptor (`/proc/self/fd/N`), so they can only land in that very directory, and
    `changed` tells, before each write, when the path now names another one (deleted and
    made again, replaced): a run's supervisor then stops writing records, and never writes
    over the record of a run that took its name in the new directory."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = os.path.abspath(state_dir)
        runs = os.path.join(self.state_dir, "runs")
        self.fd = os.open(runs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        top = _identity(self.state_dir)
        self.identity = (top, (st.st_dev, st.st_ino))

    @property
    def runs(self) -> str:
        """The pinned `runs/` as a path: through the descriptor, whatever its name is now."""
        return f"/proc/self/fd/{self.fd}"

    def changed(self) -> str | None:
        """Why the state directory's path no longer names the directory pinned (None: it
        still does)."""
        top = _identity(self.state_dir)
        runs = _identity(os.path.join(self.state_dir, "runs"))
        if top is None or runs is None:
            return "deleted"
        if (top, runs) != self.identity:
            return "replaced by another directory"
        return None

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


#: Seconds update_record waits for the record's lock (others hold it for a read-modify-write).
RECORD_LOCK_WAIT = 2.0


def update_record(state_dir: str, rec: RunRecord, *, pinned: PinnedRuns | None = None,
                  **changes: Any) -> RunRecord:
    """Apply `changes` to the record on disk (read-modify-write under a lock), so the
    supervisor and a `shutdown` never overwrite each other's fields. Returns the result;
    `rec` is updated too. TimeoutError (an OSError) when the lock is not free within
    RECORD_LOCK_WAIT: its holder is stopped or stuck, and a shutdown must not wait for it.
    `pinned`: the supervisor's own state directory (StateDirChangedError, an OSError, and
    nothing written when its path now names another one)."""
    for k, v in changes.items():
        setattr(rec, k, v)
    if pinned is not None:
        why = pinned.changed()
        if why:
            raise StateDirChangedError(errno.ESTALE, why, pinned.state_dir)
    runs_dir = _runs_dir(state_dir, pinned)
    fd = open_regular(os.path.join(runs_dir, f".{rec.name}.lock"), os.O_RDWR | os.O_CREAT)
    try:
        if not flock_within(fd, fcntl.LOCK_EX, RECORD_LOCK_WAIT):
            raise TimeoutError(errno.ETIMEDOUT, f"the lock of run {rec.name!r} is held", runs_dir)
        got = _read_one(runs_dir, rec.name)
        disk = got if isinstance(got, RunRecord) and got.run_id == rec.run_id else rec
        for k, v in changes.items():
            setattr(disk, k, v)
        write_record(state_dir, disk, pinned)
        return disk
    finally:
        os.close(fd)


class DamagedRecordError(XpuctlError):
    """The named run's record is damaged or unreadable (exit 1: something is wrong there,
    and the run may live: never "no such run")."""


class RunsRead(NamedTuple):
    """Every record of a state directory: those read, and those that could not be."""

    records: list[RunRecord]
    unread: list[Unread]


def parse_record(data: bytes, name: str | None = None) -> RunRecord:
    """A record from its file's bytes: FieldError (a ValueError) with why when it is none."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise FieldError("not UTF-8 text") from None
    except RecursionError:
        raise FieldError("not a record (JSON nested too deep)") from None
    except ValueError as exc:
        raise FieldError(f"not JSON ({exc})") from None
    return RunRecord.from_dict(doc, name)


def _read_one(runs_dir: str, name: str) -> RunRecord | Unread | None:
    """The record `name` in `runs_dir`; Unread when it cannot be read or is none; None when
    absent."""
    path = os.path.join(runs_dir, f"{name}.json")
    try:
        return parse_record(read_regular(path, RECORD_MAX_BYTES), name)
    except FileNotFoundError:
        return None
    except NotRegularError as exc:
        return Unread(path, name, exc.why, damaged=True)
    except PermissionError as exc:
        return Unread(path, name, exc.strerror or "permission denied", damaged=False)
    except FieldError as exc:
        return Unread(path, name, str(exc), damaged=True)
    except OSError as exc:  # EIO, ENOTDIR (runs/ is a file), ...
        return Unread(path, name, exc.strerror or str(exc), damaged=exc.errno != errno.EACCES)


def load_record(state_dir: str, name: str) -> RunRecord | None:
    """The record of run `name`, None when there is none; DamagedRecordError (exit 1, the
    path and why in its line) when its file is there but is no record or cannot be read."""
    got = _read_one(os.path.join(state_dir, "runs"), name)
    if isinstance(got, Unread):
        raise DamagedRecordError(f"run {name!r}: {safe(got.line())}")
    return got


def read_record(state_dir: str, name: str, pinned: PinnedRuns | None = None) -> RunRecord | None:
    """The record of run `name` (in the pinned directory when given), or None when there is
    none or it cannot be read (the callers that must say why use `load_record` or
    `read_runs`)."""
    got = _read_one(_runs_dir(state_dir, pinned), name)
    return got if isinstance(got, RunRecord) else None


def read_runs(state_dir: str) -> RunsRead:
    """Every record in `state_dir/runs` (hidden and temporary files skipped), and what could
    not be read: a record that is damaged or not ours to read, or the runs directory itself
    (missing is no run; a file, or one we may not list, is said)."""
    runs_dir = os.path.join(state_dir, "runs")
    try:
        names = sorted(os.listdir(runs_dir))
    except FileNotFoundError:
        try:
            os.lstat(state_dir)
        except FileNotFoundError:
            return RunsRead([], [])
        except PermissionError as exc:
            return RunsRead([], [Unread(state_dir, None, exc.strerror or "permission denied",
                                        damaged=False)])
        return RunsRead([], [])
    except NotADirectoryError:
        return RunsRead([], [Unread(runs_dir, None, _not_dir(runs_dir), damaged=True)])
    except PermissionError as exc:
        where = runs_dir if os.access(state_dir, os.X_OK) else state_dir
        return RunsRead([], [Unread(where, None, exc.strerror or "permission denied",
                                    damaged=False)])
    except OSError as exc:
        return RunsRead([], [Unread(runs_dir, None, exc.strerror or str(exc), damaged=True)])
    records: list[RunRecord] = []
    unread: list[Unread] = []
    for fn in names:
        if not fn.endswith(".json") or fn.startswith("."):
            continue
        got = _read_one(runs_dir, fn[: -len(".json")])
        if isinstance(got, RunRecord):
            records.append(got)
        elif got is not None:
            unread.append(got)
    return RunsRead(records, unread)


def _not_dir(path: str) -> str:
    from xpuctl.state.regular import kind_of

    try:
        return f"{kind_of(os.lstat(path).st_mode)}, not a directory"
    except OSError:
        return "not a directory"


def list_records(state_dir: str) -> list[RunRecord]:
    """The records that could be read (`read_runs` also says which could not)."""
    return read_runs(state_dir).records


class Locks:
    """flock()s on state_dir/locks/<key>.lock, held until release() or process death."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "locks")
        self.fds: list[int] = []

    def acquire(self, keys: list[str], owner: str) -> None:
        for key in keys:
            safe = key.replace("/", "_").replace(":", "_")
            path = os.path.join(self.dir, f"{safe}.lock")
            try:
                fd = open_regular(path, os.O_RDWR | os.O_CREAT)
            except OSError as exc:
                self.release()
                raise UsageError(f"lock {path}: {exc.strerror or exc}") from None
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
            self.fds.append(fd)
            self._label(fd, owner)

    def relabel(self, owner: str) -> None:
        """Rewrite who holds the locks (after a fork handed them to another process)."""
        for fd in self.fds:
            self._label(fd, owner)

    @staticmethod
    def _label(fd: int, owner: str) -> None:
        """Who holds the lock, for the message of a run refused it (a full disk leaves it
        unsaid: the lock is the flock, not its text)."""
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
    """(state dir, the run record named `name`); NotFoundError (exit 3) when there is none,
    DamagedRecordError (exit 1) when its record is damaged or cannot be read."""
    from xpuctl.errors import NotFoundError

    sdir = ensure_state_dir(state_dir, create=False)
    rec = load_record(sdir, name) if NAME_RE.fullmatch(name) else None
    if rec is None:
        found = read_runs(sdir)
        if found.unread and found.unread[0].name is None:  # the runs directory itself
            raise DamagedRecordError(f"no run {name!r} could be read: "
                                     f"{safe(found.unread[0].line())}")
        known = [r.name for r in found.records]
        # the names are the user's or a record's text: escaped where the line is printed
        raise NotFoundError(f"no run named {name!r} in {sdir}"
                            + (f"; known runs: {', '.join(known)}" if known else ""))
    return sdir, rec
