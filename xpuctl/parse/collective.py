"""The collective check's rank reports (`doctor --collective`): text in, records out.

A rank (`xpuctl.probes.children.collective_rank`) and the group's leader
(`xpuctl.probes.children.collective_group`) write one event per line to the pipe the CLI
reads, each line `MARKER` followed by a JSON object; anything else on that pipe (a library
printing to stdout) is not an event and is skipped:

    XPUCTL-COLLECTIVE {"ev": "started", "slot": 0, "pid": 4242}          (leader)
    XPUCTL-COLLECTIVE {"ev": "phase", "slot": 0, "phase": "init", "backend": "xccl"}
    XPUCTL-COLLECTIVE {"ev": "phase", "slot": 0, "phase": "compute"}      (one device's check)
    XPUCTL-COLLECTIVE {"ev": "done", "slot": 0, "sum": 2.0}
    XPUCTL-COLLECTIVE {"ev": "error", "slot": 1, "phase": "init", "error": "RuntimeError: ..."}
    XPUCTL-COLLECTIVE {"ev": "unavailable", "slot": 0, "reason": "torch is not installed"}
    XPUCTL-COLLECTIVE {"ev": "files", "slot": 0, "paths": ["/dev/shm/fi_ccl-3f2a"]}
    XPUCTL-COLLECTIVE {"ev": "exit", "slot": 1, "returncode": -11, "stderr": "last line"}  (leader)

`files`: what the rank holds in /tmp and /dev/shm (open, mapped, or a unix socket it bound),
said after each phase it passed (`held_files` reads it from the rank's own /proc): the
backend's files, whose names need not carry the rank's pid.

A slot is one rank of one group (the group's rank r is slot r; the per-device runs alone
have one slot per device). The format is xpuctl's own. `parse_events` never raises: a line
that is not a well-formed event is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from xpuctl.parse.net import parse_unix_paths
from xpuctl.parse.procfs import parse_maps_paths

MARKER = "XPUCTL-COLLECTIVE "
#: a group's phases in order; one device's check (no collective) goes import, compute
PHASES = ("import", "compute", "init", "all_reduce", "destroy")
EVENTS = ("started", "phase", "done", "error", "unavailable", "exit", "files")
MAX_TEXT = 400
MAX_SLOTS = 1024
MAX_FILES = 256  # per slot: a rank's backend makes a handful
MAX_PATH = 4096
#: Where the backend's files are: directly in these directories (the stale-file rules' own).
FILE_DIRS = ("/tmp", "/dev/shm")


class RankReport(NamedTuple):
    """What one slot said, folded: the last phase it entered and how it ended."""

    slot: int
    pid: int | None = None
    phase: str | None = None  # the last phase it entered (None: it never reported one)
    backend: str | None = None
    done: bool = False  # every phase passed, the all_reduce's sum checked
    error: str | None = None
    unavailable: str | None = None  # it could not run: no torch with XPU, no backend
    exited: bool = False
    returncode: int | None = None
    stderr: str | None = None  # the last line of its stderr (a crash's only word)
    files: tuple[str, ...] = ()  # what it said it holds in /tmp and /dev/shm, in order

    @property
    def failed(self) -> bool:
        """It ended without passing, and not because it could not run."""
        return self.exited and not self.done and self.unavailable is None


def _text(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    clean = "".join(ch if ch.isprintable() else " " for ch in value).strip()
    return clean[:MAX_TEXT] or None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _event(line: str) -> dict[str, Any] | None:
    if not line.startswith(MARKER):
        return None
    try:
        data = json.loads(line[len(MARKER):])
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("ev") not in EVENTS:
        return None
    slot = _int(data.get("slot"))
    if slot is None or not 0 <= slot < MAX_SLOTS:
        return None
    return data


def _fold(r: RankReport, ev: dict[str, Any]) -> RankReport:
    kind = ev["ev"]
    backend = _text(ev.get("backend")) or r.backend
    if kind == "started":
        pid = _int(ev.get("pid"))
        return r._replace(pid=pid if pid is not None and pid > 0 else r.pid)
    if kind == "phase":
        phase = ev.get("phase")
        return r._replace(phase=phase, backend=backend) if phase in PHASES else r
    if kind == "done":
        return r._replace(done=True, backend=backend)
    if kind == "error":
        phase = ev.get("phase")
        return r._replace(error=_text(ev.get("error")) or "failed",
                          phase=phase if phase in PHASES else r.phase, backend=backend)
    if kind == "unavailable":
        return r._replace(unavailable=_text(ev.get("reason")) or "unavailable", backend=backend)
    if kind == "files":
        paths = ev.get("paths")
        new = [p for p in (paths if isinstance(paths, list) else [])
               if isinstance(p, str) and in_file_dirs(p) and len(p) <= MAX_PATH
               and p not in r.files]
        return r._replace(files=(*r.files, *dict.fromkeys(new))[:MAX_FILES])
    return r._replace(exited=True, returncode=_int(ev.get("returncode")),
                      stderr=_text(ev.get("stderr")))


def parse_events(text: str) -> dict[int, RankReport]:
    """Every slot that said something, by slot number, its events folded in order."""
    out: dict[int, RankReport] = {}
    for line in text.splitlines():
        ev = _event(line)
        if ev is None:
            continue
        slot = ev["slot"]
        out[slot] = _fold(out.get(slot, RankReport(slot)), ev)
    return out


def earliest_phase(phases: list[str | None]) -> str | None:
    """The least advanced of these phases (a rank that never reported one counts as "import")."""
    known = [p or PHASES[0] for p in phases]
    return min(known, key=PHASES.index) if known else None


def in_file_dirs(path: str) -> bool:
    """A path directly in /tmp or /dev/shm (not below a directory there)."""
    return any(path.startswith(d + "/") and "/" not in path[len(d) + 1:] and path != d + "/"
               for d in FILE_DIRS)


def held_files(links: Iterable[str], maps: Iterable[str], unix: Callable[[], str]) -> set[str]:
    """The files directly in /tmp or /dev/shm that processes hold, from their fd links (a
    path, or `socket:[INODE]`: a unix socket, named by /proc/net/unix, the text `unix()`
    returns, read only when there is a socket), and their /proc/<pid>/maps texts."""
    paths: set[str] = set()
    inodes: set[int] = set()
    for link in links:
        if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
            inodes.add(int(link[8:-1]))
        elif in_file_dirs(link):
            paths.add(link)
    for text in maps:
        paths.update(p for p in parse_maps_paths(text) if in_file_dirs(p))
    if inodes:
        paths.update(p for p, ino in parse_unix_paths(unix()).items()
                     if ino in inodes and in_file_dirs(p))
    return paths
