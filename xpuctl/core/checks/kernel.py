"""What the kernel said about the devices: declared wedged (and the recovery it asked for),
hung or reset, a crash dump held, firmware in survivability mode; the card's own verdict on
its health (xe's gpu_health, Sysman's health extension)."""

from __future__ import annotations

import time

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Device, Finding

VENDOR = "vendor-specific"  # DRM_WEDGE_RECOVERY_VENDOR's name in the uevent (parse/kmsg.py)


def _name(d: Device) -> str:
    return f"device {d.index if d.index is not None else '-'} ({d.bdf}, {d.driver or 'no driver'})"


def _when(seconds: float, wall: float | None) -> str:
    at = f"{seconds:.0f} s after boot"
    if wall is not None:
        at += time.strftime(", %Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))
    return at


def rebind_command(d: Device) -> str:
    return f"xpuctl reset --device {d.index if d.index is not None else d.bdf} --rebind"


@check("device-wedged")
def device_wedged(c: Ctx) -> list[Finding]:
    """A device the driver declared wedged and has not initialised since: every ioctl fails
    until the driver is rebound (or the bus reset)."""
    log = c.scan.kernel
    if log is None:
        return []
    out = []
    for d in c.devices():
        event = log.wedged(d.bdf)
        if event is None or not d.is_intel or d.survivability is not None:
            continue  # a card in survivability mode: device-survivability (a rebind cannot help)
        method = log.wedge_method(d.bdf)
        said = f" (recovery: WEDGED={method})" if method else ""
        if method is not None and VENDOR in method.split(","):
            until, remedy = "until its firmware is flashed (a rebind cannot help)", FLASH
        else:
            until = "until the driver is rebound"
            remedy = f"save a pending crash dump, stop its users, then `{rebind_command(d)}`"
        out.append(Finding(
            "device-wedged", "fail",
            f"{_name(d)} was declared wedged by the kernel "
            f"{_when(event.record.seconds, log.wall_time(event))}: \"{event.record.line()}\""
            f"{said}; nothing on it will run (vLLM's start hangs or fails) {until}",
            remedy, d.bdf,
        ))
    return out


@check("gpu-hang")
def gpu_hang(c: Ctx) -> list[Finding]:
    """GPU hang or reset records of a device that is not wedged: it recovered, but what ran
    on it lost its work."""
    log = c.scan.kernel
    if log is None:
        return []
    out = []
    for d in c.devices():
        if not d.is_intel or log.wedged(d.bdf) is not None:
            continue
        hangs = log.hangs(d.bdf)
        if not hangs:
            continue
        last = hangs[-1]
        out.append(Finding(
            "gpu-hang", "warn",
            f"{_name(d)}: {len(hangs)} GPU hang/reset record(s) in the kernel log, the last "
            f"{_when(last.record.seconds, log.wall_time(last))}: \"{last.record.line()}\"",
            "check `dmesg` for the engine and the process; if work on it keeps failing, "
            f"`{rebind_command(d)}`",
            d.bdf,
        ))
    return out


@check("devcoredump")
def devcoredump(c: Ctx) -> list[Finding]:
    """A crash dump the kernel holds for a device: lost on a rebind (and after its timeout)."""
    wanted = {d.bdf: d for d in c.devices()}
    out = []
    for dump in c.scan.coredumps:
        d = wanted.get(dump.bdf)
        if d is None:
            continue
        age = f", {dump.age_seconds:.0f} s old" if dump.age_seconds is not None else ""
        out.append(Finding(
            "devcoredump", "warn",
            f"{_name(d)} has a pending GPU crash dump ({dump.path}{age})",
            f"save it before a rebind: `cp {dump.path} devcoredump-{dump.bdf}.txt`",
            d.bdf, paths=(dump.path,),
        ))
    return out


FLASH = ("flash the card's firmware (fwupd, or `xpu-smi updatefw`), then reboot or cold-reset "
         "the host; a rebind or a device reset does not bring it back")


@check("device-survivability")
def device_survivability(c: Ctx) -> list[Finding]:
    """A card in survivability mode: xe's `survivability_mode` in its PCI directory (no
    --deep needed), or xpu-smi v2's device_state (--deep). Nothing runs on it until its
    firmware is flashed; in runtime mode xe also declared it wedged."""
    out = []
    seen = set()
    for d in c.devices():
        if d.survivability is None:
            continue
        seen.add(d.bdf)
        if d.survivability == "Boot":
            what = ("boot survivability mode: its firmware did not come up, xe loaded without a "
                    "DRM device (no render node)")
        elif d.survivability == "Runtime":
            what = ("runtime survivability mode: a firmware error, xe declared it wedged")
        else:
            what = "survivability mode (type unknown: reading it needs root)"
        out.append(Finding(
            "device-survivability", "fail",
            f"{_name(d)} is in {what} (/sys/bus/pci/devices/{d.bdf}/survivability_mode); "
            "nothing can run on it, serve refuses it and a rebind cannot help",
            FLASH, d.bdf,
        ))
    deep = c.scan.deep
    for v in (deep.devices if deep else ()):
        if (c.wanted and v.bdf not in c.wanted) or v.state != "survivability" or v.bdf in seen:
            continue
        out.append(Finding(
            "device-survivability", "fail",
            f"{v.bdf} is in survivability mode ({'; '.join(v.lost_reasons)}): its firmware did "
            "not come up, nothing can run on it until it is recovered",
            "as xpu-smi recommends: update the device's firmware (`xpu-smi updatefw`) and "
            "cold-reset it (power the host off and on)",
            v.bdf,
            tuple(p.pid for p in v.processes),
        ))
    return out


REPLACE = ("the card's own health monitor gave up on it (kept across resets): a rebind or a "
           "device reset cannot bring it back; take it out of service and have it replaced "
           "(or ask the vendor)")


def _health_severity(level: str | None) -> str | None:
    """warning: warn; critical or failed: fail; ok, unknown or untold: nothing."""
    if level == "warning":
        return "warn"
    return "fail" if level in ("critical", "failed") else None


@check("device-health")
def device_health(c: Ctx) -> list[Finding]:
    """The card's own verdict: xe's gpu_health in its PCI directory (warning: warn, critical:
    fail; no --deep needed), and Level Zero Sysman's health extension (--deep; WARNING: warn,
    CRITICAL or FAILED: fail, FAILED kept across resets)."""
    out = []
    for d in c.devices():
        sev = _health_severity(d.health)
        if sev is None:
            continue
        out.append(Finding(
            "device-health", sev,
            f"{_name(d)} says its health is {d.health} (/sys/bus/pci/devices/{d.bdf}/gpu_health)",
            "see `dmesg` for the driver's reason; drain its work and check its temperature, "
            "power and error counters (`xpu-smi stats`) before trusting it"
            if sev == "warn" else
            f"stop using it: drain its work, then `{rebind_command(d)}`; if it stays critical, "
            "take it out of service",
            d.bdf,
        ))
    deep = c.scan.deep
    for v in (deep.devices if deep else ()):
        sev = _health_severity(v.health)
        if (c.wanted and v.bdf not in c.wanted) or sev is None:
            continue
        out.append(Finding(
            "device-health", sev,
            f"{v.bdf}: Level Zero Sysman says its health is {(v.health or '').upper()} "
            "(zesDeviceGetHealthStatusExt)",
            REPLACE if v.health == "failed" else
            "drain its work and look at `dmesg` and `xpu-smi stats` before trusting it",
            v.bdf,
        ))
    return out
