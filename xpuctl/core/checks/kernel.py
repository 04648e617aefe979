"""What the kernel said about the devices: declared wedged, hung or reset, a crash dump held."""

from __future__ import annotations

import time

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Device, Finding


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
        if event is None or not d.is_intel:
            continue
        out.append(Finding(
            "device-wedged", "fail",
            f"{_name(d)} was declared wedged by the kernel "
            f"{_when(event.record.seconds, log.wall_time(event))}: \"{event.record.line()}\"; "
            "nothing on it will run (vLLM's start hangs or fails) until the driver is rebound",
            f"save a pending crash dump, stop its users, then `{rebind_command(d)}`",
            d.bdf,
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
