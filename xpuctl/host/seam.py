"""The host seam: the only code that touches /proc, /sys, /dev, /dev/shm and /tmp.

A `Host` has a root ("/" on a live host). Every read is made under the root, and every
path the kernel shows as text (fd link targets, `maps` paths, unix socket paths) is mapped
back to a *host path* with `to_host`: a text that already starts with the root is taken as
is (a root whose `proc` links to the real /proc shows real paths), any other text is read as
root + text (a fake tree shows host paths). Paths given to and returned by this class are
host paths; `path()` turns one into the file to open.
"""

from __future__ import annotations

import os
import stat as _stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xpuctl.host.reads import protocol as _protocol
from xpuctl.host.reads.caller import Reader
from xpuctl.host.reads.protocol import DEFAULT_BOUND, BlockedRead

if TYPE_CHECKING:  # imported in lstat: a pass over /proc needs no record types
    from xpuctl.core.model import FileInfo
    from xpuctl.parse.net import TcpSocket

#: Clock ticks per second of /proc/<pid>/stat start times.
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


#: fd names tried in order before falling back to listing /proc/<pid>/fd (see fd_links).
_FD_NAMES = tuple(map(str, range(1024)))


class Host:
    """A view of one host's kernel files, re-rooted at `root`."""

    #: Largest file read through the host (see protocol.READ_LIMIT).
    READ_LIMIT = _protocol.READ_LIMIT
    #: A pass over /proc may be split over a forked helper (host/split.py). A host that
    #: records its reads (snapshot) says no: the helper's reads would be lost with it.
    splittable = True
    #: Ticks per second of the start times in /proc/<pid>/stat.
    clk_tck = CLK_TCK
    #: Reads of a real tree can block for good (a wedged host): they are made in a reader
    #: process, each bounded (host/reads/). A host over a snapshot's files says no.
    bounded = True

    def __init__(self, root: str | os.PathLike[str] = "/",
                 read_timeout: float | None = DEFAULT_BOUND, reads: Any = None) -> None:
        r = os.path.abspath(os.fspath(root))
        self.root = "" if r == "/" else r.rstrip("/")
        self.live = self.root == ""
        #: How this Host reads, fixed here: `reads` when given (in a reader, its side); else
        #: bounded, in a reader process (host/reads/), unless the class is not `bounded` or
        #: `read_timeout` is None; else directly.
        self._reads: Any = reads if reads is not None else (
            Reader(read_timeout) if read_timeout and self.bounded else _protocol.DIRECT)

    @property
    def reader(self) -> Reader | None:
        """The reader this Host's reads go to, or None when they are made in this process."""
        return self._reads.reader  # type: ignore[no-any-return]

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        """The reads that did not answer within the bound so far (in the reader: those it
        was told of)."""
        return self._reads.blocked_reads()  # type: ignore[no-any-return]

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(self, *args), its reads bounded: in the reader, as one round trip, when this
        Host has one; else here. For passes that read a file per pid."""
        reader = self._reads.reader
        if reader is not None:
            return reader.call(fn, self, *args)
        return fn(self, *args)

    def in_split_helper(self) -> None:
        """Called in a forked split helper (host/split.py): its reads are its own to publish."""
        self._reads.in_split_helper()

    def __repr__(self) -> str:
        return f"Host(root={self.root or '/'!r})"

    @property
    def origin(self) -> str:
        """What this view shows, for reports: the root directory ("/" on a live host)."""
        return self.root or "/"

    def now(self) -> float:
        """The time a scan is taken at (file ages are measured against it)."""
        return time.time()

    @property
    def comm_trusted(self) -> bool:
        """True when `comm` in /proc/<pid>/stat is the kernel's (the live /proc): it can rule
        vLLM out before the cmdline is read. A fake tree's comm may not match its argv."""
        return self.proc_is_live

    @property
    def rdev_checked(self) -> bool:
        """True when /dev/dri fds are checked to be DRM char devices (major 226) by stat:
        on a live host. A fake tree has plain files there and goes by node name."""
        return self.live

    @property
    def inspected_as_root(self) -> bool:
        """True when this /proc is read as root (the live /proc, euid 0): what it refuses, it
        refuses to root too, and running as root is no remedy (a snapshot says how it was
        taken)."""
        return self.proc_is_live and os.geteuid() == 0

    @property
    def identity_checked(self) -> bool:
        """True when what a process holds is matched with the files in /dev/shm and /tmp by
        device and inode (a stat of its fds and map_files, the device and inode of its
        maps lines, sock_diag and connect() for sockets), not by path text: on the kernel's
        /proc. A fake tree's fds link to text; a recording host (snapshot) judges by the
        texts it records, as its replay will."""
        return self.proc_is_live

    def found_listeners(self, sockets: list[TcpSocket]) -> None:
        """Told the TCP LISTEN sockets a scan found (over netlink on a live host, which is
        no file read): a recording host keeps them; this one has no use for them."""

    # -- paths ------------------------------------------------------------------------
    def path(self, hostpath: str) -> str:
        """The file to open for a host path."""
        return self.root + hostpath

    def to_host(self, text: str) -> str:
        """Map a path the kernel showed as text back to a host path."""
        r = self.root
        if r and text.startswith(r) and (len(text) == len(r) or text[len(r)] == "/"):
            return text[len(r) :] or "/"
        return text

    # -- reads --------------------------------------------------------------------------
    def read_bytes(self, hostpath: str, limit: int | None = None) -> bytes:
        return self._reads.read(self.root, "all", hostpath, limit or self.READ_LIMIT)  # type: ignore[no-any-return]

    def size_by_reading(self, hostpath: str, limit: int) -> int:
        """The bytes a read of the file to its end gives (at most `limit`), nothing kept: the
        length of a /proc file whose st_size says 0."""
        return int(self._reads.read(self.root, "count", hostpath, limit))

    def read_records(self, hostpath: str, limit: int | None = None) -> bytes:
        """A record device such as /dev/kmsg, every record it holds, without blocking
        (`reads.protocol.read_records`); a plain file under a root is read the same way."""
        return self._reads.read(self.root, "records", hostpath, limit or self.READ_LIMIT)  # type: ignore[no-any-return]

    def identity(self, hostpath: str) -> tuple[int, int, int]:
        """(st_dev, st_ino, st_mode) of the file a path leads to, links followed: for
        /proc/<pid>/fd/N and /proc/<pid>/map_files/* (the file a process holds, whatever
        path it sees). Bounded like a read; raises OSError like stat."""
        data = self._reads.read(self.root, "stat", hostpath, 0)
        dev, ino, mode = _protocol.IDENTITY.unpack(data)
        return dev, ino, mode

    def read_text(self, hostpath: str, limit: int | None = None) -> str:
        return self.read_bytes(hostpath, limit).decode("utf-8", "surrogateescape")

    def listdir(self, hostpath: str) -> list[str]:
        return os.listdir(self.root + hostpath)

    def readlink(self, hostpath: str) -> str:
        return os.readlink(self.root + hostpath)

    def read_once(self, hostpath: str, limit: int = 4096) -> bytes:
        """One read(2): for kernel files the kernel renders whole on the first read
        (/proc/<pid>/stat). Saves the read that would only see the end of the file."""
        return self._reads.read(self.root, "once", hostpath, limit)  # type: ignore[no-any-return]

    def fd_links(self, pid: int, keep: tuple[str, ...] = ("",)) -> list[tuple[str, str]]:
        """(fd, link text) of the fds of a process whose link text starts with one of
        `keep` (default: all): see `fd_links_ending`."""
        return self.fd_links_ending(pid, keep, ())

    def fd_links_ending(self, pid: int, keep: tuple[str, ...],
                        ends: tuple[str, ...]) -> list[tuple[str, str]]:
        """(fd, link text) of the fds of a process whose link text starts with one of
        `keep` or ends with one of `ends`: one open of /proc/<pid>/fd, then readlink
        relative to it, no path walk per fd. Raises OSError like listdir.

        On the kernel's /proc since Linux 6.2 the directory's st_size is the number of open
        fds. When that many fds are numbered 0..n-1, as in most processes, they are read
        without listing the directory (a listing makes the kernel build an entry per fd);
        a gap, a count of 0 (older kernels) or a fake tree falls back to the listing.

        A link the kernel refuses to show (EACCES, EPERM: the process may not be inspected,
        though its directory could be listed) raises PermissionError: its open files are
        unknown, not none.
        """
        dfd = os.open(f"{self.root}/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            rl = os.readlink
            out = []
            done = 0
            n = os.fstat(dfd).st_size if self.proc_is_live else 0
            if 0 < n <= len(_FD_NAMES):
                for name in _FD_NAMES[:n]:
                    try:
                        link = rl(name, dir_fd=dfd)
                    except PermissionError:
                        raise
                    except OSError:
                        break  # a gap (or closed meanwhile): list the rest
                    if link.startswith(keep) or (ends and link.endswith(ends)):
                        out.append((name, link))
                else:
                    return out
                done = int(name)  # fds 0..done-1 are read
            seen = frozenset(_FD_NAMES[:done])
            for name in os.listdir(dfd):
                if name in seen:
                    continue
                try:
                    link = rl(name, dir_fd=dfd)
                except PermissionError:
                    raise
                except OSError:
                    continue  # closed meanwhile
                if link.startswith(keep) or (ends and link.endswith(ends)):
                    out.append((name, link))
            return out
        finally:
            os.close(dfd)

    @property
    def proc_is_live(self) -> bool:
        """True when <root>/proc is the kernel's /proc we run in (a live host, or a root whose
        proc links to /proc): pids are real, comm is kernel-maintained, signals make sense."""
        cached = getattr(self, "_proc_live", None)
        if cached is None:
            try:
                cached = self.live or os.path.realpath(self.root + "/proc") == "/proc"
            except OSError:
                cached = False
            self._proc_live = cached
        return cached

    def lstat(self, hostpath: str) -> FileInfo:
        from xpuctl.core.model import FileInfo

        st = os.lstat(self.root + hostpath)
        return FileInfo(st.st_mode, st.st_uid, st.st_size, st.st_mtime, st.st_ino, st.st_dev)

    def stat_rdev(self, hostpath: str) -> tuple[int, int] | None:
        """(major, minor) of the char device a path resolves to, else None (follows links)."""
        try:
            st = os.stat(self.root + hostpath)
        except OSError:
            return None
        if not _stat.S_ISCHR(st.st_mode):
            return None
        return os.major(st.st_rdev), os.minor(st.st_rdev)

    def statvfs(self, hostpath: str) -> tuple[int, int]:
        """(size, free) in bytes of the filesystem mounted at the path (free: f_bavail, what a
        user who is not root may still write). Under a root the path must be a mount point of
        its own (a tmpfs mounted there): a plain directory of a tree on some disk says nothing
        about a host's /dev/shm. Raises OSError."""
        path = self.root + hostpath
        if self.root and os.stat(path).st_dev == os.stat(os.path.dirname(path)).st_dev:
            raise OSError(f"{hostpath}: not a filesystem of its own under {self.root}")
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def exists(self, hostpath: str) -> bool:
        return os.path.lexists(self.root + hostpath)

    def resolve(self, hostpath: str, max_links: int = 40) -> str:
        """Resolve symlinks inside the root (sysfs links), returning a host path.

        Absolute link texts are read relative to the root; `..` never climbs above it.
        """
        if self.live:
            return os.path.realpath(hostpath)
        parts = [p for p in hostpath.split("/") if p]
        done: list[str] = []
        links = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join([*done, part])
            try:
                target = os.readlink(self.root + candidate)
            except OSError:
                done.append(part)
                continue
            links += 1
            if links > max_links:
                raise OSError(f"too many levels of symbolic links: {hostpath}")
            target = self.to_host(target)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
        return "/" + "/".join(done)
