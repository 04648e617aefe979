"""The DRM clients of a scan: who holds each device, from /proc/<pid>/fdinfo (and, for i915
backports that print no memory keys, the clients directory in sysfs), and the dma-bufs that keep
a device's memory alive after its exporter is gone."""

from __future__ import annotations

import re
from typing import Any

from xpuctl.core.model import Device, DmabufHold, DrmClient
from xpuctl.host.devices import DRM_MAJOR
from xpuctl.host.processes import FdTable
from xpuctl.host.procfiles import read_optional
from xpuctl.host.seam import Host
from xpuctl.parse.drmclients import MEMORY_DIR, SysfsClient, parse_client
from xpuctl.parse.fdinfo import parse_dmabuf, parse_fdinfo

_NODE_RE = re.compile(r"^(card|renderD)(\d+)$")
_GPU_DRIVERS = ("xe", "i915")


def _record(bdf: str | None, info: Any, dev: Device | None, name: str) -> dict[str, Any]:
    """A new DRM client's record, before its pids and sizes are added."""
    return {"bdf": bdf, "client_id": info.client_id if info else None,
            "driver": (info.driver if info else None) or (dev.driver if dev else None),
            "memory": None, "shared": None, "resident": None, "pids": [],
            "node": f"/dev/dri/{name}"}


def drm_clients(
    host: Host, fds: FdTable, devices: list[Device]
) -> tuple[list[DrmClient], dict[int, set[str]]]:
    by_node: dict[str, Device] = {}
    by_minor: dict[int, Device] = {}
    for d in devices:
        for node in d.nodes:
            by_node[node.rsplit("/", 1)[-1]] = d
        for minor in d.minors:
            by_minor[minor] = d
    known_bdfs = {d.bdf for d in devices}
    agg: dict[tuple[Any, ...], dict[str, Any]] = {}
    for pid, fd, path in fds.drm_fds:
        name = path[len("/dev/dri/") :]
        dev = by_node.get(name)
        if host.rdev_checked:
            rdev = fds.rdev_of(host, pid, fd)
            if rdev is None or rdev[0] != DRM_MAJOR:
                continue
            dev = by_minor.get(rdev[1], dev)
        if dev is None and not _NODE_RE.match(name):
            continue  # e.g. /dev/dri/by-path/…: not a node
        raw = fds.fdinfo_of(host, pid, fd)
        info = parse_fdinfo(raw.decode("utf-8", "replace")) if raw is not None else None
        bdf = dev.bdf if dev else None
        if info is not None and info.pdev and (info.pdev in known_bdfs or bdf is None):
            bdf = info.pdev
        if info is not None and info.client_id is not None:
            key: tuple[Any, ...] = ("client", bdf, info.client_id)
        else:
            key = ("fd", pid, fd)
        rec = agg.get(key)
        if rec is None:
            rec = agg[key] = _record(bdf, info, dev, name)
        if pid not in rec["pids"]:
            rec["pids"].append(pid)
        if info is not None and info.memory_bytes is not None:
            rec["memory"] = max(rec["memory"] or 0, info.memory_bytes)
        for field, value in (("shared", info.shared_bytes if info else None),
                             ("resident", info.resident_bytes if info else None)):
            if value is not None:
                rec[field] = max(rec[field] or 0, value)
    clients = [
        DrmClient(r["bdf"], r["client_id"], r["driver"], r["memory"], tuple(r["pids"]), r["node"],
                  r["shared"], r["resident"], "fdinfo" if r["memory"] is not None else None)
        for r in agg.values()
    ]
    clients = _sysfs_memory(host, clients, devices)
    held: dict[int, set[str]] = {}
    for c in clients:
        for pid in c.pids:
            held.setdefault(pid, set())
            if c.bdf:
                held[pid].add(c.bdf)
    return clients, held


def _sysfs_clients(host: Host, card: str) -> list[SysfsClient]:
    """The i915 backport's /sys/class/drm/<card>/clients/<id>/ (bounded reads; none: [])."""
    base = f"/sys/class/drm/{card}/clients"
    try:
        ids = sorted(host.listdir(base))[:4096]
    except OSError:
        return []

    def text(path: str) -> str | None:
        raw = read_optional(host, path, 64)
        return raw.decode("ascii", "replace") if raw is not None else None

    out = []
    for cid in ids:
        d = f"{base}/{cid}"
        out.append(parse_client(cid, text(f"{d}/pid"), text(f"{d}/name"),
                                text(f"{d}/{MEMORY_DIR}/created_bytes"),
                                text(f"{d}/{MEMORY_DIR}/imported_bytes")))
    return out


def _sysfs_memory(host: Host, clients: list[DrmClient], devices: list[Device]) -> list[DrmClient]:
    """For a device whose clients print no memory in fdinfo (the i915 backport), each pid's
    memory from the driver's per-client sysfs (created_bytes), on the first of its clients."""
    out = list(clients)
    for dev in devices:
        mine = [i for i, c in enumerate(out) if c.bdf == dev.bdf]
        if not mine or dev.card_node is None or any(out[i].memory_bytes is not None for i in mine):
            continue
        by_pid: dict[int, list[SysfsClient]] = {}
        for sc in _sysfs_clients(host, dev.card_node.rsplit("/", 1)[-1]):
            if sc.pid is not None and sc.created_bytes is not None:
                by_pid.setdefault(sc.pid, []).append(sc)
        done: set[int] = set()
        for i in mine:
            pids = [p for p in out[i].pids if p in by_pid and p not in done]
            if not pids:
                continue
            done.update(pids)
            created = sum(sc.created_bytes or 0 for p in pids for sc in by_pid[p])
            imported = [sc.imported_bytes for p in pids for sc in by_pid[p] if sc.imported_bytes is not None]
            out[i] = out[i]._replace(memory_bytes=created, memory_source="sysfs-clients",
                                     imported_bytes=sum(imported) if imported else None)
    return out


def dmabufs_held(
    host: Host, fds: FdTable, devices: list[Device], held: dict[int, set[str]]
) -> list[DmabufHold]:
    out: list[DmabufHold] = []
    for pid, fd in fds.dmabuf_fds:
        raw = fds.fdinfo_of(host, pid, fd)
        if raw is None:
            continue
        buf = parse_dmabuf(raw.decode("utf-8", "replace"))
        if buf is None or buf.exporter not in _GPU_DRIVERS:
            continue
        # dma-buf fdinfo does not name the device: attribute it when only one fits
        same_driver = [d.bdf for d in devices if d.driver == buf.exporter]
        mine = [b for b in held.get(pid, ()) if b in same_driver]
        if len(mine) == 1:
            bdf: str | None = mine[0]
        elif len(same_driver) == 1:
            bdf = same_driver[0]
        else:
            bdf = None
        out.append(DmabufHold(pid, buf.exporter, buf.size_bytes, buf.inode, bdf))
    return out
