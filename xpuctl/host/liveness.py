"""Who holds a file in /dev/shm or /tmp: by its device and inode, never by its path text.

The text of an fd link, a maps line or a /proc/net/unix row is the path its process sees:
another mount namespace, a bind mount, `/tmp//x`, a relative bind. The identity is the
same everywhere, so on the kernel's /proc (`Host.identity_checked`):

- an fd holds a file when a stat of `/proc/<pid>/fd/<n>` gives the file's (st_dev, st_ino):
  only fds that may lead to a file are stat'ed (`FdTable.paths`), only when there are
  candidates, and, while each has one link and is mounted nowhere on its own, only those
  whose link ends with a candidate's name (host/processes.py);
- a mapping holds it when its maps line carries the file's device (major:minor) and inode;
  a line whose path is the candidate's but whose device differs (overlayfs shows the
  layer's) is settled by a stat of its `/proc/<pid>/map_files` entry;
- a socket file is in use when a unix socket of this network namespace is bound to its
  inode (sock_diag, UNIX_DIAG_VFS), else when a non-blocking connect() through the file is
  answered (a listener in another network namespace is reached through the inode too):
  refused means nothing listens; anything else means "cannot tell", and the file is kept.

A fake tree or a snapshot (its fds and maps are texts) is judged by path text, as before.

A regular file no process was found holding is asked once more, by its inode alone: a
write lease (F_SETLEASE) is granted only while no other open file description of the inode
exists, for reading or writing, a mapping's included (fs/locks.c check_conflicting_open).
Granted (and let go at once): nobody holds it. Refused: kept, whoever holds it. When no
lease can be asked (another user's file without CAP_LEASE, leases disabled), a process whose
fds or maps could not be read (another user's for a non-root run, one more privileged than
we are) keeps every file it could open, and the verdict says how many processes went
uninspected. Every read and stat goes through the host (bounded).
"""

from __future__ import annotations

import _socket
import errno
import marshal
import os
import stat
from collections.abc import Iterable
from typing import NamedTuple

from xpuctl.core.model import FileInfo
from xpuctl.host.processes import FdTable, file_fds
from xpuctl.host.procfiles import read_optional
from xpuctl.host.seam import Host
from xpuctl.host.split import in_two
from xpuctl.parse.net import parse_unix_paths
from xpuctl.parse.procfs import (
    Creds,
    parse_maps,
    parse_maps_paths,
    parse_mountinfo,
    parse_status_creds,
)

#: Capabilities that let a process open (or be handed) a file whatever its owner and mode:
#: CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_SETGID, CAP_SETUID,
#: CAP_SYS_PTRACE (pidfd_getfd), CAP_SYS_ADMIN.
_ANY_FILE_CAPS = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6) | (1 << 7) | (1 << 19) | (1 << 21)
#: Above this many candidates the inode numbers are no longer searched for in a maps text
#: before it is parsed: every text with a file mapping is parsed.
_TOKENS_MAX = 64
_DENIED = (errno.EACCES, errno.EPERM)

Ident = tuple[int, int]  # (st_dev, st_ino)


def could_open(creds: Creds | None, info: FileInfo) -> bool:
    """Could a process with these credentials hold this file? (None: unknown, yes.) Its
    owner, a process with a capability that passes file permissions, or anyone the file's
    mode lets in (group bits count for every process: the file's group is not known)."""
    if creds is None or creds.cap_eff & _ANY_FILE_CAPS or info.uid in creds.uids:
        return True
    return bool(info.mode & 0o066)


def connect_probe(host: Host, hostpath: str, info: FileInfo) -> bool | None:
    """Is a socket listening on (bound to) this socket file? True: a connect() was accepted
    or the backlog is full; False: refused, nothing is bound to its inode; None: cannot
    tell (no permission, the file changed, an unexpected error). Never blocks: the socket
    is non-blocking. The file is opened O_PATH and connected to through /proc/self/fd, so
    the inode connected to is the one checked (and a path past 108 bytes works)."""
    try:
        fd = os.open(host.path(hostpath), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.inode) or not info.is_socket:
            return None
        via = f"/proc/self/fd/{fd}"
        if not os.path.exists(via):  # a /proc of another pid namespace: by path
            via = host.path(hostpath)
        for kind in (_socket.SOCK_STREAM, _socket.SOCK_SEQPACKET, _socket.SOCK_DGRAM):
            answer = _connect(via, kind)
            if answer is not errno.EPROTOTYPE:
                return answer if isinstance(answer, bool) else None
        return None
    finally:
        os.close(fd)


def _connect(via: str, kind: int) -> bool | int | None:
    try:
        s = _socket.socket(_socket.AF_UNIX, kind | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        err = s.connect_ex(via)
    except OSError:  # a path too long for sun_path
        return None
    finally:
        s.close()
    if err in (0, errno.EAGAIN, errno.EINPROGRESS, errno.EISCONN):
        return True  # accepted, or a full backlog: someone listens
    if err == errno.ECONNREFUSED:
        return False
    if err == errno.EPROTOTYPE:
        return errno.EPROTOTYPE
    return None


def lease_probe(host: Host, hostpath: str, info: FileInfo) -> bool | None:
    """Does any process hold this regular file open or mapped? True: a write lease was
    refused (EAGAIN: another open file description exists); False: granted, so none does
    (it is let go at once); None: cannot tell (not ours to lease, leases disabled, the file
    changed, or this process runs other threads: a lease broken meanwhile sends SIGIO to
    the process, which only a single thread can hold back and drop)."""
    import fcntl
    import signal
    import sys

    threading = sys.modules.get("threading")
    if not info.is_regular or (threading is not None and threading.active_count() > 1):
        return None
    # O_PATH first: the file opened for the lease is the regular file checked, never a
    # device or FIFO swapped in meanwhile. O_NONBLOCK: an open that would break someone
    # else's lease fails instead of waiting.
    try:
        where = os.open(host.path(hostpath), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(where)
        if (st.st_dev, st.st_ino) != (info.dev, info.inode) or not stat.S_ISREG(st.st_mode):
            return None
        fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(where)
    sigio = {signal.SIGIO}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigio)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.inode):
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            return True if exc.errno == errno.EAGAIN else None
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
        if signal.SIGIO in signal.sigpending():
            signal.sigtimedwait(sigio, 0)  # an open that broke the lease meanwhile: dropped
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Maps(NamedTuple):
    mapped: dict[str, list[int]]  # candidate host path -> pids mapping it
    denied: list[int]  # pids whose maps could not be read (not gone)
    ccl: list[int]  # pids that map libccl (oneCCL)


class Holdings:
    """What the processes of one pass hold among the candidate files, read once each, on
    first use. `candidates`: host path -> lstat."""

    def __init__(self, host: Host, fds: FdTable, candidates: dict[str, FileInfo],
                 ccl_wanted: bool = False) -> None:
        self.host = host
        self.fds = fds
        self.candidates = candidates
        self.by_ident: dict[Ident, str] = {(i.dev, i.inode): p for p, i in candidates.items()}
        self.ccl_wanted = ccl_wanted
        self._open: dict[Ident, list[int]] | None = None
        self._fd_denied: list[int] = []
        self._maps: _Maps | None = None
        self._bound: dict[Ident, list[int]] | None = None
        self._bound_text: set[str] | None = None
        self._creds: dict[int, Creds | None] = {}

    # -- open -------------------------------------------------------------------------------
    def open_by(self, path: str) -> tuple[int, ...]:
        """The live processes with an fd on the file (a socket file is never held open: what
        is bound to it says whether it is in use)."""
        if not self.host.identity_checked:
            return tuple(sorted(set(self.fds.files.get(path, ()))))
        info = self.candidates[path]
        if not info.is_regular:
            return ()
        if self._open is None:
            self._open = self._stat_fds()
        return tuple(sorted(set(self._open.get((info.dev, info.inode), ()))))

    def _covered(self) -> bool:
        """Did the pass keep the fds that may hold every candidate (FdTable.paths_for)? By
        name, only while no candidate is also mounted on a path of its own (a file bind
        mount: an fd opened through it names the mount point, not the file)."""
        kept = self.fds.paths_for
        if kept is None:
            return False
        if kept == ():
            return True
        names = set(kept)
        return all(p.rsplit("/", 1)[-1] in names for p, i in self.candidates.items()
                   if i.is_regular) and not self._file_mounted()

    def _file_mounted(self) -> bool:
        """Is a candidate the root of a mount in some mount namespace (`major:minor` its
        device, the mounted path ending with its name)? One mountinfo read per namespace."""
        host = self.host
        regular = {p: i for p, i in self.candidates.items() if i.is_regular}
        ends = {"/" + p.rsplit("/", 1)[-1] for p in regular}
        devs = {(os.major(i.dev), os.minor(i.dev)) for i in regular.values()}
        seen: set[str] = set()
        for pid, p in self.fds.procs.items():
            if p.stat.state == "Z":
                continue
            try:
                ns = host.readlink(f"/proc/{pid}/ns/mnt")
            except OSError:
                continue  # gone, or not ours to inspect (then its fds are not either)
            if ns in seen:
                continue
            seen.add(ns)
            raw = read_optional(host, f"/proc/{pid}/mountinfo", 8 << 20)
            if raw is None:
                continue
            for m in parse_mountinfo(raw.decode("utf-8", "surrogateescape")):
                if (m.major, m.minor) in devs and m.root != "/" and any(
                        m.root.endswith(e) for e in ends):
                    return True
        return False

    def _stat_fds(self) -> dict[Ident, list[int]]:
        if self._covered():
            live = [(pid, fd) for pid, fd in self.fds.paths
                    if (p := self.fds.procs.get(pid)) is not None and p.stat.state != "Z"]
        else:  # a file the pass did not know of when it began: read the fds now
            pids = [pid for pid, p in self.fds.procs.items()
                    if p.stat.state != "Z" and not p.stat.kthread and p.fds_readable]
            live, denied = self.host.call(file_fds, pids)
            self._fd_denied.extend(denied)
        parts = in_two(self._stat_some, live, marshal.dumps, marshal.loads,
                       split=self.host.splittable and self.host.reader is None,
                       in_helper=self.host.in_split_helper)
        held: dict[Ident, list[int]] = {}
        for found, denied in parts:
            for dev, ino, pid in found:
                held.setdefault((dev, ino), []).append(pid)
            self._fd_denied.extend(denied)
        return held

    def _stat_some(self, items: Iterable[tuple[int, str]]) -> tuple[list[tuple[int, int, int]],
                                                                      list[int]]:
        wanted = self.by_ident
        found: list[tuple[int, int, int]] = []
        denied: list[int] = []
        for pid, fd in items:
            try:
                dev, ino, _ = self.host.identity(f"/proc/{pid}/fd/{fd}")
            except OSError as exc:
                if exc.errno in _DENIED:
                    denied.append(pid)
                continue  # closed meanwhile, or a file no stat reaches: none of ours
            if (dev, ino) in wanted:
                found.append((dev, ino, pid))
        return found, denied

    # -- mapped -----------------------------------------------------------------------------
    def mapped_by(self, path: str) -> tuple[int, ...]:
        """The live processes that map the file (a mapping outlives its fd)."""
        return tuple(sorted(set(self._mapped().mapped.get(path, ()))))

    def ccl_users(self) -> list[int]:
        """The live processes that map libccl (oneCCL)."""
        return self._mapped().ccl

    def _mapped(self) -> _Maps:
        if self._maps is None:
            pids = [pid for pid, proc in self.fds.procs.items()
                    if proc.stat.state != "Z" and not proc.stat.kthread]  # no mappings
            first, *rest = in_two(self._maps_of, pids, marshal.dumps, marshal.loads,
                                  split=self.host.splittable and self.host.reader is None,
                                  in_helper=self.host.in_split_helper)
            mapped, denied, ccl = first
            for m, d, c in rest:
                for path, owners in m.items():
                    mapped.setdefault(path, []).extend(owners)
                denied.extend(d)
                ccl.extend(c)
            self._maps = _Maps(mapped, denied, ccl)
        return self._maps

    def _maps_of(self, pids: Iterable[int]) -> tuple[dict[str, list[int]], list[int], list[int]]:
        host = self.host
        by_ident = host.identity_checked
        tokens: tuple[bytes, ...] = ()
        if by_ident and len(self.by_ident) <= _TOKENS_MAX:
            tokens = tuple({b" %d " % ino for _, ino in self.by_ident})
        texts = (b"/dev/shm/", b"/tmp/") + ((b"libccl",) if self.ccl_wanted else ())
        out: dict[str, list[int]] = {}
        denied: list[int] = []
        ccl: list[int] = []
        for pid in pids:
            try:
                data = host.read_bytes(f"/proc/{pid}/maps", 64 << 20)
            except OSError as exc:
                if exc.errno in _DENIED:
                    denied.append(pid)
                continue
            hit = any(t in data for t in texts)
            if not hit and by_ident:  # an inode of ours (or, past _TOKENS_MAX, any file)
                hit = any(t in data for t in tokens) if tokens else True
            if not hit:
                continue  # the common case: nothing of ours mapped
            text = data.decode("utf-8", "surrogateescape")
            if self.ccl_wanted and b"libccl" in data and any(
                    "/libccl" in m.path for m in parse_maps(text)):
                ccl.append(pid)
            for path in (self._idents_mapped(pid, text) if by_ident else self._texts_mapped(text)):
                out.setdefault(path, []).append(pid)
        return out, denied, ccl

    def _texts_mapped(self, text: str) -> set[str]:
        """A fake tree's or a snapshot's maps: by path text."""
        return {p for p in map(self.host.to_host, parse_maps_paths(text)) if p in self.candidates}

    def _idents_mapped(self, pid: int, text: str) -> set[str]:
        host = self.host
        found: set[str] = set()
        for m in parse_maps(text):
            path = self.by_ident.get((os.makedev(m.major, m.minor), m.inode))
            if path is not None:
                found.add(path)
                continue
            shown = host.to_host(m.path)
            if shown in self.candidates and shown not in found:
                # its path, another device and inode: a file of another namespace, or one
                # of ours through a layer (overlayfs); map_files says which
                info = self.candidates[shown]
                try:
                    dev, ino, _ = host.identity(f"/proc/{pid}/map_files/{m.span}")
                except OSError as exc:
                    if exc.errno in _DENIED:
                        found.add(shown)  # cannot tell: kept
                    continue
                if (dev, ino) == (info.dev, info.inode):
                    found.add(shown)
        return found

    # -- sockets ----------------------------------------------------------------------------
    def bound(self, path: str) -> tuple[bool | None, tuple[int, ...]]:
        """(is a socket bound to this socket file: True, False or None for cannot tell, the
        processes holding such a socket when known)."""
        host = self.host
        if not host.identity_checked:
            if self._bound_text is None:
                self._bound_text = self._unix_texts()
            return path in self._bound_text, ()
        info = self.candidates[path]
        if self._bound is None:
            from xpuctl.host.sockdiag import unix_bound

            try:
                self._bound = unix_bound()
            except OSError:
                self._bound = {}
        socks = self._bound.get((info.dev, info.inode))
        if socks:
            return True, tuple(sorted({p for s in socks for p in self.fds.sockets.get(s, ())}))
        # nothing of this network namespace is bound to it: ask the inode itself
        return host.call(connect_probe, path, info), ()

    def _unix_texts(self) -> set[str]:
        """A fake tree's /proc/net/unix: the bound paths, `//` read as `/`."""
        try:
            text = self.host.read_text("/proc/net/unix")
        except OSError:
            return set()
        return {_squeeze(self.host.to_host(p)) for p in parse_unix_paths(text)}

    # -- who could not be inspected -----------------------------------------------------------
    def lease(self, path: str) -> bool | None:
        """Does any process hold this regular file (lease_probe, in the host's reader)?"""
        answer: bool | None = self.host.call(lease_probe, path, self.candidates[path])
        return answer

    def unseen(self, info: FileInfo, anyone: bool = False, maps: bool = True) -> tuple[int, ...]:
        """The live processes whose fds or maps could not be read (blocked reads are the
        scan's own matter) and that could hold this file: by their credentials (`could_open`),
        or, with `anyone`, every one of them (a file can be handed over a unix socket). Without
        `maps`, those whose maps were not read are not asked about (a lease was granted)."""
        pids = set(self.fds.unreadable) | set(self._fd_denied)
        if maps:
            pids |= set(self._mapped().denied)
        out = []
        for pid in sorted(pids):
            p = self.fds.procs.get(pid)
            if p is None or p.stat.state == "Z":
                continue
            if anyone or could_open(self._creds_of(pid), info):
                out.append(pid)
        return tuple(out)

    def uid_of(self, pid: int) -> int | None:
        """A process's real uid, from its status."""
        creds = self._creds_of(pid)
        return creds.uids[0] if creds is not None else None

    def _creds_of(self, pid: int) -> Creds | None:
        if pid not in self._creds:
            raw = read_optional(self.host, f"/proc/{pid}/status", 1 << 16)
            text = raw.decode("utf-8", "replace") if raw else None
            self._creds[pid] = parse_status_creds(text) if text is not None else None
        return self._creds[pid]


def _squeeze(path: str) -> str:
    while "//" in path:
        path = path.replace("//", "/")
    return path
