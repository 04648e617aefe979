"""What `ps` and `devices` list: the vLLM processes and xpuctl's runs; the devices, with what
the devices themselves report under --deep (and the idle baseline it can record)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from xpuctl.core.model import Process, Scan
from xpuctl.core.runrecords import RunRow, Unread
from xpuctl.host.seam import Host


class ProcessListing(NamedTuple):
    runs: list[RunRow]  # xpuctl's active runs from their records (gone ones: "stale")
    processes: list[Process]
    scan: Scan  # the scan, for the device labels
    unread: tuple[Unread, ...] = ()  # the records (or directories) not read


def list_processes(host: Host, specs: list[str], show_all: bool, state_dir: str | None,
                   environ: Mapping[str, str]) -> ProcessListing:
    """vLLM processes (every device holder with `show_all`), narrowed to the trees that hold
    the devices in `specs` (a tree's members without a device stay with it). Ray actors
    holding devices are tied to their run through Ray's state (`environ`: where Ray is)."""
    from xpuctl.host.devices import resolve_device_specs
    from xpuctl.host.scan import take_scan
    from xpuctl.ray.actors import with_ray
    from xpuctl.state.live import RunsShown, recorded_runs, runs_shown

    bdfs = set(resolve_device_specs(host, specs))
    scan = with_ray(host, take_scan(host, port=None, artifacts=False,
                                    runs=recorded_runs(state_dir)), environ)
    procs = [
        p
        for p in scan.processes
        if (p.role is not None or show_all) and (not bdfs or bdfs & p.tied or (p.role and not p.devices))
    ]
    if bdfs:  # a tree counts for the devices it is tied to (held, or claimed: --device scope)
        tops = {p.top for p in procs if bdfs & p.tied}
        procs = [p for p in procs if p.devices or p.top in tops]
    shown = runs_shown(host, state_dir) if state_dir and host.proc_is_live else RunsShown([], [])
    return ProcessListing(shown.rows, procs, scan._replace(processes=tuple(procs)),
                          tuple(shown.unread))


def list_devices(host: Host, environ: dict[str, str], deep: Any, record_baseline: bool,
                 replayed: Any) -> tuple[Scan, list[tuple[str, int | None, str]] | None]:
    """The devices scan, and with `record_baseline` what was recorded as each idle device's
    baseline (the scan is then shown against it). `deep`: DeepOptions for --deep, else None;
    `replayed`: a --deep snapshot's probes, shown as devices --deep showed them."""
    options: dict[str, Any] = {"port": None, "want_env": False, "artifacts": False}
    if deep is None and replayed is None:
        from xpuctl.host.scan import take_scan
        from xpuctl.ray.actors import with_ray

        return with_ray(host, take_scan(host, **options), environ), None
    from xpuctl.diagnosis import DeepOptions, deep_scan

    if deep is not None and record_baseline:
        from xpuctl.probes import baseline, reconcile

        scan = deep_scan(host, environ, deep._replace(state_dir=None), **options)
        recorded = baseline.record_baseline(deep.state_dir, scan)
        idle, _ = baseline.load_baseline(deep.state_dir)
        assert scan.deep is not None
        return reconcile.attach(host, scan, scan.deep.probes, idle, scan.deep.probe_pids), recorded
    if deep is not None:
        return deep_scan(host, environ, deep, **options), None
    return deep_scan(host, {}, DeepOptions(recorded=replayed), **options), None
