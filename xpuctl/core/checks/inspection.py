"""What xpuctl could not see: inspection notes and reads that never answered."""

from __future__ import annotations

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Finding

_REMEDY_BY_SOURCE = {
    "/proc": "run as root to see every process",
    "pid-namespace": "run doctor on the host (or in a pod with hostPID: true), or add --deep",
    "ray": "make Ray reachable: XPUCTL_RAY_PYTHON (a Python with ray), RAY_ADDRESS or "
    "--ray ADDRESS (the cluster), RAY_AUTH_TOKEN (its token)",
}


@check("inspection")
def inspection(c: Ctx) -> list[Finding]:
    """What the scan could not see (processes of other users, unreadable files, other PID
    namespaces, deep probes that were unavailable), and that deep probes open the devices."""
    blocked = set(c.scan.blocked)
    out = [
        Finding(
            "inspection",
            "warn" if issue.source in ("/proc", "ray") else "info",
            issue.reason if issue.source == "pid-namespace" else f"{issue.source}: {issue.reason}",
            issue.remedy or _REMEDY_BY_SOURCE.get(issue.source),
        )
        for issue in c.scan.issues
        if issue not in blocked  # said by blocked-reads
    ]
    deep = c.scan.deep
    if deep is not None:
        for r in deep.probes:
            if not r.available and not r.timed_out:
                out.append(Finding("inspection", "info", f"deep probe {r.name} unavailable: {r.reason}"))
            for note in r.notes:
                out.append(Finding("inspection", "info", f"deep probe {r.name}: {note}"))
        if deep.probe_pids:
            out.append(Finding(
                "inspection", "info",
                "the deep probes briefly opened the devices themselves (pids "
                f"{', '.join(map(str, deep.probe_pids))}); their own DRM clients and memory are "
                "left out of every figure",
            ))
    return out


@check("blocked-reads")
def blocked_reads(c: Ctx) -> list[Finding]:
    """Reads that did not answer within the bound: a process stuck in the kernel (holding its
    mmap lock, or inside the driver), a device in reset. Nothing is judged on them."""
    out = []
    sev = "fail" if c.opts.expect_idle else "warn"
    remedy = ("a process or device stuck in the kernel: check `dmesg` for GPU hang or reset "
              "messages and the process's wchan; what it may hold is not free until it "
              "returns; raise --read-timeout if the host is only slow")
    for u in c.scan.unreadable_processes:
        if not u.blocked:
            continue
        held = sorted(b for b in (d.bdf for d in c.scan.devices) if u.pid in c.scan.unknown_holders(b))
        if not c.on_wanted(held):
            continue
        what = u.command or (f"[{u.comm}]" if u.comm else "command unknown")
        where = f", state {u.state}" if u.state else ""
        where += f" in {u.wchan}" if u.wchan and u.wchan != "0" else ""
        may = (f"; it may hold {', '.join(held)}" if held else "")
        out.append(Finding(
            "blocked-reads", sev,
            f"pid {u.pid} ({what}{where}): {u.file} {u.reason}; its role and what it holds "
            f"are unknown, it is judged neither clean nor idle{may}",
            remedy, held[0] if len(held) == 1 else None, (u.pid,), (u.file,),
        ))
    for issue in c.scan.blocked:
        parts = issue.source.split("/")
        if issue.source.startswith("/proc/") and parts[2].isascii() and parts[2].isdigit():
            continue  # a process: above
        out.append(Finding("blocked-reads", sev, f"{issue.source} {issue.reason}", remedy,
                           paths=(issue.source,)))
    return out
