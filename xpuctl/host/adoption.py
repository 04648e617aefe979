"""Who adopted a vLLM process, read for core/trees: runs being stopped by their supervisor,
and the inits of PID namespaces.

- A run whose API server is gone (exited, an unreaped zombie, its pid reused) while the
  supervisor its record names still lives is being stopped by that supervisor
  (serve/supervise reaps its API server and stops what is left of the tree). What carries the
  run's id under that supervisor is that run's, not an orphan (`ending_supervisors`).
- The init of a PID namespace (a container's, seen from the host with another pid) adopts
  the orphans of its namespace as PID 1 does: its NSpid (/proc/PID/status, outermost
  namespace first) ends in 1. Read only for the parents of vLLM processes (`mark_inits`).
"""

from __future__ import annotations

from xpuctl.core.runrecords import RecordedRun
from xpuctl.core.trees import Member, Placement, resolve
from xpuctl.host.processes import FdTable
from xpuctl.host.procfiles import read_optional
from xpuctl.host.seam import Host
from xpuctl.parse.procfs import parse_status_nspid

#: In the maps of a process that runs vLLM: vLLM's compiled ops, torch's libraries.
VLLM_LIBS = (b"/vllm/", b"/torch/lib/")


def ending_supervisors(fds: FdTable, runs: tuple[RecordedRun, ...]) -> dict[int, RecordedRun]:
    """supervisor pid -> its run, for the live runs whose recorded top is gone while their
    supervisor lives. The supervisor is the same process when it is alive and started no
    later than the recorded top (a pid names one process at a time; the top's start ticks
    are recorded, the supervisor's are not, and it started first)."""
    out: dict[int, RecordedRun] = {}
    for r in runs:
        if not r.pid or r.start_ticks is None or not r.supervisor_pid:
            continue
        top = fds.procs.get(r.pid)
        if (top is not None and top.stat.state != "Z"
                and top.stat.start_ticks == r.start_ticks):
            continue  # its API server lives: a live run, not an ending one
        sup = fds.procs.get(r.supervisor_pid)
        if sup is not None and sup.stat.state != "Z" and sup.stat.start_ticks <= r.start_ticks:
            out[sup.pid] = r
    return out


def runs_vllm(host: Host, pid: int) -> bool:
    """Does `pid` run vLLM itself (vLLM or torch is loaded: `LLM(...)` imports both)?"""
    data = read_optional(host, f"/proc/{pid}/maps", 64 << 20)
    return data is not None and any(lib in data for lib in VLLM_LIBS)


def _ns_init(host: Host, pid: int) -> bool:
    raw = read_optional(host, f"/proc/{pid}/status", 1 << 16)
    ids = parse_status_nspid(raw.decode("utf-8", "replace")) if raw is not None else ()
    return len(ids) > 1 and ids[-1] == "1"


def mark_inits(host: Host, members: dict[int, Member], blocked: set[int]) -> None:
    """Mark the parents of vLLM processes that are the init of a PID namespace (in place),
    and whether each runs vLLM itself when a child shares its session and group: only then
    can such a reaper be that child's launcher (core/trees.launcher). PID 1 of the namespace
    seen here is marked by host/scan already; a parent that did not answer is not read."""
    checked: dict[int, bool] = {}
    for m in list(members.values()):
        parent = members.get(m.ppid)
        if (m.role is None or m.ppid <= 1 or parent is None or parent.blocked
                or parent.zombie or m.ppid in blocked):
            continue
        if m.ppid not in checked:
            checked[m.ppid] = _ns_init(host, m.ppid)
        if not checked[m.ppid]:
            continue
        shares = (m.session, m.pgrp) == (parent.session, parent.pgrp) and parent.session > 0
        members[m.ppid] = parent._replace(
            ns_init=True, runs_vllm=parent.runs_vllm or (shares and runs_vllm(host, m.ppid)))


def place(host: Host, fds: FdTable, members: dict[int, Member], runs: tuple[RecordedRun, ...],
          blocked: set[int]) -> dict[int, Placement]:
    """core/trees' placements, once the inits among the parents are marked and the runs
    being stopped by their supervisor (their API server gone) are known."""
    mark_inits(host, members, blocked)
    ending = {r.run_id: r.name or r.run_id for r in ending_supervisors(fds, runs).values()}
    return resolve(members, ending)
