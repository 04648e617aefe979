"""The reader's side of bounded reads (host/reader.py has the caller's side and why).

A reader is a child process that runs what it is asked (a scan, one read) and, before each
read, writes "reading PATH" into its slot of a page shared with the caller, and "done"
after it: two writes into memory, well under a microsecond. A read in a group that did not
answer before (see `group_of`) fails at once with `Blocked`. The split helper of a pass
(host/split.py) publishes in its own slot.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import mmap

#: A reader's name (/proc/PID/comm), for ps.
COMM = "xpuctl-reader"

#: Default bound of one read, in seconds (`--read-timeout`). A healthy procfs or sysfs read
#: takes microseconds; two seconds leave room for a loaded machine.
DEFAULT_BOUND = 2.0

_SLOTS = 4  # 0: the reader, 1: its split helper
_SLOT = 512
_HEAD = struct.Struct("<QiH")  # sequence number, pid, length of the path being read (0: none)
_PATH_MAX = _SLOT - _HEAD.size
_LEN = struct.Struct("<Q")


class Blocked(OSError):
    """A read that did not answer within the bound (or whose group already did not)."""


class BlockedRead(NamedTuple):
    """A file that did not answer: its host path, the pid it belongs to (None for sysfs and
    other files) and the bound it was given."""

    path: str
    pid: int | None
    seconds: float

    @property
    def reason(self) -> str:
        return f"did not answer within {self.seconds:g} s (the read blocked)"

    @classmethod
    def from_error(cls, path: str, err: object, text: str) -> BlockedRead | None:
        """The blocked read an OSError recorded by a snapshot stands for, else None."""
        import re

        pattern = r"did not answer within ([0-9.e+-]+) s \(the read blocked\)"
        found = re.fullmatch(pattern, text) if err == errno.ETIMEDOUT else None
        return cls(path, pid_of(path), float(found.group(1))) if found else None


#: Files of /proc/<pid> whose read takes the process's mmap lock: one that blocks means the
#: others will too.
_MM_FILES = frozenset({"cmdline", "environ", "maps", "smaps", "smaps_rollup", "mem", "auxv",
                       "numa_maps", "pagemap"})


def pid_of(path: str) -> int | None:
    """The pid of a /proc/<pid>/... path, else None."""
    if path.startswith("/proc/"):
        head = path[6:].split("/", 1)[0]
        if head.isascii() and head.isdigit():
            return int(head)
    return None


def group_of(path: str) -> str:
    """Files that block together: /proc/<pid>/{cmdline,environ,maps,...} (the mmap lock),
    /proc/<pid>/fdinfo/* (the driver), one sysfs directory (the device lock); any other
    file alone."""
    parts = path.split("/")
    if len(parts) >= 4 and parts[1] == "proc" and parts[2].isascii() and parts[2].isdigit():
        if parts[3] in _MM_FILES:
            return f"/proc/{parts[2]}/<mm>"
        if parts[3] == "fdinfo":
            return f"/proc/{parts[2]}/fdinfo"
        return path
    if parts[1:2] == ["sys"]:
        return path.rsplit("/", 1)[0]
    return path


# -- the reader's side -----------------------------------------------------------------------


class Progress:
    """What a reader (or its split helper) is reading, in a slot of the shared page."""

    __slots__ = ("blocked", "bound", "offset", "page", "pid", "reads", "seq")

    def __init__(self, page: mmap.mmap, slot: int) -> None:
        self.page = page
        self.offset = slot * _SLOT
        self.seq = 0
        self.pid = os.getpid()
        self.blocked: frozenset[str] = frozenset()  # groups that did not answer
        self.reads: tuple[BlockedRead, ...] = ()  # and the files that showed it
        self.bound = DEFAULT_BOUND

    def enter(self, path: str) -> None:
        """Before a read: raise Blocked if its group did not answer before, else publish it."""
        if self.blocked and group_of(path) in self.blocked:
            raise Blocked(errno.ETIMEDOUT, BlockedRead(path, pid_of(path), self.bound).reason, path)
        data = path.encode("utf-8", "surrogateescape")[:_PATH_MAX]
        off = self.offset
        self.page[off + _HEAD.size: off + _HEAD.size + len(data)] = data
        self.seq += 1
        _HEAD.pack_into(self.page, off, self.seq, self.pid, len(data) or 1)

    def leave(self) -> None:
        self.seq += 1
        _HEAD.pack_into(self.page, self.offset, self.seq, self.pid, 0)

    def move_to(self, slot: int) -> None:
        """In a forked split helper: publish in its own slot."""
        self.offset = slot * _SLOT
        self.pid = os.getpid()
        self.seq = 0
        self.leave()


#: Set in a reader process: every Host there publishes its reads through it.
current: Progress | None = None


def in_split_helper() -> None:
    """Called by probes/split.py in its forked helper."""
    if current is not None:
        current.move_to(1)


#: The pipe to and from a reader is written and read with the functions os had at import: a
#: caller (a test) that swaps os.write to make its own file writes fail must not cut it.
_os_read, _os_write = os.read, os.write


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = _os_read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_os_write(fd, view):]


def _send(fd: int, obj: Any) -> None:
    # _pickle, not pickle: the Python module costs ~2 ms more to import, on every command
    import _pickle

    data = _pickle.dumps(obj, protocol=5)
    _write_all(fd, _LEN.pack(len(data)) + data)


def _isolate(keep: tuple[int, ...]) -> None:
    """In a new reader: nothing of the caller's but the pipes. Its stdout and stderr must
    not be held open (a `| jq` waits for their end), nor its lock files (a lock lives while
    any copy of its descriptor does), and no handler of the caller's may run here."""
    try:  # named in ps and top (a fork keeps the caller's argv): an abandoned one is recognisable
        with open("/proc/self/comm", "w") as comm:
            comm.write(COMM)
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    last = 2
    for fd in sorted(keep):
        if fd > last + 1:
            os.closerange(last + 1, fd)
        last = fd
    os.closerange(last + 1, 1 << 20)
    for sig in signal.valid_signals():
        try:
            if sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
                signal.signal(sig, signal.SIG_IGN)  # the caller decides when this one ends
            elif callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue


def serve(requests: int, replies: int, page: mmap.mmap) -> None:
    """The reader's loop: run each request, publish reads, reply; return when the pipe ends."""
    import _pickle

    global current  # noqa: PLW0603 (the reader child's progress page; issue 24 removes it)
    current = Progress(page, 0)
    current.leave()
    while True:
        try:
            (size,) = _LEN.unpack(_read_exact(requests, _LEN.size))
            fn, args, kwargs, reads, bound = _pickle.loads(_read_exact(requests, size))
        except EOFError:
            return
        current.reads, current.bound = reads, bound
        current.blocked = frozenset(group_of(r.path) for r in reads)
        try:
            reply: tuple[bool, Any] = (True, fn(*args, **kwargs))
        except Exception as exc:
            reply = (False, exc)
        try:
            _send(replies, reply)
        except _pickle.PicklingError as exc:
            _send(replies, (False, RuntimeError(f"reader: unpicklable result: {exc}")))


def read(root: str, kind: str, hostpath: str, limit: int) -> bytes:
    """One read, in the reader (see Host.read_bytes and read_once)."""
    from xpuctl.host.seam import _readall, _readonce

    progress = current
    if progress is not None:
        progress.enter(hostpath)
    try:
        if kind == "once":
            return _readonce(root + hostpath, limit)
        return _readall(root + hostpath, limit)
    finally:
        if progress is not None:
            progress.leave()


def _main(argv: list[str]) -> None:
    """A spawned reader: `python -m xpuctl.host.readchild REQUESTS REPLIES PAGE`."""
    import mmap

    requests, replies, memfd = (int(a) for a in argv)
    page = mmap.mmap(memfd, _SLOTS * _SLOT)
    _isolate((requests, replies, memfd))
    serve(requests, replies, page)


if __name__ == "__main__":
    # Run as xpuctl.host.readchild, not as __main__: Hosts look for `current` there.
    from xpuctl.host import readchild as _module  # noqa: PLW0406 (run as __main__, use the module)

    try:
        _module._main(sys.argv[1:])
    finally:
        os._exit(0)
