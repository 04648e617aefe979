"""Who holds the devices: no device, orphans, holders, device memory, stuck processes."""

from __future__ import annotations

from xpuctl.core.checks.registry import Ctx, check, pids
from xpuctl.core.checks.registry import holders as device_holders_of
from xpuctl.core.model import Finding, Process
from xpuctl.core.units import human_bytes, shorten
from xpuctl.parse import roles

#: A process's device memory on one card at or below this is an idle Level Zero context, not
#: a leak: every process that initialises Level Zero keeps about 20 MiB on each card it sees
#: (xpu-smi 2.4's ps hides them); a margin above that, well below any model's weights.
IDLE_CONTEXT_BYTES = 32 << 20


def memory_on(c: Ctx, pid: int, bdf: str) -> int:
    """The device memory (fdinfo drm-total) of the DRM clients on one card a process holds."""
    return c.memory.get((pid, bdf), 0)


def _in(p: Process) -> str:
    """` in pod serving/llama-0, container vllm` for a process in a container, else ``."""
    return f" in {p.container.label}" if p.container is not None else ""


def _pods(procs: list[Process]) -> str:
    """`; in pod serving/llama-0, container vllm` for the containers of some processes."""
    labels = sorted({p.container.label for p in procs if p.container is not None})
    return f"; in {'; '.join(labels)}" if labels else ""


def _tree_tied(c: Ctx, top: int) -> frozenset[str]:
    """The devices a tree is tied to: held by one of its processes, or named by its
    ZE_AFFINITY_MASK or its proven run's record (what --device scopes by)."""
    return frozenset().union(*(p.tied for p in c.scan.processes if (p.top or p.pid) == top))


@check("no-device")
def no_device(c: Ctx) -> list[Finding]:
    """No Intel GPU on this host (or none visible here): every other check sees nothing.

    A warning, not a failure: nothing is left behind that reset could clean, and a script's
    exit 1 means "clean up"; --strict (or the JSON check id) makes it count."""
    if any(d.is_intel for d in c.scan.devices):
        return []
    others = ", ".join(f"{d.bdf} ({d.driver or 'no driver'}, vendor {d.vendor_id or '?'})" for d in c.scan.devices)
    seen = f"other DRM devices: {others}" if others else "no DRM device under /sys/class/drm"
    return [
        Finding(
            "no-device",
            "warn",
            f"no Intel GPU found ({seen})",
            "check that the xe or i915 driver is loaded (lsmod) and that /dev/dri is visible "
            "here (a container needs the devices passed in)",
        )
    ]


def _being_stopped(c: Ctx) -> list[Finding]:
    """The remains of runs whose API server is gone while their supervisor lives and stops
    them (core/trees): that run's, being stopped, no leak and nothing for reset to do."""
    runs: dict[str, list[Process]] = {}
    for p in c.scan.processes:
        if p.stopping_by is not None and not p.is_zombie and c.on_wanted(sorted(p.tied)):
            runs.setdefault(p.stopping_by, []).append(p)
    out = []
    for name, members in sorted(runs.items()):
        devs = sorted({b for m in members for b in m.devices})
        what = ", ".join(f"{m.cmdline[0] if m.cmdline else m.comm} ({m.pid})" for m in members)
        held = f"; they hold {', '.join(devs)}" if devs else ""
        out.append(Finding(
            "orphans", "info",
            f"vLLM processes of run {name} whose API server is gone are being stopped by run "
            f"{name} (its supervisor lives and stops them; no orphans): {what}{held}"
            f"{_pods(members)}",
            None, devs[0] if len(devs) == 1 else None, pids(members),
        ))
    return out


@check("orphans")
def orphans(c: Ctx) -> list[Finding]:
    """One finding per orphaned vLLM tree (its API server and its run's supervisor, or its
    launcher, are gone); one note per run whose supervisor is stopping what its dead API
    server left (being stopped: no orphans)."""
    out = _being_stopped(c)
    for top, members in sorted(c.trees.items()):
        devs = sorted({b for m in members for b in m.devices})
        if not c.on_wanted(sorted(_tree_tied(c, top))):
            continue
        # with --device, an orphaned tree tied to no device is a warning (reset --device
        # leaves it: which device it was for is unknown)
        severity = "warn" if c.wanted and not _tree_tied(c, top) else "fail"
        head = c.by_pid.get(top) or members[0]
        mem = sum(m.memory_bytes or 0 for m in members)
        what = ", ".join(f"{m.cmdline[0] if m.cmdline else m.comm} ({m.pid})" for m in members)
        held = f"; they hold {', '.join(devs)}" if devs else ""
        if mem:
            held += f" ({human_bytes(mem)} of device memory)"
        held += _pods(members)
        out.append(
            Finding(
                "orphans",
                severity,
                f"orphaned vLLM processes whose API server or launcher is gone: {what}{held}",
                f"xpuctl shutdown --pid {head.pid}",
                devs[0] if len(devs) == 1 else None,
                pids(members),
            )
        )
    return out




def _embedded(c: Ctx) -> dict[int, list[Process]]:
    """vLLM run as a library, by the pid of the live process it is embedded in."""
    out: dict[int, list[Process]] = {}
    for p in c.scan.processes:
        if p.embedded_in is not None and not p.is_zombie:
            out.setdefault(p.embedded_in.pid, []).append(p)
    return out


@check("device-holders")
def device_holders(c: Ctx) -> list[Finding]:
    """Who holds each device: a live server (busy), vLLM embedded in a live process (run as a
    library: busy, never an orphan), or a process that is not vLLM."""
    out = []
    embedded = _embedded(c)
    for dev in c.devices():
        holders = device_holders_of(c, dev.bdf)
        serving = [p for p in holders if p.role not in (None, roles.RAY) and not p.orphan
                   and p.embedded_in is None]
        if serving:
            tops = sorted({p.top or p.pid for p in serving})
            out.append(
                Finding(
                    "device-holders",
                    "fail" if c.opts.expect_idle else "info",
                    f"{dev.bdf} is busy: held by the live vLLM server {', '.join(map(str, tops))} "
                    f"({len(serving)} process(es)){_pods(serving)}",
                    f"xpuctl shutdown --pid {tops[0]}" if c.opts.expect_idle else None,
                    dev.bdf,
                    pids(serving),
                )
            )
        for owner, members in sorted(embedded.items()):
            # its processes on this device, the launcher too when it holds it itself
            pids_of = {owner, *(m.pid for m in members)}
            mine = [p for p in holders if p.pid in pids_of]
            if not mine:
                continue
            launcher = members[0].embedded_in
            assert launcher is not None
            why = ("whether it is an orphan is not judged (see blocked-reads)" if launcher.blocked
                   else "it runs vLLM as a library, it is no orphan")
            out.append(
                Finding(
                    "device-holders",
                    "fail" if c.opts.expect_idle else ("warn" if launcher.blocked else "info"),
                    f"{dev.bdf} is busy: held by {launcher.describe()} "
                    f"({len(mine)} process(es)){_pods(mine)}; {why}",
                    f"stop pid {owner} itself when its work is done" if c.opts.expect_idle else None,
                    dev.bdf,
                    pids(mine),
                )
            )
        # whether a blocked one is vLLM is unknown: see blocked-reads
        out += [_not_vllm(c, dev.bdf, p) for p in holders
                if p.role is None and p.pid not in embedded and not p.blocked]
    return out


def _not_vllm(c: Ctx, bdf: str, p: Process) -> Finding:
    """A device held by a process that is not part of a vLLM server."""
    on_dev = memory_on(c, p.pid, bdf)
    idle = 0 < on_dev <= IDLE_CONTEXT_BYTES
    has_mem = bool(on_dev) and not idle
    sev = "fail" if c.opts.expect_idle else ("warn" if has_mem else "info")
    mem = f" with {human_bytes(on_dev)} of device memory" if has_mem else ""
    if idle:
        mem = (f" with an idle Level Zero context ({human_bytes(on_dev)}; every process "
               "that initialises Level Zero keeps about 20 MiB on each card): not a leak")
    what = f"pid {p.pid} ({shorten(p.command)}){_in(p)}"
    if p.ray is not None:  # another Ray job's actor: named by Ray, never vLLM's
        label = f"{p.ray.class_name or '?'}" + (f" '{p.ray.name}'" if p.ray.name else "")
        what = f"Ray actor {label} of job {p.ray.job_id or '?'} (pid {p.pid}){_in(p)}"
    fix = (f"check what pid {p.pid} is doing; stop it before serving on {bdf}"
           if sev != "info" else None)
    return Finding("device-holders", sev,
                   f"{bdf} is held by {what}, not part of a vLLM server{mem}", fix, bdf, (p.pid,))


@check("device-memory")
def device_memory(c: Ctx) -> list[Finding]:
    """Device memory held by orphans, kept alive by exported buffers, or in use when idle is expected."""
    out = []
    scan = c.scan
    for dev in c.devices():
        holders = device_holders_of(c, dev.bdf)
        orphaned = [p for p in holders if p.orphan]
        orphan_mem = sum(p.memory_bytes or 0 for p in orphaned)
        if orphan_mem:
            out.append(
                Finding(
                    "device-memory",
                    "fail",
                    f"{human_bytes(orphan_mem)} of {dev.bdf} memory is held by orphaned vLLM "
                    f"processes{_pods(orphaned)}; the next server on this device will run out of "
                    "memory",
                    f"xpuctl shutdown --device {dev.bdf}",
                    dev.bdf,
                    pids(orphaned),
                )
            )
        dmabuf_only = sorted(
            {b.pid for b in scan.dmabufs if b.bdf == dev.bdf}
            - {pid for cl in scan.clients if cl.bdf == dev.bdf for pid in cl.pids}
        )
        if dmabuf_only:
            size = sum(
                b.size_bytes or 0 for b in scan.dmabufs if b.bdf == dev.bdf and b.pid in dmabuf_only
            )
            out.append(
                Finding(
                    "device-memory",
                    "fail" if c.opts.expect_idle else "warn",
                    f"{human_bytes(size)} of {dev.bdf} memory is kept alive by exported buffers "
                    f"(dma-buf) held by pid(s) {', '.join(map(str, dmabuf_only))}",
                    "stop the processes holding the buffers",
                    dev.bdf,
                    tuple(dmabuf_only),
                )
            )
        used = scan.memory_used(dev.bdf)
        if c.opts.expect_idle and used and not holders and not dmabuf_only:
            out.append(
                Finding("device-memory", "fail", f"{human_bytes(used)} of {dev.bdf} in use", None, dev.bdf)
            )
    return out


def _lone_ranks(c: Ctx) -> list[Finding]:
    """oneCCL ranks whose peers are gone (core/oneccl.py): they wait in a collective for ever."""
    from xpuctl.core.oneccl import lone_ranks

    out = []
    for p in lone_ranks(c.scan.processes):
        if not c.on_wanted(p.devices):
            continue
        top = p.top if p.top is not None and p.top != p.pid else None
        fix = (f"xpuctl shutdown --pid {top}" if top is not None and not p.orphan
               else f"xpuctl shutdown --pid {p.pid}")
        out.append(Finding(
            "stuck-processes",
            "fail" if p.orphan else "warn",
            f"vLLM worker {p.pid} ({shorten(p.command, 40)}){_in(p)} is a oneCCL rank ({p.rank}) "
            "whose peer ranks are gone: it waits in its next collective for ever (spinning "
            "at 50 to 200 % CPU), and its run will answer nothing more",
            fix, p.devices[0] if len(p.devices) == 1 else None, (p.pid,),
        ))
    return out


@check("stuck-processes")
def stuck_processes(c: Ctx) -> list[Finding]:
    """Holders in uninterruptible sleep, stopped vLLM processes, unreaped vLLM zombies, oneCCL
    ranks whose peers are gone."""
    out = _lone_ranks(c)
    for p in c.scan.processes:
        if not c.on_wanted(sorted(_tree_tied(c, p.top or p.pid) if p.role else p.tied)):
            continue
        if p.state == "D" and (p.devices or p.role):
            out.append(
                Finding(
                    "stuck-processes",
                    "fail" if p.orphan or c.opts.expect_idle else "warn",
                    f"pid {p.pid} ({shorten(p.command, 40)}){_in(p)} is in uninterruptible sleep (D) in "
                    f"{p.wchan or 'an unknown kernel function'}; it cannot die until the driver "
                    "returns",
                    "wait for the driver; if it never returns, the device needs a reset "
                    "(xpu-smi or a PCI reset) or the host a reboot",
                    p.devices[0] if len(p.devices) == 1 else None,
                    (p.pid,),
                )
            )
        elif p.state == "T" and p.role:
            out.append(
                Finding(
                    "stuck-processes",
                    "warn",
                    f"vLLM process {p.pid} ({shorten(p.command, 40)}) is stopped (T)",
                    f"kill -CONT {p.pid}",
                    None,
                    (p.pid,),
                )
            )
        elif p.state == "Z" and p.role in (roles.ENGINE_CORE, roles.WORKER):
            out.append(
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
    return out
