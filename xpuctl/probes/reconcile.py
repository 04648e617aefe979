"""Reconciliation: the probes' view of each device set against what fdinfo shows.

`attach` fills `scan.deep` (model.Deep) and the devices' missing memory totals.
"""

from __future__ import annotations

from typing import Any

from xpuctl.core.model import Deep, RuntimeView, Scan
from xpuctl.host.seam import Host
from xpuctl.parse.health import worst
from xpuctl.parse.probes import ProbeProcess, ProbeResult

USED_ORDER = ("kmd", "sysman", "torch")  # best source of used memory first (then a process list)


def _bdf_for(scan: Scan, bdf: str | None, index: int | None) -> str | None:
    if bdf:
        return bdf
    if index is not None:
        for d in scan.devices:
            if d.is_intel and d.index == index:
                return d.bdf
    return None


def _placed(scan: Scan, results: tuple[ProbeResult, ...]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each available probe's answer per BDF ({bdf: {probe: device}}), and the lost devices
    no BDF could be found for."""
    seen: dict[str, dict[str, Any]] = {}
    unplaced: list[str] = []
    for r in results:
        if not r.available:
            continue
        for n, pd in enumerate(r.devices):
            bdf = _bdf_for(scan, pd.bdf, pd.index)
            if bdf is not None:
                seen.setdefault(bdf, {}).setdefault(r.name, pd)
            elif pd.state == "lost":
                unplaced.append(f"{r.name} device #{n}: {pd.reason or 'device lost'}")
    return seen, unplaced


def _listed(entries: dict[str, Any], own: frozenset[int]) -> tuple[dict[int, ProbeProcess], list[str], int]:
    """The processes the probes list (the probes' own left out), the probes that listed
    them, and the memory the probes' own contexts use: each probe once, the most any lister
    saw of it. The probes run at once, so a used figure may hold `xpu-smi ps`'s own
    allocation (about 211 MB; it lists itself: xpumanager #116) though another lister did
    not see it: a probe's own memory is never counted as a leak."""
    procs: dict[int, ProbeProcess] = {}
    psources: list[str] = []
    own_seen: dict[int, int] = {}
    for n in ("sysman", "xpu-smi"):
        listed = entries[n].processes if n in entries else None
        if listed is None:
            continue
        psources.append(n)
        for p in listed:
            if p.pid in own:
                own_seen[p.pid] = max(own_seen.get(p.pid, 0), p.memory_bytes or 0)
                continue
            procs.setdefault(p.pid, p)
    return procs, psources, sum(own_seen.values())


def _view(host: Host, scan: Scan, bdf: str, entries: dict[str, Any], own: frozenset[int],
          base: int) -> RuntimeView:
    """One device: used memory from the best source, the listed processes, what is left."""
    source = next((n for n in USED_ORDER if n in entries and entries[n].memory_used_bytes is not None), None)
    used = entries[source].memory_used_bytes if source else None
    total = next((entries[n].memory_total_bytes for n in USED_ORDER
                  if n in entries and entries[n].memory_total_bytes), None)
    procs, psources, own_bytes = _listed(entries, own)
    if used is not None and source != "torch":
        used = max(0, used - own_bytes)  # the probes' own contexts
    sizes = [p.memory_bytes for p in procs.values() if p.memory_bytes is not None]
    if used is None and psources and (sizes or not procs):
        # no memory figure: the listed processes' memory is a lower bound of what is used
        # (none when the lister gave no sizes: xpu-smi of an unknown version)
        used = sum(sizes)
        source = psources[0]
    lost = tuple(f"{n}: {e.reason or 'device lost'}" for n, e in sorted(entries.items()) if e.state == "lost")
    surv = tuple(f"{n}: {e.reason or 'survivability mode'}" for n, e in sorted(entries.items())
                 if e.state == "survivability")
    visible = scan.memory_used(bdf) or 0
    return RuntimeView(
        bdf=bdf,
        source=source,
        memory_used_bytes=used,
        memory_total_bytes=total,
        processes=tuple(sorted(procs.values())),
        process_source="+".join(psources) or None,
        state="lost" if lost else "survivability" if surv else "ok",
        lost_reasons=lost or surv,
        visible_bytes=visible,
        baseline_bytes=base,
        unattributed_bytes=max(0, used - visible - base) if used is not None else None,
        invisible_pids=tuple(sorted(pid for pid in procs if not host.exists(f"/proc/{pid}"))),
        health=worst(*(e.health for e in entries.values())),
    )


def reconcile(host: Host, scan: Scan, results: tuple[ProbeResult, ...],
              baseline: dict[str, int] | None = None,
              probe_pids: frozenset[int] | tuple[int, ...] = ()) -> Deep:
    """Per device: used memory from the best source, minus what visible holders have in
    fdinfo, minus the idle baseline. Pure arithmetic apart from the /proc existence checks."""
    baseline = baseline or {}
    own = frozenset(probe_pids)
    seen, unplaced = _placed(scan, results)
    order = [d.bdf for d in scan.devices if d.is_intel] + sorted(set(seen) - {d.bdf for d in scan.devices})
    views = [_view(host, scan, bdf, seen.get(bdf, {}), own, baseline.get(bdf, 0)) for bdf in order]
    return Deep(tuple(results), tuple(views), tuple(sorted(own)), tuple(unplaced))


def attach(host: Host, scan: Scan, results: tuple[ProbeResult, ...],
           baseline: dict[str, int] | None = None,
           probe_pids: frozenset[int] | tuple[int, ...] = ()) -> Scan:
    """The scan with `deep` set and memory totals from a probe where sysfs has none."""
    deep = reconcile(host, scan, results, baseline, probe_pids)
    devices = tuple(
        d._replace(memory_total_bytes=v.memory_total_bytes)
        if d.memory_total_bytes is None and (v := deep.device(d.bdf)) and v.memory_total_bytes
        else d
        for d in scan.devices
    )
    return scan._replace(devices=devices, deep=deep)
