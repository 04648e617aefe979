"""doctor: scan, judge, and optionally wait until the host is clean."""

from __future__ import annotations

import time
from collections.abc import Callable

from xpuctl.checks import Options, evaluate
from xpuctl.host import Host
from xpuctl.model import Report
from xpuctl.probes.devices import scan_devices, select_devices
from xpuctl.scan import DEFAULT_PORT, take_snapshot


def resolve_device_specs(host: Host, specs: list[str]) -> tuple[str, ...]:
    """BDFs for `--device` values (each may be a comma list, as for serve --devices);
    UsageError (exit 2) for an unknown one."""
    if not specs:
        return ()
    specs = [s for item in specs for s in item.split(",")]
    devices, _ = scan_devices(host)
    return tuple(d.bdf for d in select_devices(devices, specs))


def diagnose(
    host: Host,
    devices: list[str] | None = None,
    port: int | None = None,
    expect_idle: bool = False,
    caller_env: dict[str, str] | None = None,
) -> Report:
    bdfs = resolve_device_specs(host, devices or [])
    opts = Options(
        devices=bdfs,
        port=port if port is not None else DEFAULT_PORT,
        port_explicit=port is not None,
        expect_idle=expect_idle,
    )
    snap = take_snapshot(host, port=opts.port, caller_env=caller_env)
    return evaluate(snap, opts)


def blocking(report: Report, strict: bool) -> bool:
    return report.failed or (strict and report.warned)


def wait_clean(
    first: Report,
    again: Callable[[], Report],
    seconds: float,
    strict: bool,
    interval: float = 0.5,
    tick: Callable[[Report, float], None] | None = None,
) -> tuple[Report, bool]:
    """Re-run doctor until nothing blocks or `seconds` pass. (last report, clean?)"""
    deadline = time.monotonic() + seconds
    report = first
    while blocking(report, strict):
        left = deadline - time.monotonic()
        if left <= 0:
            return report, False
        if tick:
            tick(report, left)
        time.sleep(min(interval, left))
        report = again()
    return report, True

