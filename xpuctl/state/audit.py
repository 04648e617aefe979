"""The audit log: one JSON line for every signal and every deletion xpuctl makes.

File: `<state dir>/audit.jsonl` (0600, appended). Each line:

  {"time": "2026-12-01T07:10:00.123Z", "uid": 0, "euid": 0, "xpuctl_pid": 4242,
   "command": "reset", "action": "signal", "signal": "SIGTERM",
   "target": {"pid": 1234, "start_ticks": 99887, "label": "VLLM::EngineCore"},
   "result": "sent"}
  {..., "action": "delete", "target": {"path": "/dev/shm/psm_1", "inode": 5501, "kind": "shm"},
   "result": "removed"}

`result` says what happened: "sent", "removed", or "not sent: ..." / "kept: ..." with why.
Each act is audited before the next one: its line is written (one write(2), no buffer)
right after the act, or right after deciding not to make it. A command SIGKILLed halfway
leaves a line for every act it made but at most the last one (killed between that act and
its line, a window of one system call).

The log is UTF-8 JSON whatever bytes a path holds: a path is text decoded with
surrogateescape (os.fsdecode); each byte that is not UTF-8 is written as the four
characters `\\xNN` in `path`, and `path_bytes` gives the exact bytes in hex (only then).
Every other text is written the same way (without the hex).

The hooks sit where the actions happen, so no path misses them: `supervisor.Target.send`
(the only code that signals) and `cleanup.remove` (the only code that deletes) call `signal`
and `deletion`; reset's device reset calls `record`. A command turns the log on for its run
with `recording(state_dir, command)`: reset, shutdown, serve (its whole run, the --detach
supervisor included) and doctor's textfile sweep; outside it (library use) nothing is written.
A line that cannot be written never stops the action it describes: the error is kept and the
command reports it (a shutdown must not fail because a disk is full). A log or lock that is
not a regular file (a FIFO, a link) is never opened in a way that blocks: the line is lost
and said so.

Rotation by size: before a line is written, a log that has reached `MAX_BYTES` (1 MiB, some
3,000 lines) becomes `audit.jsonl.1`, `.1` becomes `.2`, and so on up to `.KEEP` (3); the
oldest beyond that is dropped: at most 4 MiB in all. Concurrent xpuctl runs share the log
safely through `audit.lock` beside it: a writer holds a shared flock for its open and its one
write(2) (O_APPEND: lines never interleave), the rotator an exclusive one for its renames, so
no line is written into a file while it is being renamed away, none is split, and a line
written just before a rotation is in `.1`, never lost. Two runs that both see a full log
rotate once: the second re-checks the size under the lock. A lock that cannot be had within
`LOCK_WAIT` seconds (a writer stopped with SIGSTOP) skips the rotation, or writes the line
without the lock (still one write(2)): the log never blocks an action.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal as _signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from xpuctl import pausepoint
from xpuctl.state.flock import flock_within
from xpuctl.state.regular import open_regular

FILENAME = "audit.jsonl"
LOCKNAME = "audit.lock"
MAX_BYTES = 1 << 20  # rotate once the log reaches this size
KEEP = 3  # rotated files kept: audit.jsonl.1 (newest) .. audit.jsonl.3
LOCK_WAIT = 1.0  # seconds to wait for the lock (held by others for microseconds)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def rotate(path: str, lock_fd: int) -> bool:
    """Shift `path` to `path.1` (and so on) if it is still at `MAX_BYTES` once the exclusive
    lock is held. True when rotated."""
    if not flock_within(lock_fd, fcntl.LOCK_EX, LOCK_WAIT):
        return False
    try:
        if _size(path) < MAX_BYTES:
            return False  # another run rotated it first
        for n in range(KEEP, 0, -1):
            older = f"{path}.{n - 1}" if n > 1 else path
            try:
                os.replace(older, f"{path}.{n}")
            except FileNotFoundError:
                pass
        return True
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


def append(path: str, data: bytes) -> None:
    """One line onto the log at `path`, rotating it first when full (see the module doc)."""
    lock_fd = open_regular(os.path.join(os.path.dirname(path), LOCKNAME), os.O_RDWR | os.O_CREAT)
    try:
        if _size(path) >= MAX_BYTES:
            rotate(path, lock_fd)
        locked = flock_within(lock_fd, fcntl.LOCK_SH, LOCK_WAIT)
        # one write(2) on an O_APPEND file: concurrent xpuctl runs never interleave a line
        fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            pausepoint.reached("audit-locked")
            os.write(fd, data)
        finally:
            os.close(fd)
            if locked:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
    finally:
        os.close(lock_fd)


def text(value: str) -> str:
    """`value` as valid UTF-8 text: each byte that os.fsdecode kept as a lone surrogate is
    written as the four characters \\xNN (any other lone surrogate as \\uDXXX)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def utf8(value: Any) -> Any:
    """`value` (a line, or part of one) with every text made valid UTF-8 (`text`); a `path`
    that was not also gets `path_bytes`, its exact bytes in hex."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        out = {k: utf8(v) for k, v in value.items()}
        path = value.get("path")
        if isinstance(path, str) and out["path"] != path:
            out["path_bytes"] = os.fsencode(path).hex()
        return out
    if isinstance(value, (list, tuple)):
        return [utf8(v) for v in value]
    return value


class Sink:
    """Where the lines of one command go, and what went wrong writing them. No state
    directory (under --root on a tree whose /proc is not this machine's, statedir): nothing
    is written, as nothing of this machine's state is."""

    def __init__(self, state_dir: str | None, command: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(os.path.abspath(state_dir), FILENAME) if state_dir else None
        self.command = command
        self.lines = 0
        self.lost = 0
        self.error: str | None = None
        self.told = False  # the loss was already said (serve's warning of a state dir fault)
        self._ready = False

    def _prepare(self) -> None:
        if not self._ready and self.state_dir is not None:
            from xpuctl.state.runs import ensure_state_dir  # the state dir's safety rules

            ensure_state_dir(self.state_dir)
            self._ready = True

    def write(self, entry: dict[str, Any]) -> None:
        if self.state_dir is None or self.path is None:
            return
        now = time.time()
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
            "uid": os.getuid(),
            "euid": os.geteuid(),
            "xpuctl_pid": os.getpid(),
            "command": self.command,
            **entry,
        }
        try:
            data = (json.dumps(utf8(line), ensure_ascii=False, default=str) + "\n").encode()
            self._prepare()
            append(self.path, data)
            self.lines += 1
        except Exception as exc:
            self.lost += 1
            if self.error is None:
                self.error = getattr(exc, "strerror", None) or str(exc)

    def summary(self) -> dict[str, Any]:
        return {"path": self.path, "lines": self.lines, "lost": self.lost, "error": self.error}


_sink: Sink | None = None


@contextmanager
def recording(state_dir: str | None, command: str) -> Iterator[Sink]:
    """Audit every signal and deletion made inside the block into `state_dir`."""
    global _sink  # noqa: PLW0603 (the block's sink: Target.send and cleanup.remove audit through it)
    previous = _sink
    _sink = sink = Sink(state_dir, command)
    try:
        yield sink
    finally:
        _sink = previous


def active() -> Sink | None:
    """The sink of the recording in force (a forked supervisor inherits its parent's)."""
    return _sink


def record(action: str, target: dict[str, Any], result: str, **extra: Any) -> None:
    if _sink is not None:
        _sink.write({"action": action, **extra, "target": target, "result": result})


def signal(pid: int, start_ticks: int, label: str, sig: int, result: str) -> None:
    """One line for a signal; `label` (the process's title or command) is capped as every
    command line xpuctl shows is (4 KiB, `…[+N bytes]` when cut: parse/procfs)."""
    if _sink is not None:
        from xpuctl.parse.procfs import shown_command
        from xpuctl.parse.redact import scrub

        label = shown_command([scrub(label)])  # a command line's secret shapes never written
        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        record("signal", {"pid": pid, "start_ticks": start_ticks, "label": label}, result, signal=name)


def deletion(path: str, inode: int | None, kind: str, result: str) -> None:
    record("delete", {"path": path, "inode": inode, "kind": kind}, result)
