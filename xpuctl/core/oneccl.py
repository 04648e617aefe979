"""oneCCL as the scan sees it (pure): its KVS listeners, and ranks whose peers are gone.

KVS: oneCCL's bootstrap key-value store listens on TCP from port 4096 up, taking the next
free port for each socket (oneCCL internal_kvs.h `default_start_port`, internal_kvs.cpp: a
bind loop that increments the port; seen with real oneCCL: xpuctl issue 31), or on
`CCL_KVS_PORT`. A listener is named oneCCL's KVS only with a proof that does not misname an
unrelated server: its process maps oneCCL's library (`libccl.so*` in /proc/<pid>/maps) and the
port is the KVS's (4096 to 8191, or the process's own CCL_KVS_PORT). A web server on 4096
maps no libccl; a vLLM worker's other listeners (torch's store, bound to port 0) get ports
from the kernel's ephemeral range (32768 and up), outside the KVS's.

Lone ranks: vLLM retitles a worker `Worker_TP<r>` (with `DP<d>_`/`PP<p>_` parts) once its
parallel groups exist, and only for a group of two or more ranks. A live worker whose title
names a TP rank, with no other live worker of its run left, is a oneCCL rank whose peers are
gone: it waits in its next collective for ever, spinning (50 to 200 % CPU with real oneCCL,
issue 31). Its run: the same live EngineCore or API server above it (`top`), else the same
XPUCTL_RUN_ID, else the same session (vLLM never calls setsid). Any other live worker counts
as a peer, titled or not (a worker is `Worker` until its groups exist).
"""

from __future__ import annotations

from collections.abc import Iterable

from xpuctl.core.model import Process
from xpuctl.parse.roles import API_SERVER, ENGINE_CORE, WORKER

KVS_FIRST_PORT = 4096
KVS_LAST_PORT = 8191
KVS_PORT_VAR = "CCL_KVS_PORT"
KVS = "oneccl-kvs"  # Port.kind


def kvs_port(port: int, env: dict[str, str] | None) -> bool:
    """A port the KVS takes: 4096 to 8191, or the process's own CCL_KVS_PORT."""
    if KVS_FIRST_PORT <= port <= KVS_LAST_PORT:
        return True
    value = (env or {}).get(KVS_PORT_VAR, "").strip()
    return value.isascii() and value.isdigit() and int(value) == port


def _tp_rank(p: Process) -> str | None:
    """`TP1` of a worker titled `Worker_TP1` (or `..._TP1` after DP/PP parts)."""
    if p.role != WORKER or not p.rank:
        return None
    last = p.rank.rsplit("_", 1)[-1]
    return last if last.startswith("TP") and last[2:].isdigit() else None


def _run_of(p: Process, by_pid: dict[int, Process]) -> tuple[str, object]:
    top = by_pid.get(p.top) if p.top is not None and p.top != p.pid else None
    if top is not None and top.role in (ENGINE_CORE, API_SERVER) and not top.is_zombie:
        return ("top", top.pid)
    if p.run_id:
        return ("run", p.run_id)
    return ("session", p.session)


def lone_ranks(processes: Iterable[Process]) -> list[Process]:
    """Live workers titled with a TP rank that have no live peer worker in their run."""
    procs = list(processes)
    by_pid = {p.pid: p for p in procs}
    workers = [p for p in procs if p.role == WORKER and not p.is_zombie]
    runs: dict[tuple[str, object], list[Process]] = {}
    for p in workers:
        runs.setdefault(_run_of(p, by_pid), []).append(p)
    # a worker's peers may sit in another of these keys (one reparented, one not): any live
    # worker sharing its run id or session is a peer too
    out = []
    for p in workers:
        if _tp_rank(p) is None:
            continue
        peers = [o for o in runs[_run_of(p, by_pid)] if o.pid != p.pid]
        peers += [o for o in workers if o.pid != p.pid and (
            (p.run_id and o.run_id == p.run_id) or o.session == p.session)]
        if not peers:
            out.append(p)
    return out
