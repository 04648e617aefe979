"""The only code that deletes files. What may be deleted is decided by `rules.judge`
(stale) and `may_delete` (ownership); both are re-checked on a fresh scan right before each
unlink, and the file must still be the same inode that was planned.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from xpuctl.state import audit
from xpuctl.host.seam import Host
from xpuctl.core.model import Artifact, Scan


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


def removable(snap: Scan, euid: int | None = None) -> list[Artifact]:
    return [a for a in snap.artifacts if a.stale and may_delete(a.owner_uid, euid)]


def remove(host: Host, planned: list[Artifact], fresh: Scan, euid: int | None = None) -> list[Removal]:
    """Delete the planned files that the fresh scan still calls stale."""
    out = _remove(host, planned, fresh, euid)
    by_path = {a.path: a for a in planned}
    for r in out:  # every planned deletion, done or not, is one audit line
        audit.deletion(r.path, by_path[r.path].inode, r.kind, "removed" if r.removed else f"kept: {r.reason}")
    return out


def _remove(host: Host, planned: list[Artifact], fresh: Scan, euid: int | None) -> list[Removal]:
    now = {a.path: a for a in fresh.artifacts}
    out: list[Removal] = []
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
        same = info.inode == cur.inode and (a.inode is None or a.inode == info.inode)
        if not (info.is_regular or info.is_socket) or info.uid != cur.owner_uid or not same:
            out.append(Removal(a.path, a.kind, a.size_bytes, False, "changed since the scan"))
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
    return out
