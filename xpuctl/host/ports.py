"""The listening ports a scan reports: the server's port (taken or free), vLLM's own
listeners, and oneCCL's KVS listeners by proof (core/oneccl.py), each with its owner."""

from __future__ import annotations

from xpuctl.core.model import Port, Process
from xpuctl.core.oneccl import KVS, kvs_port
from xpuctl.host.processes import FdTable
from xpuctl.host.procfiles import read_optional
from xpuctl.host.seam import Host
from xpuctl.host.sockdiag import listening_sockets
from xpuctl.parse.procfs import maps_library
from xpuctl.parse.roles import RAY


def _kvs_owners(host: Host, port: int, pids: list[int], procs: dict[int, Process],
                cache: dict[int, bool]) -> set[int]:
    """The pids among a listener's owners that prove it is oneCCL's KVS (core/oneccl.py): the
    port is the KVS's and the process maps libccl (its maps read once, bounded)."""
    out = set()
    for pid in pids:
        p = procs.get(pid)
        if not kvs_port(port, p.env if p is not None else None):
            continue
        if pid not in cache:
            data = read_optional(host, f"/proc/{pid}/maps", 64 << 20)
            text = data.decode("utf-8", "surrogateescape") if data else ""
            cache[pid] = maps_library(text, "libccl")
        if cache[pid]:
            out.add(pid)
    return out


def ports_of(host: Host, fds: FdTable, procs: dict[int, Process], port: int | None) -> list[Port]:
    listeners = fds.listeners if fds.listeners is not None else listening_sockets(host)
    host.found_listeners(listeners)
    out: list[Port] = []
    seen: set[tuple[int, int | None]] = set()
    serving_found = False
    maps_ccl: dict[int, bool] = {}
    for sock in listeners:
        pids = fds.sockets.get(sock.inode, [])
        owners = [procs.get(pid) for pid in pids]
        # Ray's own listeners (GCS, dashboard, agents) are not the run's ports, even when the
        # run started that Ray
        vllm_owners = [p for p in owners if p is not None and p.role not in (None, RAY)]
        is_serving = port is not None and sock.port == port
        kvs = _kvs_owners(host, sock.port, pids, procs, maps_ccl)
        if not is_serving and not vllm_owners and not kvs:
            continue
        for pid in pids or (None,):
            p = procs.get(pid) if pid is not None else None
            if not is_serving and pid not in kvs and (p is None or p.role in (None, RAY)):
                continue
            key = (sock.port, pid)
            if key in seen:
                continue
            seen.add(key)
            serving_found |= is_serving
            out.append(
                Port(
                    sock.port,
                    sock.address,
                    pid,
                    "listen",
                    p.role if p else None,
                    bool(p and p.orphan),
                    KVS if pid in kvs else None,
                )
            )
    if port is not None and not serving_found:
        out.append(Port(port, None, None, "free"))
    return sorted(out, key=lambda x: (x.port, x.pid or 0))
