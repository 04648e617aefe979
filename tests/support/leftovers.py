"""Files of a known stale kind a test session leaves in /dev/shm and /tmp (issue 38 §5).

Each tier removes what its own processes made, by inode: the real-vLLM fixtures note the files
their processes hold or bind while they live (`note_ours`), and remove only those (the same
inode), once nothing holds them. This module is the net under them, for the whole session
(tests/conftest.py): /dev/shm and /tmp are listed at the start (`snapshot`), and at the end
every file that appeared since, of a kind xpuctl's own rules know (xpuctl/core/rules.py:
`match`; caches aside), that no live process holds, is a leftover; so is a directory of a kind
the suite's own helpers are known to leave (`DIR_KINDS`: Python's and Ray's, not xpuctl's)
that nothing has a socket bound in.

Other test sessions may run on the same machine at the same time (CI runs the suite alone;
a shared development machine does not). A leftover is this session's when one of its
processes was seen holding that inode (`note_ours`); the others are this session's only when
no other test session ran meanwhile (`other_sessions`, sampled during the run). The check
fails the run on this session's leftovers and names the others, with why they are not
counted, without failing on them.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from typing import NamedTuple

DIRS = ("/dev/shm", "/tmp")
#: (parent, name prefix) of directories a process leaves when it is killed: multiprocessing's
#: temporary directory (a forkserver's listener socket inside; Ray's dashboard runs one) and a
#: Ray cluster's session (logs and sockets); the Ray tier left 6 of each at every run
#: (tests/support/raytools.py)
DIR_KINDS = (("/tmp", "pymp-"), ("/tmp/ray", "session_2"))

_ours: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> path: held by a process of ours
_others: dict[int, str] = {}  # pid -> cmdline of another test session seen during the run
_sampled = {"at": 0.0}  # when the other sessions were last looked for (monotonic)


def _kind(directory: str, name: str) -> str | None:
    from xpuctl.core.rules import match

    m = match(directory, name)
    return m[0] if m and m[0] != "cache" else None


def snapshot() -> dict[str, tuple[int, int]]:
    """path -> (st_dev, st_ino) of every file of a known stale kind in /dev/shm and /tmp."""
    out: dict[str, tuple[int, int]] = {}
    for d in DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if _kind(d, name) is None:
                continue
            path = os.path.join(d, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                out[path] = (st.st_dev, st.st_ino)
    for d, prefix in DIR_KINDS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if name.startswith(prefix) and stat.S_ISDIR(st.st_mode):
                out[path] = (st.st_dev, st.st_ino)
    return out


def note_ours(paths: Iterable[str]) -> None:
    """These files are held or bound by a process a test started (their inodes now)."""
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        _ours[(st.st_dev, st.st_ino)] = p


def is_ours(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in _ours


def _held() -> set[tuple[int, int]]:
    """(dev, ino) of every file a live process has open or mapped, and of every bound unix
    socket (its inode is the socket's, so the path's inode is matched through /proc/net/unix)."""
    out: set[tuple[int, int]] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                st = os.stat(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            out.add((st.st_dev, st.st_ino))
        try:
            with open(f"/proc/{name}/maps") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        dev = parts[3].split(":")
                        out.add((os.makedev(int(dev[0], 16), int(dev[1], 16)), int(parts[4])))
        except (OSError, ValueError):
            continue
    return out


def _bound_paths() -> set[str]:
    try:
        with open("/proc/net/unix") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return set()
    return {p[7] for p in (ln.split() for ln in lines) if len(p) >= 8 and p[7].startswith("/")}


def _mine() -> set[int]:
    """This process and its descendants (a pytest session's own children)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def sample_other_sessions(every: float = 30.0) -> None:
    """Note the other test sessions running now (pytest processes not of this session),
    at most once every `every` seconds."""
    now = time.monotonic()
    if now - _sampled["at"] < every:
        return
    _sampled["at"] = now
    mine = _mine()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if any(b"pytest" in a for a in argv[:4]):
            _others[int(name)] = " ".join(a.decode(errors="replace") for a in argv if a)[:120]


class Report(NamedTuple):
    ours: list[str]  # this session's leftovers: the run fails
    unattributed: list[str]  # appeared meanwhile, held by nothing, not provably ours
    others: dict[int, str]  # the other test sessions seen during the run

    @property
    def failed(self) -> bool:
        return bool(self.ours)

    def lines(self) -> list[str]:
        out = []
        if self.ours:
            out.append(f"{len(self.ours)} file(s) of a known stale kind left by this session's "
                       "processes (seen held by them, by inode; tests/support/leftovers.py):")
            out += [f"  {p}" for p in self.ours]
        if self.unattributed:
            why = (f"{len(self._others_list())} other test session(s) ran meanwhile, so they "
                   "are not counted as this session's" if self.others else "")
            out.append(f"{len(self.unattributed)} file(s) of a known stale kind appeared "
                       f"during the session, held by nothing, not seen held by this session's "
                       f"processes ({why}):")
            out += [f"  {p}" for p in self.unattributed]
            out += [f"  other session: pid {pid} {cmd}" for pid, cmd in self._others_list()]
        return out

    def _others_list(self) -> list[tuple[int, str]]:
        return sorted(self.others.items())[:5]


def compare(before: dict[str, tuple[int, int]], since: float) -> Report:
    """The files of a known stale kind that appeared since `before` (a new path, or a new
    inode at an old one), changed since `since` (wall clock), and that nothing holds."""
    sample_other_sessions(every=0.0)
    after = snapshot()
    new = {p: key for p, key in after.items() if before.get(p) != key}
    if not new:
        return Report([], [], dict(_others))
    held, bound = _held(), _bound_paths()
    left = []
    for path, key in sorted(new.items()):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_ctime < since - 1.0 or key in held or path in bound:
            continue
        if stat.S_ISDIR(st.st_mode) and any(b.startswith(path + "/") for b in bound):
            continue  # a live process's socket is bound inside: in use
        left.append(path)
    ours = [p for p in left if new[p] in _ours]
    rest = [p for p in left if new[p] not in _ours]
    if not _others:  # nobody else ran tests here meanwhile: every leftover is this session's
        return Report(ours + rest, [], {})
    return Report(ours, rest, dict(_others))
