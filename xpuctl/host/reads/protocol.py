"""What the caller and the reader agree on: the shared page's layout, the framing of the pipe,
which files block together, and the errors a read can end in.

Requests travel as (fn, args, kwargs, blocked reads so far, bound), pickled; a Host's way of
reading travels as a reference (`READS`) that the receiving side replaces with its own.
Replies are (True, value) or (False, exception, the reader's traceback text).
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any, NamedTuple

#: A reader's name (/proc/PID/comm), for ps.
COMM = "xpuctl-reader"

#: Default bound of one read, in seconds (`--read-timeout`). A healthy procfs or sysfs read
#: takes microseconds; two seconds leave room for a loaded machine.
DEFAULT_BOUND = 2.0

SLOTS = 4  # 0: the reader, 1: its split helper
SLOT = 512
#: A slot's head: sequence number, pid, length of the path being read (0: none).
HEAD = struct.Struct("<QiH")
PATH_MAX = SLOT - HEAD.size
LEN = struct.Struct("<Q")

#: The persistent id a Host's way of reading travels as (see caller.Reader and child.serve).
READS = "reads"

#: The largest file read through a Host (procfs files are small; a bound keeps a hostile tree
#: from making us read gigabytes).
READ_LIMIT = 8 << 20


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


class ReaderTraceback(Exception):
    """The reader's traceback of an exception it handed back: the cause of the exception
    raised in the caller, so `--debug` shows where in the reader it happened."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nin the reader process:\n" + self.text.rstrip()


#: Files of /proc/<pid> whose read takes the process's mmap lock: one that blocks means the
#: others will too (map_files: a stat of an entry looks its mapping up under that lock).
_MM_FILES = frozenset({"cmdline", "environ", "maps", "smaps", "smaps_rollup", "mem", "auxv",
                       "numa_maps", "pagemap", "map_files"})


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


# -- reads as such ------------------------------------------------------------------------------


def read_all(path: str, limit: int) -> bytes:
    """The file's bytes, up to `limit`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        total = 0
        while total < limit:
            chunk = os.read(fd, min(65536, limit - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_records(path: str, limit: int) -> bytes:
    """A record device read to its end without blocking (/dev/kmsg: one record per read(2),
    EAGAIN after the last, EPIPE when the records we were at were overwritten meanwhile:
    skipped on), or a plain file of such records to its end. Of more than `limit`, the newest
    is kept."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                chunk = os.read(fd, 16384)
            except BlockingIOError:
                break  # EAGAIN: no record left
            except BrokenPipeError:
                continue  # EPIPE: overwritten while we read
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            while total > limit and len(chunks) > 1:
                total -= len(chunks.pop(0))
        return b"".join(chunks)[-limit:]
    finally:
        os.close(fd)


def read_count(path: str, limit: int) -> bytes:
    """How many bytes the file gives when read to its end (at most `limit`), as decimal
    text; nothing of it is kept (a /proc file's st_size says 0: /proc/<pid>/cmdline)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        total = 0
        while total < limit:
            n = len(os.read(fd, min(65536, limit - total)))
            if not n:
                break
            total += n
        return str(total).encode()
    finally:
        os.close(fd)


#: What a "stat" read answers: st_dev, st_ino, st_mode of the file a path leads to.
IDENTITY = struct.Struct("<QQI")


def read_identity(path: str) -> bytes:
    """stat(2) of a path, links followed (a /proc/<pid>/fd/N or map_files entry leads to the
    file itself, whatever mount namespace its process sees it through): IDENTITY bytes. A
    stat can wait as a read can (a file on a hung network or FUSE mount): it is bounded
    like one."""
    st = os.stat(path)
    return IDENTITY.pack(st.st_dev, st.st_ino, st.st_mode)


def read_kind(path: str, kind: str, limit: int) -> bytes:
    """A read of one of the kinds a Host asks for: "all", "once", "records", "count" or
    "stat"."""
    if kind == "once":
        return read_once(path, limit)
    if kind == "records":
        return read_records(path, limit)
    if kind == "count":
        return read_count(path, limit)
    if kind == "stat":
        return read_identity(path)
    return read_all(path, limit)


def read_once(path: str, limit: int) -> bytes:
    """One read(2): for files the kernel renders whole on the first read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


class Direct:
    """Reads made in this process, unbounded: a snapshot's files, our own stat, a Host built
    with `read_timeout=None`. The other ways are caller.Reader and child.Published."""

    __slots__ = ()
    reader = None

    def read(self, root: str, kind: str, hostpath: str, limit: int) -> bytes:
        return read_kind(root + hostpath, kind, limit)

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        return ()

    def in_split_helper(self) -> None:
        """Called in a forked split helper (host/split.py): nothing to move here."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Direct, ())


DIRECT = Direct()


# -- the pipe -----------------------------------------------------------------------------------

#: The pipe to and from a reader is written and read with the functions os had at import: a
#: caller (a test) that swaps os.write to make its own file writes fail must not cut it.
_os_read, _os_write = os.read, os.write


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = _os_read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_os_write(fd, view):]


def send(fd: int, data: bytes) -> None:
    """One message: its length, then its bytes."""
    write_all(fd, LEN.pack(len(data)) + data)


def receive(fd: int) -> bytes:
    (size,) = LEN.unpack(read_exact(fd, LEN.size))
    return read_exact(fd, size)
