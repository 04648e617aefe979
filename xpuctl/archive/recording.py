"""A Host that remembers every answer it gave: what a snapshot writes is exactly what the
scan read.

`RecordingHost` wraps a `Host` and keeps, per host path, the first answer of each kind of
read: file contents, directory listings, link texts, lstat, resolved paths, existence,
char-device numbers, fd link lists, the lengths of files read through (a long command
line), and every OSError (errno, message, file name). The
first answer is the one the scan acted on. A recorded scan never forks (`splittable`):
a forked helper's reads would be lost with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from xpuctl.core.model import FileInfo
from xpuctl.host.reads.protocol import BlockedRead
from xpuctl.host.seam import Host
from xpuctl.parse.kmsg import relevant_text
from xpuctl.parse.net import TcpSocket

#: An OSError as recorded: (errno, strerror, filename) or (None, message, None).
ErrorRec = tuple[int | None, str, object]
#: A read that failed, as a table keeps it in place of its answer.
Failed = dict[str, ErrorRec]

K = TypeVar("K")
P = ParamSpec("P")
T = TypeVar("T")


def error_rec(exc: OSError) -> ErrorRec:
    if exc.errno is None:
        return (None, str(exc), None)
    return (exc.errno, exc.strerror or "", exc.filename)


def raise_rec(rec: ErrorRec | list[object]) -> None:
    """Raise the OSError a record describes: the same class (OSError picks it from errno),
    the same `strerror` and the same text."""
    errno_, text, filename = rec
    if errno_ is None:
        raise OSError(text)
    if filename is None:
        raise OSError(errno_, text)
    raise OSError(errno_, text, filename)


class RecordingHost(Host):
    """`Host` over the same root, recording each answer (see the module docstring)."""

    splittable = False
    bounded = False  # the scan runs here, to be recorded; `inner` bounds each read

    def __init__(self, inner: Host) -> None:
        super().__init__(inner.root or "/")
        self.inner = inner
        self.contents: dict[str, bytes] = {}
        self.read_errors: dict[str, ErrorRec] = {}
        self.lists: dict[str, list[str] | Failed] = {}
        self.links: dict[str, str | Failed] = {}
        self.lstats: dict[str, list[float] | Failed] = {}
        self.resolved: dict[str, str | Failed] = {}
        self.existence: dict[str, bool] = {}
        self.rdevs: dict[str, list[int] | None] = {}
        self.fds: dict[int, list[tuple[str, str]] | Failed] = {}
        self.sizes: dict[str, int | Failed] = {}
        self.taken_at: float | None = None
        self.listeners: list[TcpSocket] | None = None  # the first scan's TCP LISTEN sockets
        self.statvfs_seen: dict[str, list[int] | Failed] = {}  # /dev/shm's room (the manifest)

    # -- what the scan sees of its own situation: the wrapped host's ---------------------
    @property
    def proc_is_live(self) -> bool:
        return self.inner.proc_is_live

    @property
    def comm_trusted(self) -> bool:
        return self.inner.comm_trusted

    @property
    def rdev_checked(self) -> bool:
        return self.inner.rdev_checked

    @property
    def inspected_as_root(self) -> bool:
        return self.inner.inspected_as_root

    @property
    def identity_checked(self) -> bool:
        """False: the capture judges files by the texts it records (fd links, maps,
        /proc/net/unix), as the replay will, and records no other paths processes hold."""
        return False

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        return self.inner.blocked_reads()

    def now(self) -> float:
        t = self.inner.now()
        if self.taken_at is None:
            self.taken_at = t
        return t

    def found_listeners(self, sockets: list[TcpSocket]) -> None:
        if self.listeners is None:
            self.listeners = list(sockets)

    # -- reads ---------------------------------------------------------------------------
    def _content(self, hostpath: str, read: Callable[..., bytes], *args: object) -> bytes:
        try:
            data = read(hostpath, *args)
        except OSError as exc:
            if hostpath not in self.contents:
                self.read_errors.setdefault(hostpath, error_rec(exc))
            raise
        if hostpath not in self.read_errors:
            self.contents.setdefault(hostpath, data)
        return data

    def read_bytes(self, hostpath: str, limit: int | None = None) -> bytes:
        return self._content(hostpath, self.inner.read_bytes, limit)

    def read_once(self, hostpath: str, limit: int = 4096) -> bytes:
        return self._content(hostpath, self.inner.read_once, limit)

    def size_by_reading(self, hostpath: str, limit: int) -> int:
        """A long command line's length (its contents are kept only up to what was read)."""
        return self._answer(self.sizes, hostpath, self.inner.size_by_reading, hostpath, limit)

    def read_records(self, hostpath: str, limit: int | None = None) -> bytes:
        """The kernel log: only its GPU driver records are kept (never the rest of it), which
        is all doctor judges."""
        try:
            data = self.inner.read_records(hostpath, limit)
        except OSError as exc:
            if hostpath not in self.contents:
                self.read_errors.setdefault(hostpath, error_rec(exc))
            raise
        kept = relevant_text(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
        self._content(hostpath, lambda *_: kept)
        return data

    @staticmethod
    def _answer(table: dict[K, T | Failed], key: K, call: Callable[P, T], *args: P.args,
                **kwargs: P.kwargs) -> T:
        try:
            value = call(*args, **kwargs)
        except OSError as exc:
            table.setdefault(key, {"error": error_rec(exc)})
            raise
        table.setdefault(key, value)
        return value

    def listdir(self, hostpath: str) -> list[str]:
        return self._answer(self.lists, hostpath, self.inner.listdir, hostpath)

    def readlink(self, hostpath: str) -> str:
        return self._answer(self.links, hostpath, self.inner.readlink, hostpath)

    def resolve(self, hostpath: str, max_links: int = 40) -> str:
        return self._answer(self.resolved, hostpath, self.inner.resolve, hostpath, max_links)

    def lstat(self, hostpath: str) -> FileInfo:
        try:
            info = self.inner.lstat(hostpath)
        except OSError as exc:
            self.lstats.setdefault(hostpath, {"error": error_rec(exc)})
            raise
        self.lstats.setdefault(hostpath, list(info))
        return info

    def exists(self, hostpath: str) -> bool:
        return self.existence.setdefault(hostpath, self.inner.exists(hostpath))

    def statvfs(self, hostpath: str) -> tuple[int, int]:
        size, free = self._answer(self.statvfs_seen, hostpath,
                                  lambda: list(self.inner.statvfs(hostpath)))
        return size, free

    def stat_rdev(self, hostpath: str) -> tuple[int, int] | None:
        rdev = self.inner.stat_rdev(hostpath)
        self.rdevs.setdefault(hostpath, list(rdev) if rdev is not None else None)
        return rdev

    def fd_links(self, pid: int, keep: tuple[str, ...] = ("",)) -> list[tuple[str, str]]:
        return self._answer(self.fds, pid, self.inner.fd_links, pid, keep)
