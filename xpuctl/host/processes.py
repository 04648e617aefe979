"""One pass over /proc: every process's stat, and every fd's link text.

The cmdline is read only when `comm` could be vLLM. Only fds that matter are kept: DRM
nodes (fdinfo later), dma-bufs (fdinfo later), sockets (inode, for ports) and the fds that
may hold a file to judge in /dev/shm and /tmp. When files are matched by identity
(`Host.identity_checked`: the kernel's /proc) those are kept by number (`FdTable.paths`), and
only when some file there is a candidate: whether one holds a candidate is decided by its
device and inode (a stat each), not by its link text, which names the path its process sees
(another mount namespace, a bind mount). Only a fake tree keeps them by link text. A
process that vanishes mid-scan is skipped; one whose fds cannot be read is counted. On a
busy host the pass is split over two processes (host/split.py). Equivalent: `fuser -v /dev/dri/*`, `lsof /dev/dri/*`.
"""

from __future__ import annotations

import marshal
import os
import stat as _stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

from xpuctl.core.rules import match
from xpuctl.host.procfiles import (
    FDINFO_LIMIT,
    Facts,
    read_argv,
    read_facts,
    read_optional,
)
from xpuctl.host.seam import Host
from xpuctl.host.sockdiag import listening_sockets
from xpuctl.host.split import in_two
from xpuctl.parse.procfs import ProcStat, parse_stat
from xpuctl.parse.roles import classify

if TYPE_CHECKING:
    from xpuctl.parse.net import TcpSocket

_GONE = (FileNotFoundError, ProcessLookupError)


class RawProcess:
    """One process as the pass saw it (mutable: roles are refined after the pass)."""

    __slots__ = ("cmdline", "cmdline_bytes", "facts", "fds_readable", "pid", "rank", "role",
                 "stat")

    def __init__(self, pid: int, stat: ProcStat, cmdline: list[str] | None, role: str | None,
                 rank: str | None, fds_readable: bool = True, cmdline_bytes: int = 0,
                 facts: Facts | None = None) -> None:
        self.pid = pid
        self.stat = stat
        self.cmdline = cmdline  # None: not read (comm rules vLLM out); see fill_cmdline
        self.cmdline_bytes = cmdline_bytes  # the whole argv's length (read_argv)
        self.role = role
        self.rank = rank
        self.fds_readable = fds_readable
        #: what a scan reads of a process it describes, read by the pass (None: not read):
        #: see `read_facts`
        self.facts = facts

    def __repr__(self) -> str:
        return f"RawProcess(pid={self.pid}, comm={self.stat.comm!r}, role={self.role!r})"


class FdTable:
    """The open files of every process, as the pass over /proc found them (not a Scan: the
    scan is built from it)."""

    __slots__ = ("dmabuf_fds", "drm_fds", "fdinfo", "files", "listeners", "malformed", "paths",
                 "paths_for", "procs", "rdev", "sockets", "sockets_for", "unreadable")

    def __init__(self) -> None:
        self.procs: dict[int, RawProcess] = {}
        self.drm_fds: list[tuple[int, str, str]] = []  # (pid, fd, host path)
        self.dmabuf_fds: list[tuple[int, str]] = []  # (pid, fd)
        self.sockets: dict[int, list[int]] = {}  # inode -> pids
        #: None: every socket is in `sockets`; else only these inodes (the TCP listeners)
        self.sockets_for: frozenset[int] | None = None
        #: the TCP listeners the pass kept the sockets of (None: not read by the pass)
        self.listeners: list[TcpSocket] | None = None
        #: /dev/shm|/tmp host path -> pids, by link text: only where files are not matched
        #: by identity (a fake tree); on the kernel's /proc an fd on a file to judge is found
        #: by its device and inode (`paths`), whatever path its link shows
        self.files: dict[str, list[int]] = {}
        # (pid, fd) of the fds that may lead to a file to judge, on the kernel's /proc (see
        # module): `paths_for` None, none kept; (), every fd that may lead to a file; else
        # those whose link ends with "/" + one of these names
        self.paths: list[tuple[int, str]] = []
        self.paths_for: tuple[str, ...] | None = None
        self.unreadable: list[int] = []  # pids whose fds we could not read
        self.malformed: list[int] = []  # pids whose stat we could not parse
        #: read by the pass for the DRM and dma-buf fds: (pid, fd) -> the fdinfo's bytes
        #: (None: unreadable), and of a DRM fd on a live host the device it leads to
        #: (`Host.stat_rdev`); `fdinfo_of` and `rdev_of` read what is not here
        self.fdinfo: dict[tuple[int, str], bytes | None] = {}
        self.rdev: dict[tuple[int, str], tuple[int, int] | None] = {}

    def fdinfo_of(self, host: Host, pid: int, fd: str) -> bytes | None:
        """/proc/<pid>/fdinfo/<fd> as the pass read it, or read now (None: unreadable)."""
        if (pid, fd) in self.fdinfo:
            return self.fdinfo[pid, fd]
        return read_optional(host, f"/proc/{pid}/fdinfo/{fd}", FDINFO_LIMIT)

    def rdev_of(self, host: Host, pid: int, fd: str) -> tuple[int, int] | None:
        """The char device (major, minor) a DRM fd leads to, as the pass found it or now."""
        if (pid, fd) in self.rdev:
            return self.rdev[pid, fd]
        return host.stat_rdev(f"/proc/{pid}/fd/{fd}")

    def merge(self, other: FdTable) -> None:
        self.procs.update(other.procs)
        self.drm_fds.extend(other.drm_fds)
        self.dmabuf_fds.extend(other.dmabuf_fds)
        self.fdinfo.update(other.fdinfo)
        self.rdev.update(other.rdev)
        for inode, owners in other.sockets.items():
            self.sockets.setdefault(inode, []).extend(owners)
        for path, owners in other.files.items():
            self.files.setdefault(path, []).extend(owners)
        self.paths.extend(other.paths)
        if other.paths_for != self.paths_for:  # parts of one pass agree; else trust neither
            self.paths, self.paths_for = [], None
        self.unreadable.extend(other.unreadable)
        self.malformed.extend(other.malformed)

    def dumps(self) -> bytes:
        """Plain containers for `marshal` (the helper's half of a split pass)."""
        procs = [(p.pid, tuple(p.stat), p.cmdline, p.role, p.rank, p.fds_readable,
                  p.cmdline_bytes, p.facts) for p in self.procs.values()]
        return marshal.dumps((procs, self.drm_fds, self.dmabuf_fds, self.sockets, self.files,
                              self.paths, self.paths_for, self.unreadable, self.malformed,
                              self.fdinfo, self.rdev))

    @classmethod
    def loads(cls, data: bytes) -> FdTable:
        (procs, drm, dmabuf, sockets, files, paths, paths_for, unreadable,
         malformed, fdinfo, rdev) = marshal.loads(data)
        out = cls()
        for pid, st, argv, role, rank, readable, nbytes, facts in procs:
            out.procs[pid] = RawProcess(pid, ProcStat(*st), argv, role, rank, readable, nbytes,
                                        facts)
        out.drm_fds, out.dmabuf_fds = drm, dmabuf  # marshal keeps tuples tuples
        out.sockets, out.files, out.paths, out.paths_for = sockets, files, paths, paths_for
        out.unreadable, out.malformed = unreadable, malformed
        out.fdinfo, out.rdev = fdinfo, rdev
        return out


#: Where the files a scan looks at live. A DRM node's fd is kept whole (FdTable.drm_fds);
#: a file of /dev/shm or /tmp by its link text only where files are not matched by identity.
_DRI = ("/dev/dri/",)
_FILE_DIRS = ("/dev/shm/", "/tmp/")


def _prefixes(root: str, dirs: tuple[str, ...]) -> tuple[str, ...]:
    """The link prefixes of `dirs` for a pass of `root`: the host's own and the root's."""
    return dirs + tuple(root + d for d in dirs) if root else dirs


def own_pids(host: Host, also: frozenset[int] = frozenset()) -> frozenset[int]:
    """The pids a scan leaves out: this process and `also` (the caller's own, its probes),
    when the scanned /proc is the one we run in; none in a fake tree, whose pids are not
    processes of ours. The one rule: the caller and its reader both skip by it."""
    return frozenset({os.getpid()}) | also if host.proc_is_live else frozenset()


def list_pids(host: Host) -> list[int]:
    return [int(d) for d in host.listdir("/proc") if d.isascii() and d.isdigit()]


def _maybe_vllm(comm: str) -> bool:
    """Could a process with this kernel `comm` be vLLM? Only used on a live /proc, where
    comm is what the kernel keeps: setproctitle also sets it (`VLLM::EngineCor`), the API
    server runs as python or `vllm`, torch may rename the main thread `pt_main_thread`."""
    return "::" in comm or comm.startswith(("python", "vllm", "pt_", "pypy", "uv")) or comm in (
        "raylet", "gcs_server")  # Ray's own: the path from a Ray actor up to its run


def stat_of(host: Host, pid: int) -> ProcStat | None:
    """The parsed /proc/<pid>/stat (one read: the kernel renders it whole), or None when
    the process is gone or the file unreadable or garbled."""
    try:
        return parse_stat(host.read_once(f"/proc/{pid}/stat", 4096))
    except OSError:
        return None


def same_process(host: Host, pid: int, start_ticks: int | None = None) -> ProcStat | None:
    """The stat of `pid` while it still runs and, when `start_ticks` is given, is still the
    process that started then; None when it is gone, a zombie (it holds nothing, and PID 1
    in a container may never reap it) or the pid names another process now.

    The one identity check: every "is this still the same live process?" asks here."""
    st = stat_of(host, pid)
    if st is None or st.state == "Z" or (start_ticks is not None and st.start_ticks != start_ticks):
        return None
    return st


def live_stats(host: Host) -> dict[int, ProcStat]:
    """pid -> stat of every live process (one pass over /proc/*/stat; zombies left out), as
    one call to the host's reader."""
    return host.call(_live_stats)  # type: ignore[no-any-return]


def _live_stats(host: Host) -> dict[int, ProcStat]:
    out = {}
    for pid in list_pids(host):
        st = same_process(host, pid)
        if st is not None:
            out[pid] = st
    return out


def still_running(host: Host, pids: list[tuple[int, int | None]]) -> list[bool]:
    """For each (pid, start ticks or None): is it still that live process (`same_process`)?
    One call to the host's reader for the whole list."""
    if not pids:
        return []
    return host.call(_still_running, pids)  # type: ignore[no-any-return]


def _still_running(host: Host, pids: list[tuple[int, int | None]]) -> list[bool]:
    return [same_process(host, pid, ticks) is not None for pid, ticks in pids]


def facts_of(host: Host, proc: RawProcess, env: bool) -> Facts:
    """The `Facts` of a process of the pass: as the pass read them, else read now."""
    if proc.facts is None or (env and proc.facts[1] is None):
        proc.facts = read_facts(host, proc.pid, env)
    return proc.facts


def fill_cmdline(host: Host, proc: RawProcess) -> list[str]:
    """Read a deferred cmdline (for display of a device holder)."""
    if proc.cmdline is None:
        proc.cmdline, proc.cmdline_bytes = read_argv(host, proc.pid)
    return proc.cmdline


def read_process(host: Host, pid: int, argv_if: bool = True) -> RawProcess | None:
    """stat + cmdline of one process; None when it is gone or unparsable.

    With `argv_if` False the cmdline is read only when `comm` could be vLLM (see
    `_maybe_vllm`); `RawProcess.cmdline` is then None until `fill_cmdline`.
    """
    st = stat_of(host, pid)
    if st is None:
        return None
    if not argv_if and not _maybe_vllm(st.comm):
        return RawProcess(pid, st, None, None, None)
    argv, nbytes = read_argv(host, pid)
    role, rank = classify(argv)
    return RawProcess(pid, st, argv, role, rank, cmdline_bytes=nbytes)


#: Link texts worth a second look besides those under FdTable.dirs; every other fd (pipes,
#: eventfds, /dev/null, libraries, logs) is dropped inside `Host.fd_links` with one startswith
#: per fd.
_KEEP = ("/dmabuf:", "socket:[", "anon_inode:dmabuf")
#: On the kernel's /proc also every path ("/"): a file seen through another mount namespace
#: or a bind mount shows that path. Not kept by number (FdTable.paths): pseudo files and the
#: char devices every process holds, which are never a file in /dev/shm or /tmp.
_NOT_FILES = ("/dev/null", "/dev/pts/", "/dev/tty", "/dev/urandom", "/dev/random", "/dev/zero",
              "/dev/ptmx", "/dev/console", "/dev/kmsg", "/dev/full", "/dev/dri/", "/proc/",
              "/sys/", "/dmabuf:")


def _scan_some(host: Host, pids: Iterable[int], skip: frozenset[int], out: FdTable,
               names: tuple[str, ...] | None, sockets_for: frozenset[str] | None,
               env: bool) -> None:
    procs = out.procs
    dmabuf = out.dmabuf_fds
    sockets = out.sockets
    root = host.root
    out.paths_for = names  # the fds matched with files by identity (FdTable.paths)
    by_text = not host.identity_checked  # a fake tree: files by their link text
    keep = _prefixes(root, _DRI + (_FILE_DIRS if by_text else ())) + _KEEP + (
        ("/",) if names == () else ())
    ends = tuple("/" + name for name in names or ())
    by_number = names is not None
    fd_links = host.fd_links
    full_argv = not host.comm_trusted  # a fake tree's comm may not match its argv
    for pid in pids:
        if pid in skip:
            continue
        proc = read_process(host, pid, full_argv)
        if proc is None:
            base = f"/proc/{pid}"
            if host.exists(base + "/stat") and not _is_gone(host, base):
                out.malformed.append(pid)
            continue
        procs[pid] = proc
        if proc.stat.state == "Z" or proc.stat.kthread:
            continue  # a zombie holds nothing (its fds are closed), a kernel thread no fd
        try:
            links = host.fd_links_ending(pid, keep, ends) if ends else fd_links(pid, keep)
        except _GONE:
            del procs[pid]
            continue
        except OSError:
            proc.fds_readable = False
            out.unreadable.append(pid)
            continue
        drm, bufs = len(out.drm_fds), len(dmabuf)
        for fd, link in links:
            c = link[:1]
            if c == "/":
                _path_fd(out, pid, fd, link, root, by_number, ends, by_text)
            elif c == "s":
                if sockets_for is None or link in sockets_for:
                    try:
                        sockets.setdefault(int(link[8:-1]), []).append(pid)
                    except ValueError:
                        pass
            else:
                dmabuf.append((pid, fd))  # anon_inode:dmabuf
        if proc.role is not None or len(out.drm_fds) > drm or len(dmabuf) > bufs:
            _read_ahead(host, proc, out, out.drm_fds[drm:], dmabuf[bufs:], env)


def _read_ahead(host: Host, proc: RawProcess, out: FdTable, drm: list[tuple[int, str, str]],
                dmabuf: list[tuple[int, str]], env: bool) -> None:
    """What the scan will read of a process it describes (a vLLM process, a device holder),
    read here: the pass is split over two processes, the rest of the scan is not (400 holders
    of 4000 processes: 1,600 reads, 0.04 s of doctor). What cannot be read is unreadable,
    as it would have been there."""
    pid = proc.pid
    fill_cmdline(host, proc)
    proc.facts = read_facts(host, pid, env)
    for _, fd, _ in drm:
        if host.rdev_checked:
            out.rdev[pid, fd] = out.rdev_of(host, pid, fd)
    for fd in [fd for _, fd, _ in drm] + [fd for _, fd in dmabuf]:
        out.fdinfo[pid, fd] = out.fdinfo_of(host, pid, fd)


def _path_fd(out: FdTable, pid: int, fd: str, link: str, root: str, by_number: bool,
             ends: tuple[str, ...], by_text: bool) -> None:
    """One kept fd whose link is a path: a link under the root is cut to its host path, any
    other is a host path as it is (seam.Host.to_host). `by_number`: fds that may lead to a
    file to judge are kept by number (FdTable.paths), those whose link ends with `ends` when
    it names some."""
    if root and link.startswith(root) and link[len(root):len(root) + 1] == "/":
        link = link[len(root):]
    if by_number and not link.startswith(_NOT_FILES) and (not ends or link.endswith(ends)):
        out.paths.append((pid, fd))
    if link.startswith("/dev/dri/"):
        out.drm_fds.append((pid, fd, link))
    elif link.startswith("/dmabuf:"):
        out.dmabuf_fds.append((pid, fd))
    elif by_text and link.startswith(_FILE_DIRS):
        out.files.setdefault(link, []).append(pid)


def scan_processes(host: Host, skip_pids: frozenset[int] = frozenset(),
                   files: bool = True, env: bool = False) -> FdTable:
    """The pass. `env`: the `Facts` read ahead hold the environment. `files`:
    the scan judges files in /dev/shm and /tmp; then, when files are matched by identity and
    some file there may be judged by who holds it, every fd that may lead to a file is kept
    (`FdTable.paths`; a pass without them costs less, and `file_fds` reads them later).

    The TCP listeners are read first (`FdTable.listeners`): of the sockets only theirs are
    kept, a port's owners (`FdTable.sockets_for`), unless a socket file there may be judged
    by what is bound to it (every socket is kept then: liveness.Holdings.bound)."""
    try:
        pids = list_pids(host)
    except OSError:
        pids = []
    names, socket_files = _files_to_judge(host) if files and host.identity_checked else (
        None, False)
    listeners = listening_sockets(host)
    inodes = None if socket_files else frozenset(s.inode for s in listeners)
    wanted = None if inodes is None else frozenset(f"socket:[{i}]" for i in inodes)

    def work(some: Iterable[int]) -> FdTable:
        part = FdTable()
        _scan_some(host, some, skip_pids, part, names, wanted, env)
        return part

    out, *rest = in_two(work, pids, FdTable.dumps, FdTable.loads,
                        split=host.splittable and host.reader is None,
                        in_helper=host.in_split_helper)
    for part in rest:
        out.merge(part)
    out.listeners, out.sockets_for = listeners, inodes
    return out


def _files_to_judge(host: Host) -> tuple[tuple[str, ...] | None, bool]:
    """(which fds the pass keeps by number, whether a socket file may be judged).

    The fds kept by number (`FdTable.paths_for`): None when no regular file in /dev/shm or
    /tmp may be judged by who holds it; else the names of those files, when each has one
    link: an fd on such a file, opened through whatever mount or namespace, names it by that
    one dentry, so its link ends with "/" + the name (a rename renames the link too); else
    () for every fd that may lead to a file (a second name could be anywhere)."""
    found: list[str] = []
    every = sockets = False
    for directory in ("/dev/shm", "/tmp"):
        try:
            names = host.listdir(directory)
        except OSError:
            continue
        for name in names:
            m = match(directory, name)
            if m is None or m[0] == "cache":
                continue  # not ours to judge, or judged by age alone
            try:
                st = os.lstat(host.path(f"{directory}/{name}"))
            except OSError:
                continue  # gone: nothing to judge
            if _stat.S_ISSOCK(st.st_mode):
                sockets = True  # judged by what is bound to it
            elif m[1] or not _stat.S_ISREG(st.st_mode):
                continue
            elif st.st_nlink != 1:
                every = True
            else:
                found.append(name)
    if every:
        return (), sockets
    return (tuple(sorted(set(found))) if found else None), sockets


def file_fds(host: Host, pids: Iterable[int]) -> tuple[list[tuple[int, str]], list[int]]:
    """(pid, fd) of every fd of these processes that may lead to a file (as a pass that kept
    them would have), and the pids whose fds may not be read: for a file that appeared after
    the pass began."""
    out: list[tuple[int, str]] = []
    denied: list[int] = []
    for pid in pids:
        try:
            links = host.fd_links(pid, ("/",))
        except PermissionError:
            denied.append(pid)
            continue
        except OSError:
            continue
        root, cut = host.root, len(host.root)
        for fd, link in links:
            if root and link.startswith(root) and link[cut : cut + 1] == "/":
                link = link[cut:]
            if not link.startswith(_NOT_FILES):
                out.append((pid, fd))
    return out, denied


def _is_gone(host: Host, base: str) -> bool:
    try:
        host.lstat(base)
        return False
    except OSError:
        return True
