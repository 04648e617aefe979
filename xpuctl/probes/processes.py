"""One pass over /proc: every process's stat and cmdline, and every fd's link text.

Only fds that matter get a second look: DRM nodes (fdinfo), dma-bufs (fdinfo), sockets
(inode, for ports) and files under /dev/shm and /tmp (for stale-artifact checks). A process
that vanishes mid-scan is skipped; one whose fds cannot be read is counted.
Equivalent: `fuser -v /dev/dri/*`, `lsof /dev/dri/*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xpuctl.host import Host
from xpuctl.parse.procfs import ProcStat, parse_cmdline, parse_stat
from xpuctl.parse.roles import classify

_GONE = (FileNotFoundError, ProcessLookupError)


@dataclass(slots=True)
class RawProcess:
    pid: int
    stat: ProcStat
    cmdline: list[str]
    role: str | None
    rank: str | None
    fds_readable: bool = True


@dataclass(slots=True)
class FdScan:
    """What the pass over /proc found."""

    procs: dict[int, RawProcess] = field(default_factory=dict)
    drm_fds: list[tuple[int, str, str]] = field(default_factory=list)  # (pid, fd, host path)
    dmabuf_fds: list[tuple[int, str]] = field(default_factory=list)  # (pid, fd)
    sockets: dict[int, list[int]] = field(default_factory=dict)  # inode -> pids
    files: dict[str, list[int]] = field(default_factory=dict)  # /dev/shm|/tmp path -> pids
    unreadable: list[int] = field(default_factory=list)  # pids whose fds we could not read
    malformed: list[int] = field(default_factory=list)  # pids whose stat we could not parse


def list_pids(host: Host) -> list[int]:
    return [int(d) for d in host.listdir("/proc") if d.isdigit()]


def read_process(host: Host, pid: int) -> RawProcess | None:
    """stat + cmdline of one process; None when it is gone or unparsable."""
    base = f"/proc/{pid}"
    try:
        st = parse_stat(host.read_bytes(base + "/stat", 4096))
    except _GONE:
        return None
    except OSError:
        return None
    if st is None:
        return None
    try:
        argv = parse_cmdline(host.read_bytes(base + "/cmdline", 1 << 20))
    except OSError:
        argv = []
    role, rank = classify(argv)
    return RawProcess(pid, st, argv, role, rank)


def scan_processes(host: Host, skip_pids: frozenset[int] = frozenset()) -> FdScan:
    out = FdScan()
    procs = out.procs
    drm = out.drm_fds
    dmabuf = out.dmabuf_fds
    sockets = out.sockets
    files = out.files
    to_host = host.to_host
    root = host.root
    readlink = host.readlink
    listdir = host.listdir
    try:
        pids = list_pids(host)
    except OSError:
        return out
    for pid in pids:
        if pid in skip_pids:
            continue
        proc = read_process(host, pid)
        if proc is None:
            base = f"/proc/{pid}"
            if host.exists(base + "/stat") and not _is_gone(host, base):
                out.malformed.append(pid)
            continue
        procs[pid] = proc
        if proc.stat.state == "Z":
            continue  # a zombie holds nothing: its fds are closed
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = listdir(fd_dir)
        except _GONE:
            del procs[pid]
            continue
        except OSError:
            proc.fds_readable = False
            out.unreadable.append(pid)
            continue
        prefix = fd_dir + "/"
        for fd in fds:
            try:
                link = readlink(prefix + fd)
            except OSError:
                continue
            c = link[:1]
            if c == "/":
                if root:
                    link = to_host(link)
                if link.startswith("/dev/dri/"):
                    drm.append((pid, fd, link))
                elif link.startswith("/dev/shm/") or link.startswith("/tmp/"):
                    files.setdefault(link, []).append(pid)
                elif link.startswith("/dmabuf:"):
                    dmabuf.append((pid, fd))
            elif c == "s":
                if link.startswith("socket:["):
                    try:
                        sockets.setdefault(int(link[8:-1]), []).append(pid)
                    except ValueError:
                        pass
            elif c == "a" and link.startswith("anon_inode:dmabuf"):
                dmabuf.append((pid, fd))
    return out


def _is_gone(host: Host, base: str) -> bool:
    try:
        host.lstat(base)
        return False
    except OSError:
        return True
