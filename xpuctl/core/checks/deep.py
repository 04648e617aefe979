"""What the devices themselves report (--deep): unattributed memory, lost devices, probe
timeouts (firmware in survivability mode, which xpu-smi reports too: kernel.py)."""

from __future__ import annotations

from collections.abc import Iterator

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.collective import CollectiveResult
from xpuctl.core.model import Finding, RuntimeView
from xpuctl.core.units import human_bytes


def _wanted_views(c: Ctx) -> Iterator[RuntimeView]:
    deep = c.scan.deep
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
        dev = c.scan.device(v.bdf)
        out.append(Finding(
            "device-lost",
            "fail",
            f"{v.bdf} is lost or wedged ({'; '.join(v.lost_reasons)}): a relaunch will fail until "
            "the device is reset",
            _rebind(v.bdf, dev.driver if dev else None),
            v.bdf,
            tuple(p.pid for p in v.processes),
        ))
    deep = c.scan.deep
    if deep is not None and deep.lost_unplaced and not c.wanted:
        out.append(Finding(
            "device-lost",
            "fail",
            f"a device is lost or wedged, and its PCI address is unknown ({'; '.join(deep.lost_unplaced)})",
            "find it in `dmesg` (wedged, GPU hang) and reset it or rebind its driver, as root: "
            "`echo BDF > /sys/bus/pci/drivers/xe/unbind; echo BDF > /sys/bus/pci/drivers/xe/bind`",
        ))
    return out


@check("probe-timeout")
def probe_timeout(c: Ctx) -> list[Finding]:
    """--deep: a probe that did not answer in time (a hung Level Zero init: a wedged device)."""
    deep = c.scan.deep
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


def _bdfs(bdfs: tuple[str, ...]) -> str:
    return ", ".join(bdfs) or "no device"


@check("collective")
def collective(c: Ctx) -> list[Finding]:
    """--collective: oneCCL/XCCL init, one all_reduce and destroy across the devices, bounded;
    on one device, an allocation and a computation on the card (no collective)."""
    r = c.scan.collective
    if r is None:
        return []
    devices = _bdfs(r.bdfs)
    out = [] if not r.files else [Finding(
        "collective", "warn",
        f"{len(r.files)} file(s) the collective check's ranks left were kept: "
        + "; ".join(r.files[:4]),
        "rerun `xpuctl doctor`: once nothing holds them they are stale-ipc/stale-shm, which "
        "`xpuctl reset` removes", paths=tuple(f.split(": ", 1)[0] for f in r.files))]
    return out + _verdict_findings(r, devices)


def _verdict_findings(r: CollectiveResult, devices: str) -> list[Finding]:
    if r.verdict == "ok" and r.proof == "compute":
        return [Finding("collective", "info",
                        f"collective check passed on one device ({devices}): allocated, computed "
                        f"and synchronized on the card in {r.seconds:g} s; no collective, as vLLM "
                        "runs none at world size 1 (PR #52389)")]
    if r.verdict == "ok":
        return [Finding("collective", "info",
                        f"collective check passed: {r.backend} init_process_group, all_reduce and "
                        f"destroy on {r.world_size} device(s) ({devices}) in {r.seconds:g} s")]
    if r.verdict == "unavailable":
        return [Finding("collective", "warn",
                        f"collective check could not run on {devices}: {r.reason}",
                        "install torch with XPU support beside xpuctl (torch 2.8 or later has "
                        "the xccl backend; older torch needs intel-extension-for-pytorch and "
                        "oneccl_bind_pt), then rerun `xpuctl doctor --collective`")]
    bad = [a.bdf for a in r.alone if a.verdict != "ok"]
    if r.alone and bad:
        alone = "; alone: " + ", ".join(f"{a.bdf} {a.verdict}" + (f" in {a.phase}" if a.phase else "")
                                        for a in r.alone)
        blame = f"the card(s) at fault: {', '.join(bad)}"
    elif r.alone:
        alone, blame = "; every device passes alone", "the devices pass alone but not together"
    else:
        alone, blame = "", f"the device(s): {devices}"
    what = "hung" if r.verdict == "hung" else "failed"
    culprits = bad or list(r.bdfs)
    first = culprits[0] if culprits else "N"
    return [Finding(
        "collective",
        "fail",
        f"collective check {what} in {r.stuck_phase} on {devices} ({r.backend or 'no backend'}; "
        f"{r.reason}){alone}: a vLLM launch on them will {'hang' if what == 'hung' else 'fail'} "
        f"there ({blame})",
        "stop every process on the device(s) (`xpuctl doctor` names them), then reset or "
        f"rebind the card(s) as root (`xpuctl reset --device {first} "
        "--device-reset`) and rerun `xpuctl doctor --collective`; when the devices pass alone "
        "but not together, look at the link between them (CCL_* settings, the fabric) first",
        culprits[0] if len(culprits) == 1 else None,
    )]


@check("known-issues")
def known_issues(c: Ctx) -> list[Finding]:
    """A version `--deep` read (oneCCL, the GuC firmware, the compute runtime, the kernel)
    in the range of a row of the known-issues table (core/known.py): a warning with the
    symptom to expect and the mitigation (info for a row that holds for every current
    release, with no fixed one known)."""
    from xpuctl.core import known

    deep = c.scan.deep
    if deep is None:
        return []
    out = []
    for m in known.by_version(deep.versions):
        k = m.issue
        where = f" ({m.source})" if m.source else ""
        out.append(Finding(
            "known-issues", "warn" if k.warn else "info",
            f"{known.COMPONENTS.get(k.component, k.component)} {m.version}{where} is in the "
            f"range of a known issue ({k.key}: {k.range_text()}, seen on {k.cards}): "
            f"{k.title}: {k.symptom}",
            f"{k.mitigation} (see {', '.join(k.links)})",
        ))
    return out
