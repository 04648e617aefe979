"""What the devices themselves report (--deep): unattributed memory, lost devices, firmware in
survivability mode, probe timeouts."""

from __future__ import annotations

from collections.abc import Iterator

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Finding, RuntimeView
from xpuctl.output.units import human_bytes


def _wanted_views(c: Ctx) -> Iterator[RuntimeView]:
    deep = c.snap.deep
    return (v for v in (deep.devices if deep else ()) if not c.wanted or v.bdf in c.wanted)


@check("unattributed-memory")
def unattributed_memory(c: Ctx) -> list[Finding]:
    """--deep: device memory in use that no process visible in /proc holds (minus the baseline)."""
    out = []
    for v in _wanted_views(c):
        if v.unattributed_bytes is None or v.unattributed_bytes <= c.opts.unattributed_threshold:
            continue
        pids = f"; pid(s) the device reports but /proc does not show: {', '.join(map(str, v.invisible_pids))}" \
            if v.invisible_pids else ""
        base = f", idle baseline {human_bytes(v.baseline_bytes)}" if v.baseline_bytes else ""
        out.append(Finding(
            "unattributed-memory",
            "fail",
            f"{human_bytes(v.unattributed_bytes)} of {v.bdf} memory is used by no process xpuctl can "
            f"see ({v.source} reports {human_bytes(v.memory_used_bytes)} used, visible holders "
            f"{human_bytes(v.visible_bytes)}{base}){pids}. Likely another PID namespace (a pod "
            "without hostPID, another container) or memory the driver keeps",
            f"run `xpuctl doctor --deep` on the host or in a pod with hostPID: true and stop the "
            f"holder; if nothing holds it, reset the device (as root: `xpuctl reset --device {v.bdf} "
            "--device-reset`)",
            v.bdf,
            v.invisible_pids,
        ))
    return out


def _rebind(bdf: str, driver: str | None) -> str:
    drv = driver or "xe"
    return (f"reset the device or rebind its driver, as root: `echo {bdf} > "
            f"/sys/bus/pci/drivers/{drv}/unbind; echo {bdf} > /sys/bus/pci/drivers/{drv}/bind` "
            f"(or `xpuctl reset --device {bdf} --device-reset`); every process using it must "
            "restart")


@check("device-lost")
def device_lost(c: Ctx) -> list[Finding]:
    """--deep: Level Zero, torch or the driver reports the device lost or needing a reset."""
    out = []
    for v in _wanted_views(c):
        if v.state != "lost":
            continue
        dev = c.snap.device(v.bdf)
        out.append(Finding(
            "device-lost",
            "fail",
            f"{v.bdf} is lost or wedged ({'; '.join(v.lost_reasons)}): a relaunch will fail until "
            "the device is reset",
            _rebind(v.bdf, dev.driver if dev else None),
            v.bdf,
            tuple(p.pid for p in v.processes),
        ))
    deep = c.snap.deep
    if deep is not None and deep.lost_unplaced and not c.wanted:
        out.append(Finding(
            "device-lost",
            "fail",
            f"a device is lost or wedged, and its PCI address is unknown ({'; '.join(deep.lost_unplaced)})",
            "find it in `dmesg` (wedged, GPU hang) and reset it or rebind its driver, as root: "
            "`echo BDF > /sys/bus/pci/drivers/xe/unbind; echo BDF > /sys/bus/pci/drivers/xe/bind`",
        ))
    return out


@check("device-survivability")
def device_survivability(c: Ctx) -> list[Finding]:
    """--deep: xpu-smi v2 reports the device in survivability mode (its firmware needs recovery)."""
    return [
        Finding(
            "device-survivability",
            "fail",
            f"{v.bdf} is in survivability mode ({'; '.join(v.lost_reasons)}): its firmware did not "
            "come up, nothing can run on it until it is recovered",
            "as xpu-smi recommends: update the device's firmware (`xpu-smi updatefw`) and "
            "cold-reset it (power the host off and on)",
            v.bdf,
            tuple(p.pid for p in v.processes),
        )
        for v in _wanted_views(c)
        if v.state == "survivability"
    ]


@check("probe-timeout")
def probe_timeout(c: Ctx) -> list[Finding]:
    """--deep: a probe that did not answer in time (a hung Level Zero init: a wedged device)."""
    deep = c.snap.deep
    return [
        Finding(
            "probe-timeout",
            "warn",
            f"deep probe {r.name} did not answer within {r.seconds:g} s: a runtime that hangs "
            "while initialising is a sign of a wedged device or driver",
            "check `dmesg` for GPU hang/reset or wedged messages; if the device is wedged, reset "
            "it or rebind its driver (root); raise --probe-timeout if the host is only slow",
        )
        for r in (deep.probes if deep else ())
        if r.timed_out
    ]
