"""Read a snapshot back: a Host whose answers are the ones the capture got.

`open_snapshot(path)` unpacks the archive into a private temporary directory (unpack.py
refuses unsafe ones) and yields an `ArchiveHost` rooted at its `root/` tree, removed again
on exit. The normal pipeline (scan, checks, render) then runs on it unchanged:

- file contents come from the tree, at their host paths;
- answers that are not contents (listings, link texts, lstat, resolved sysfs paths,
  existence, char-device numbers, fd link texts, errors) come from `index.json`;
- the capture's own situation comes from `manifest.json`: its time is "now" (so file ages
  match), its clock tick, whether comm could be trusted and DRM fds were checked by stat
  (so the scan takes the branches the capture took), and the caller's environment.

An ArchiveHost is never live: nothing read from it is ever signalled or deleted.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from xpuctl.archive.recording import raise_rec
from xpuctl.archive.unpack import unpack
from xpuctl.core.model import FileInfo, Issue, Version
from xpuctl.diagnosis import RecordedProbes
from xpuctl.errors import UsageError
from xpuctl.host.reads.protocol import BlockedRead
from xpuctl.host.seam import Host
from xpuctl.parse.archive import Index, Manifest, parse_index, parse_manifest
from xpuctl.parse.versions import version_records


class ArchiveHost(Host):
    """A Host over an unpacked snapshot (see the module docstring)."""

    bounded = False  # files xpuctl unpacked itself (regular files only): nothing blocks

    def __init__(self, root: str, manifest: Manifest, index: Index, origin: str) -> None:
        super().__init__(root)
        self.manifest = manifest
        self.index = index
        self._origin = origin
        self.clk_tck = manifest.clk_tck

    @property
    def origin(self) -> str:
        return self._origin

    @property
    def proc_is_live(self) -> bool:
        return False

    @property
    def comm_trusted(self) -> bool:
        return self.manifest.comm_trusted

    @property
    def rdev_checked(self) -> bool:
        return self.manifest.rdev_checked

    @property
    def inspected_as_root(self) -> bool:
        return self.manifest.uid == 0 and self.manifest.comm_trusted  # a live /proc, as root

    def now(self) -> float:
        return self.manifest.time

    @staticmethod
    def _inside(hostpath: str) -> None:
        """Host paths from an archive never climb out of the tree."""
        if not hostpath.startswith("/") or "\0" in hostpath or ".." in hostpath.split("/"):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), hostpath)

    @staticmethod
    def _replay(table: dict[Any, Any], key: object) -> Any:
        """A recorded answer (parse/archive.py checked each value's shape), or its error raised."""
        value = table[key]
        if isinstance(value, dict):
            raise_rec(value["error"])
        return value

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        """The reads that did not answer during the capture (recorded as ETIMEDOUT with the
        reader's reason): the replayed scan judges them as the capture did."""
        out = []
        for path, rec in self.index.read_errors.items():
            blocked = BlockedRead.from_error(path, rec[0], rec[1])
            if blocked is not None:
                out.append(blocked)
        return tuple(out)

    def read_bytes(self, hostpath: str, limit: int | None = None) -> bytes:
        self._inside(hostpath)
        if hostpath in self.index.read_errors:
            raise_rec(self.index.read_errors[hostpath])
        return super().read_bytes(hostpath, limit)

    def read_once(self, hostpath: str, limit: int = 4096) -> bytes:
        self._inside(hostpath)
        if hostpath in self.index.read_errors:
            raise_rec(self.index.read_errors[hostpath])
        return super().read_once(hostpath, limit)

    def read_records(self, hostpath: str, limit: int | None = None) -> bytes:
        return self.read_bytes(hostpath, limit)  # a plain file of the records kept

    def size_by_reading(self, hostpath: str, limit: int) -> int:
        self._inside(hostpath)
        if hostpath in self.index.sizes:
            return min(limit, int(self._replay(self.index.sizes, hostpath)))
        return super().size_by_reading(hostpath, limit)
    def statvfs(self, hostpath: str) -> tuple[int, int]:
        """The capture's answer (manifest `statvfs`), never the unpacked tree's filesystem."""
        seen = self.manifest.data.get("statvfs")
        value = seen.get(hostpath) if isinstance(seen, dict) else None
        if isinstance(value, dict) and "error" in value:
            raise OSError(f"{hostpath}: {str(value['error'])[:200]}")
        if (isinstance(value, list) and len(value) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)):
            return value[0], value[1]
        raise OSError(errno.ENODATA, "not in the snapshot", hostpath)

    def listdir(self, hostpath: str) -> list[str]:
        self._inside(hostpath)
        if hostpath in self.index.lists:
            return list(self._replay(self.index.lists, hostpath))
        return super().listdir(hostpath)

    def readlink(self, hostpath: str) -> str:
        self._inside(hostpath)
        if hostpath in self.index.links:
            link: str = self._replay(self.index.links, hostpath)  # a str (parse/archive.py)
            return link
        return super().readlink(hostpath)

    def resolve(self, hostpath: str, max_links: int = 40) -> str:
        self._inside(hostpath)
        if hostpath in self.index.resolved:
            resolved: str = self._replay(self.index.resolved, hostpath)  # a str (parse/archive.py)
            return resolved
        return super().resolve(hostpath, max_links)

    def lstat(self, hostpath: str) -> FileInfo:
        self._inside(hostpath)
        if hostpath in self.index.lstat:
            return FileInfo(*self._replay(self.index.lstat, hostpath))
        return super().lstat(hostpath)

    def exists(self, hostpath: str) -> bool:
        if hostpath in self.index.exists:
            return self.index.exists[hostpath] is True
        try:
            self._inside(hostpath)
        except OSError:
            return False
        return super().exists(hostpath)

    def stat_rdev(self, hostpath: str) -> tuple[int, int] | None:
        rdev = self.index.rdev.get(hostpath)
        return (rdev[0], rdev[1]) if isinstance(rdev, list) else None

    def fd_links(self, pid: int, keep: tuple[str, ...] = ("",)) -> list[tuple[str, str]]:
        if pid not in self.index.fds:
            return super().fd_links(pid, keep)
        links = self._replay(self.index.fds, pid)
        return [(fd, link) for fd, link in links if link.startswith(keep)]


class Opened(NamedTuple):
    host: ArchiveHost
    manifest: Manifest
    top: str  # the unpacked top directory (state/, probes.json next to root/)
    probes: RecordedProbes | None  # a --deep capture's probe results


def _probes(top: str, path: str) -> RecordedProbes | None:
    """probes.json of a --deep capture (None when there is none)."""
    from xpuctl.parse import probes
    from xpuctl.parse.probes import ProbeOutputError

    try:
        with open(os.path.join(top, "probes.json"), "rb") as f:
            text = f.read(64 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"snapshot {path}: probes.json: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
        results = probes.results_from_json(doc)
    except (ValueError, RecursionError, ProbeOutputError) as exc:
        raise UsageError(f"snapshot {path}: probes.json: {exc}") from None
    baseline = doc.get("baseline") or {}
    problem = doc.get("baseline_problem")
    if not (isinstance(baseline, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in baseline.values())) or not (
            problem is None or (isinstance(problem, list) and len(problem) == 2
            and all(isinstance(x, str) for x in problem))):
        raise UsageError(f"snapshot {path}: probes.json: malformed baseline")
    return RecordedProbes(results, probes.probe_pids_from_json(doc), baseline,
                          Issue(*problem) if problem else None)


def _read_json(top: str, name: str, path: str) -> bytes:
    try:
        with open(os.path.join(top, name), "rb") as f:
            return f.read(64 << 20)
    except OSError:
        raise UsageError(f"snapshot {path}: no {name}: not an xpuctl snapshot") from None


@contextmanager
def open_snapshot(path: str) -> Iterator[Opened]:
    """Unpack `path` privately and yield its host; the files are removed on exit."""
    tmp = tempfile.mkdtemp(prefix="xpuctl-from-")
    try:
        top = unpack(path, tmp)
        try:
            manifest = parse_manifest(_read_json(top, "manifest.json", path))
            index = parse_index(_read_json(top, "index.json", path))
        except ValueError as exc:
            raise UsageError(f"snapshot {path}: {exc}") from None
        root = os.path.join(top, "root")
        if not os.path.isdir(root):
            os.mkdir(root, 0o700)  # nothing was readable: every answer is in the index
        probes = _probes(top, path)
        if probes is not None:  # the stack's versions doctor --deep read at capture
            probes = probes._replace(versions=tuple(
                Version(*v) for v in version_records(manifest.data.get("versions"))))
        yield Opened(ArchiveHost(root, manifest, index, os.path.abspath(path)), manifest, top,
                     probes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
