"""The only code that deletes files. What may be deleted is decided by `rules.judge`
(stale) and `may_delete` (ownership); both are re-checked on a fresh scan right before the
unlinks, and each file must still be the same device and inode that was planned and judged.
Right before its unlink a file is asked once more by its inode (host/liveness.py): a socket
file whose connect() is not refused, or a regular file on which a write lease is refused
(someone opened or mapped it since the scan), is kept.
"""

from __future__ import annotations

import os
import re
import stat
import time
from typing import NamedTuple

from xpuctl import pausepoint
from xpuctl.core.model import Artifact, FileInfo, Scan
from xpuctl.host.liveness import connect_probe, lease_probe
from xpuctl.host.seam import Host
from xpuctl.state import audit


def may_delete(owner_uid: int, euid: int | None = None) -> bool:
    """Root cleans for every user; anyone else only their own files."""
    me = os.geteuid() if euid is None else euid
    return me == 0 or owner_uid == me


class Removal(NamedTuple):
    path: str
    kind: str
    size_bytes: int
    removed: bool
    reason: str


def removable(scan: Scan, euid: int | None = None) -> list[Artifact]:
    return [a for a in scan.artifacts if a.stale and may_delete(a.owner_uid, euid)]


def remove(host: Host, planned: list[Artifact], fresh: Scan, euid: int | None = None) -> list[Removal]:
    """Delete the planned files that the fresh scan still calls stale. Every planned file,
    deleted or kept, is one audit line, written right after its unlink (or the decision to
    keep it) and before the next one: a reset killed halfway leaves a line for every
    deletion it made, but at most the very last."""
    return _remove(host, planned, fresh, euid)


class _Audited(list[Removal]):
    """The removals made so far; each is audited as it is appended (one write(2) into the
    log, so it is there before the loop goes on to the next file)."""

    def __init__(self, planned: list[Artifact]) -> None:
        super().__init__()
        self.inodes = {a.path: a.inode for a in planned}

    def append(self, r: Removal) -> None:
        audit.deletion(r.path, self.inodes.get(r.path), r.kind,
                       "removed" if r.removed else f"kept: {r.reason}")
        super().append(r)


def _remove(host: Host, planned: list[Artifact], fresh: Scan, euid: int | None) -> list[Removal]:
    now = {a.path: a for a in fresh.artifacts}
    out = _Audited(planned)
    for a in planned:
        cur = now.get(a.path)
        if cur is None:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, "already gone"))
            continue
        if not cur.stale:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, f"no longer stale: {cur.reason}"))
            continue
        if not may_delete(cur.owner_uid, euid):
            out.append(Removal(a.path, a.kind, a.size_bytes, False, f"owned by uid {cur.owner_uid}"))
            continue
        try:
            info = host.lstat(a.path)
        except FileNotFoundError:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, "already gone"))
            continue
        same = (info.inode, info.dev) == (cur.inode, cur.dev) and (
            a.inode is None or a.inode == info.inode) and (a.dev is None or a.dev == info.dev)
        if not (info.is_regular or info.is_socket) or info.uid != cur.owner_uid or not same:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, "changed since the scan"))
            continue
        busy = _in_use_now(host, a.path, info)
        if busy:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, busy))
            continue
        try:
            os.unlink(host.path(a.path))  # unlink never follows a symlink
        except FileNotFoundError:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, "already gone"))
            continue
        except OSError as exc:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, exc.strerror or str(exc)))
            continue
        out.append(Removal(a.path, a.kind, a.size_bytes, True, cur.reason))
        pausepoint.reached("file-removed")
    return out


def _in_use_now(host: Host, path: str, info: FileInfo) -> str | None:
    """Why the file is in use right now, asked by its inode (None: nothing says so). Only on
    the kernel's /proc: a fake tree's files are texts' stand-ins."""
    if not host.identity_checked:
        return None
    if info.is_socket:
        if host.call(connect_probe, path, info) is not False:
            return "a connect() to it was not refused: a socket may be bound to it"
        return None
    if host.call(lease_probe, path, info):
        return "opened or mapped since the scan (a write lease was refused)"
    return None


def remove_stale_temps(directory: str, pattern: re.Pattern[str], max_age: float,
                       now: float | None = None, euid: int | None = None) -> list[Removal]:
    """Delete xpuctl's own temporary files left in `directory` by a run killed mid-write
    (`atomic.replace`): names matching `pattern` only, regular files only (lstat: a symlink
    is never followed, nor removed), owned as `may_delete` allows, last modified more than
    `max_age` seconds ago (a write in progress renames its file within that). Each removal,
    or failed removal, is one audit line; files that are not candidates are left unmentioned.
    The names are resolved in a directory fd, so a directory swapped for a symlink during
    the sweep cannot redirect an unlink."""
    now = time.time() if now is None else now
    out: list[Removal] = []
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return out
    try:
        for name in os.listdir(dfd):
            if not pattern.match(name):
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if (not stat.S_ISREG(st.st_mode) or not may_delete(st.st_uid, euid)
                    or now - st.st_mtime < max_age):
                continue
            out.append(_unlink_temp(dfd, directory, name, st))
    finally:
        os.close(dfd)
    return out


def _unlink_temp(dfd: int, directory: str, name: str, st: os.stat_result) -> Removal:
    path = os.path.join(directory, name)
    try:
        os.unlink(name, dir_fd=dfd)
        removal = Removal(path, "temp-file", st.st_size, True, f"stale temporary file "
                          f"(last written {time.time() - st.st_mtime:.0f}s ago)")
    except OSError as exc:
        removal = Removal(path, "temp-file", st.st_size, False, exc.strerror or str(exc))
    audit.deletion(path, st.st_ino, "temp-file", "removed" if removal.removed else f"kept: {removal.reason}")
    return removal
