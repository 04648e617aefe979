"""Pure judgement: Snapshot → findings and a status. No I/O.

Check ids are stable (scripts and alerts key on them): device-holders, orphans,
device-memory, stuck-processes, stale-shm, stale-ipc, ports, env, inspection.
"""

from __future__ import annotations

from typing import NamedTuple

from xpuctl.model import Finding, Process, Report, Snapshot
from xpuctl.parse import envvars
from xpuctl.parse import roles as R

CHECKS = (
    "device-holders",
    "orphans",
    "device-memory",
    "stuck-processes",
    "stale-shm",
    "stale-ipc",
    "ports",
    "env",
    "inspection",
)


class Options(NamedTuple):
    devices: tuple[str, ...] = ()  # BDFs to look at; empty = all
    port: int | None = 8000
    port_explicit: bool = False
    expect_idle: bool = False


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def short_cmd(p: Process, width: int = 60) -> str:
    text = p.command
    return text if len(text) <= width else text[: width - 1] + "…"


def _pids(procs: list[Process]) -> tuple[int, ...]:
    return tuple(sorted(p.pid for p in procs))


def evaluate(snap: Snapshot, opts: Options) -> Report:
    wanted = set(opts.devices)

    def on_wanted(bdfs: tuple[str, ...] | set[str]) -> bool:
        return not wanted or not bdfs or bool(wanted & set(bdfs))

    findings: list[Finding] = []
    procs = list(snap.processes)
    by_pid = {p.pid: p for p in procs}
    live = [p for p in procs if not p.is_zombie]

    # -- orphans: one finding per orphaned tree --------------------------------------
    trees: dict[int, list[Process]] = {}
    for p in live:
        if p.orphan:
            trees.setdefault(p.top or p.pid, []).append(p)
    for top, members in sorted(trees.items()):
        devs = sorted({b for m in members for b in m.devices})
        if not on_wanted(devs):
            continue
        # with --device, an orphaned tree that holds none of the devices is a warning
        severity = "warn" if wanted and not devs else "fail"
        head = by_pid.get(top) or members[0]
        mem = sum(m.memory_bytes or 0 for m in members)
        what = ", ".join(f"{m.cmdline[0] if m.cmdline else m.comm} ({m.pid})" for m in members)
        held = f"; they hold {', '.join(devs)}" if devs else ""
        if mem:
            held += f" ({human_bytes(mem)} of device memory)"
        findings.append(
            Finding(
                "orphans",
                severity,
                f"orphaned vLLM processes whose API server is gone: {what}{held}",
                f"xpuctl shutdown --pid {head.pid}",
                devs[0] if len(devs) == 1 else None,
                _pids(members),
            )
        )

    # -- per device: holders and memory -----------------------------------------------
    for dev in snap.devices:
        if wanted and dev.bdf not in wanted:
            continue
        holders = [by_pid[pid] for pid in snap.holders(dev.bdf) if pid in by_pid]
        serving = [p for p in holders if p.role is not None and not p.orphan]
        foreign = [p for p in holders if p.role is None]
        orphaned = [p for p in holders if p.orphan]
        if serving:
            tops = sorted({p.top or p.pid for p in serving})
            findings.append(
                Finding(
                    "device-holders",
                    "fail" if opts.expect_idle else "info",
                    f"{dev.bdf} is busy: held by the live vLLM server {', '.join(map(str, tops))} "
                    f"({len(serving)} process(es))",
                    f"xpuctl shutdown --pid {tops[0]}" if opts.expect_idle else None,
                    dev.bdf,
                    _pids(serving),
                )
            )
        for p in foreign:
            has_mem = bool(p.memory_bytes)
            sev = "fail" if opts.expect_idle else ("warn" if has_mem else "info")
            mem = f" with {human_bytes(p.memory_bytes)} of device memory" if has_mem else ""
            findings.append(
                Finding(
                    "device-holders",
                    sev,
                    f"{dev.bdf} is held by pid {p.pid} ({short_cmd(p)}), not part of a vLLM "
                    f"server{mem}",
                    f"check what pid {p.pid} is doing; stop it before serving on {dev.bdf}"
                    if sev != "info"
                    else None,
                    dev.bdf,
                    (p.pid,),
                )
            )
        orphan_mem = sum(p.memory_bytes or 0 for p in orphaned)
        if orphan_mem:
            findings.append(
                Finding(
                    "device-memory",
                    "fail",
                    f"{human_bytes(orphan_mem)} of {dev.bdf} memory is held by orphaned vLLM "
                    "processes; the next server on this device will run out of memory",
                    f"xpuctl shutdown --device {dev.bdf}",
                    dev.bdf,
                    _pids(orphaned),
                )
            )
        dmabuf_only = sorted(
            {b.pid for b in snap.dmabufs if b.bdf == dev.bdf}
            - {pid for c in snap.clients if c.bdf == dev.bdf for pid in c.pids}
        )
        if dmabuf_only:
            size = sum(
                b.size_bytes or 0 for b in snap.dmabufs if b.bdf == dev.bdf and b.pid in dmabuf_only
            )
            findings.append(
                Finding(
                    "device-memory",
                    "fail" if opts.expect_idle else "warn",
                    f"{human_bytes(size)} of {dev.bdf} memory is kept alive by exported buffers "
                    f"(dma-buf) held by pid(s) {', '.join(map(str, dmabuf_only))}",
                    "stop the processes holding the buffers",
                    dev.bdf,
                    tuple(dmabuf_only),
                )
            )
        used = snap.memory_used(dev.bdf)
        if opts.expect_idle and used and not holders and not dmabuf_only:
            findings.append(
                Finding("device-memory", "fail", f"{human_bytes(used)} of {dev.bdf} in use", None, dev.bdf)
            )

    # -- stuck processes ---------------------------------------------------------------
    for p in procs:
        if not on_wanted(p.devices):
            continue
        if p.state == "D" and (p.devices or p.role):
            findings.append(
                Finding(
                    "stuck-processes",
                    "fail" if p.orphan or opts.expect_idle else "warn",
                    f"pid {p.pid} ({short_cmd(p, 40)}) is in uninterruptible sleep (D) in "
                    f"{p.wchan or 'an unknown kernel function'}; it cannot die until the driver "
                    "returns",
                    "wait for the driver; if it never returns, the device needs a reset "
                    "(xpu-smi or a PCI reset) or the host a reboot",
                    p.devices[0] if len(p.devices) == 1 else None,
                    (p.pid,),
                )
            )
        elif p.state == "T" and p.role:
            findings.append(
                Finding(
                    "stuck-processes",
                    "warn",
                    f"vLLM process {p.pid} ({short_cmd(p, 40)}) is stopped (T)",
                    f"kill -CONT {p.pid}",
                    None,
                    (p.pid,),
                )
            )
        elif p.state == "Z" and p.role in (R.ENGINE_CORE, R.WORKER):
            findings.append(
                Finding(
                    "stuck-processes",
                    "info",
                    f"vLLM process {p.pid} is a zombie: it holds nothing, its parent "
                    f"{p.ppid} has not reaped it",
                    None,
                    None,
                    (p.pid,),
                )
            )

    # -- stale files -----------------------------------------------------------------
    stale_shm = [a for a in snap.artifacts if a.stale and a.kind == "shm"]
    stale_ipc = [a for a in snap.artifacts if a.stale and a.kind != "shm"]
    if stale_shm:
        size = sum(a.size_bytes for a in stale_shm)
        findings.append(
            Finding(
                "stale-shm",
                "warn",
                f"{len(stale_shm)} stale shared-memory segment(s) in /dev/shm "
                f"({human_bytes(size)}) left by killed processes",
                "xpuctl reset",
                None,
                (),
                tuple(a.path for a in stale_shm),
            )
        )
    if stale_ipc:
        kinds = sorted({a.kind for a in stale_ipc})
        findings.append(
            Finding(
                "stale-ipc",
                "warn",
                f"{len(stale_ipc)} stale IPC file(s) ({', '.join(kinds)}) in /tmp",
                "xpuctl reset",
                None,
                (),
                tuple(a.path for a in stale_ipc),
            )
        )

    # -- ports -----------------------------------------------------------------------
    orphan_ports: dict[int, list[int]] = {}
    for port in snap.ports:
        if port.pid is None:
            continue
        p = by_pid.get(port.pid)
        if port.orphan:
            top = p.top if p and p.top else port.pid
            orphan_ports.setdefault(top, []).append(port.port)
        elif port.port == opts.port:
            if p is not None and p.role is not None:
                findings.append(
                    Finding(
                        "ports",
                        "fail" if opts.expect_idle else "info",
                        f"port {port.port} is served by the live vLLM server {p.top or p.pid}",
                        None,
                        None,
                        (port.pid,),
                    )
                )
            else:
                findings.append(
                    Finding(
                        "ports",
                        "fail" if opts.port_explicit or opts.expect_idle else "warn",
                        f"port {port.port} is in use by pid {port.pid}, not a vLLM server; a "
                        "server on it will fail with 'Address already in use'",
                        f"pick another --port or stop pid {port.pid}",
                        None,
                        (port.pid,),
                    )
                )
    for top, numbers in sorted(orphan_ports.items()):
        tree_devs = sorted({b for m in trees.get(top, []) for b in m.devices})
        if not on_wanted(tree_devs):
            continue
        numbers = sorted(set(numbers))
        pids = tuple(sorted({pt.pid for pt in snap.ports if pt.orphan and pt.pid and pt.port in numbers}))
        shown = ", ".join(map(str, numbers[:8])) + (f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")
        serving = opts.port in numbers
        findings.append(
            Finding(
                "ports",
                # with --device, another device's orphans only matter if they hold our port
                "fail" if serving or not (wanted and not tree_devs) else "warn",
                f"orphaned vLLM processes of tree {top} still listen on port(s) {shown}",
                f"xpuctl shutdown --pid {top}",
                None,
                pids,
            )
        )

    # -- the caller's environment ---------------------------------------------------
    env = snap.caller_env or {}
    intel = sum(1 for d in snap.devices if d.is_intel)
    problems = []
    if "ZE_AFFINITY_MASK" in env:
        problems.append(envvars.check_affinity_mask(env["ZE_AFFINITY_MASK"], intel or None))
    if "ONEAPI_DEVICE_SELECTOR" in env:
        problems.append(envvars.check_device_selector(env["ONEAPI_DEVICE_SELECTOR"]))
    if "ZE_FLAT_DEVICE_HIERARCHY" in env:
        problems.append(envvars.check_hierarchy(env["ZE_FLAT_DEVICE_HIERARCHY"]))
    for problem in filter(None, problems):
        findings.append(
            Finding("env", "fail", problem, "fix or unset the variable before serving")
        )

    # -- what we could not see -------------------------------------------------------
    for issue in snap.issues:
        sev = "warn" if issue.source == "/proc" else "info"
        findings.append(
            Finding(
                "inspection",
                sev,
                f"{issue.source}: {issue.reason}",
                "run as root to see every process" if issue.source == "/proc" else None,
            )
        )

    failed = any(f.severity == "fail" for f in findings)
    busy = any(snap.holders(d.bdf) for d in snap.devices if not wanted or d.bdf in wanted) or any(
        p.pid is not None and p.port == opts.port for p in snap.ports
    )
    status = "dirty" if failed else ("busy" if busy else "clean")
    order = {"fail": 0, "warn": 1, "info": 2}
    findings.sort(key=lambda f: (order[f.severity], CHECKS.index(f.check)))
    return Report(snap, tuple(findings), status)
