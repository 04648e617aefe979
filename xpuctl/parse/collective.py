"""The collective check's rank reports (`doctor --collective`): text in, records out.

A rank (`xpuctl.probes.children.collective_rank`) and the group's leader
(`xpuctl.probes.children.collective_group`) write one event per line to the pipe the CLI
reads, each line `MARKER` followed by a JSON object; anything else on that pipe (a library
printing to stdout) is not an event and is skipped:

    XPUCTL-COLLECTIVE {"ev": "started", "slot": 0, "pid": 4242}          (leader)
    XPUCTL-COLLECTIVE {"ev": "phase", "slot": 0, "phase": "init", "backend": "xccl"}
    XPUCTL-COLLECTIVE {"ev": "done", "slot": 0, "sum": 2.0}
    XPUCTL-COLLECTIVE {"ev": "error", "slot": 1, "phase": "init", "error": "RuntimeError: ..."}
    XPUCTL-COLLECTIVE {"ev": "unavailable", "slot": 0, "reason": "torch is not installed"}
    XPUCTL-COLLECTIVE {"ev": "exit", "slot": 1, "returncode": -11, "stderr": "last line"}  (leader)

A slot is one rank of one group (the group's rank r is slot r; the per-device runs alone
have one slot per device). The format is xpuctl's own. `parse_events` never raises: a line
that is not a well-formed event is skipped.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

MARKER = "XPUCTL-COLLECTIVE "
PHASES = ("import", "init", "all_reduce", "destroy")
EVENTS = ("started", "phase", "done", "error", "unavailable", "exit")
MAX_TEXT = 400
MAX_SLOTS = 1024


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
