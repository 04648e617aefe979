"""Pure judgement: Scan → findings and a status. No I/O.

One small function per stable check id, registered in `REGISTRY` (id → function) with the
`@check` decorator; `evaluate` runs them all. Check ids are stable (scripts and alerts key on
them) and `CHECKS` is their order in the output.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from xpuctl.core import advice
from xpuctl.core.model import Finding, LastRun, Process, Report, Scan
from xpuctl.output.units import human_bytes, shorten
from xpuctl.parse import envvars
from xpuctl.parse import roles


class Options(NamedTuple):
    devices: tuple[str, ...] = ()  # BDFs to look at; empty = all
    port: int | None = 8000
    port_explicit: bool = False
    expect_idle: bool = False
    unattributed_threshold: int = 1 << 30  # --deep: device memory no visible process explains


class Ctx(NamedTuple):
    """What every check needs, computed once per evaluation."""

    snap: Scan
    opts: Options
    wanted: frozenset[str]
    by_pid: dict[int, Process]
    trees: dict[int, list[Process]]  # orphaned trees: top pid → live members

    def on_wanted(self, bdfs: tuple[str, ...] | set[str] | list[str]) -> bool:
        """True when nothing was asked for, the thing holds no device, or it holds a wanted one."""
        return not self.wanted or not bdfs or bool(self.wanted & set(bdfs))

    def devices(self):  # -> Iterator[Device]
        return (d for d in self.snap.devices if not self.wanted or d.bdf in self.wanted)


Check = Callable[[Ctx], list[Finding]]
REGISTRY: dict[str, Check] = {}


def check(check_id: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        REGISTRY[check_id] = fn
        return fn

    return register


def _pids(procs: list[Process]) -> tuple[int, ...]:
    return tuple(sorted(p.pid for p in procs))


@check("no-device")
def no_device(c: Ctx) -> list[Finding]:
    """No Intel GPU on this host (or none visible here): every other check sees nothing.

    A warning, not a failure: nothing is left behind that reset could clean, and a script's
    exit 1 means "clean up"; --strict (or the JSON check id) makes it count."""
    if any(d.is_intel for d in c.snap.devices):
        return []
    others = ", ".join(f"{d.bdf} ({d.driver or 'no driver'}, vendor {d.vendor_id or '?'})" for d in c.snap.devices)
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


@check("orphans")
def orphans(c: Ctx) -> list[Finding]:
    """One finding per orphaned vLLM tree (its API server is gone)."""
    out = []
    for top, members in sorted(c.trees.items()):
        devs = sorted({b for m in members for b in m.devices})
        if not c.on_wanted(devs):
            continue
        # with --device, an orphaned tree that holds none of the devices is a warning
        severity = "warn" if c.wanted and not devs else "fail"
        head = c.by_pid.get(top) or members[0]
        mem = sum(m.memory_bytes or 0 for m in members)
        what = ", ".join(f"{m.cmdline[0] if m.cmdline else m.comm} ({m.pid})" for m in members)
        held = f"; they hold {', '.join(devs)}" if devs else ""
        if mem:
            held += f" ({human_bytes(mem)} of device memory)"
        out.append(
            Finding(
                "orphans",
                severity,
                f"orphaned vLLM processes whose API server is gone: {what}{held}",
                f"xpuctl shutdown --pid {head.pid}",
                devs[0] if len(devs) == 1 else None,
                _pids(members),
            )
        )
    return out


def _holders(c: Ctx, bdf: str) -> list[Process]:
    return [c.by_pid[pid] for pid in c.snap.holders(bdf) if pid in c.by_pid]


@check("device-holders")
def device_holders(c: Ctx) -> list[Finding]:
    """Who holds each device: a live server (busy), or a process that is not vLLM."""
    out = []
    for dev in c.devices():
        holders = _holders(c, dev.bdf)
        serving = [p for p in holders if p.role not in (None, roles.RAY) and not p.orphan]
        if serving:
            tops = sorted({p.top or p.pid for p in serving})
            out.append(
                Finding(
                    "device-holders",
                    "fail" if c.opts.expect_idle else "info",
                    f"{dev.bdf} is busy: held by the live vLLM server {', '.join(map(str, tops))} "
                    f"({len(serving)} process(es))",
                    f"xpuctl shutdown --pid {tops[0]}" if c.opts.expect_idle else None,
                    dev.bdf,
                    _pids(serving),
                )
            )
        for p in holders:
            if p.role is not None:
                continue
            if p.blocked:
                continue  # whether it is vLLM is unknown: see blocked-reads
            has_mem = bool(p.memory_bytes)
            sev = "fail" if c.opts.expect_idle else ("warn" if has_mem else "info")
            mem = f" with {human_bytes(p.memory_bytes)} of device memory" if has_mem else ""
            what = f"pid {p.pid} ({shorten(p.command)})"
            if p.ray is not None:  # another Ray job's actor: named by Ray, never vLLM's
                label = f"{p.ray.class_name or '?'}" + (f" '{p.ray.name}'" if p.ray.name else "")
                what = f"Ray actor {label} of job {p.ray.job_id or '?'} (pid {p.pid})"
            out.append(
                Finding(
                    "device-holders",
                    sev,
                    f"{dev.bdf} is held by {what}, not part of a vLLM server{mem}",
                    f"check what pid {p.pid} is doing; stop it before serving on {dev.bdf}"
                    if sev != "info"
                    else None,
                    dev.bdf,
                    (p.pid,),
                )
            )
    return out


@check("device-memory")
def device_memory(c: Ctx) -> list[Finding]:
    """Device memory held by orphans, kept alive by exported buffers, or in use when idle is expected."""
    out = []
    snap = c.snap
    for dev in c.devices():
        holders = _holders(c, dev.bdf)
        orphaned = [p for p in holders if p.orphan]
        orphan_mem = sum(p.memory_bytes or 0 for p in orphaned)
        if orphan_mem:
            out.append(
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
            - {pid for cl in snap.clients if cl.bdf == dev.bdf for pid in cl.pids}
        )
        if dmabuf_only:
            size = sum(
                b.size_bytes or 0 for b in snap.dmabufs if b.bdf == dev.bdf and b.pid in dmabuf_only
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
        used = snap.memory_used(dev.bdf)
        if c.opts.expect_idle and used and not holders and not dmabuf_only:
            out.append(
                Finding("device-memory", "fail", f"{human_bytes(used)} of {dev.bdf} in use", None, dev.bdf)
            )
    return out


@check("stuck-processes")
def stuck_processes(c: Ctx) -> list[Finding]:
    """Holders in uninterruptible sleep, stopped vLLM processes, unreaped vLLM zombies."""
    out = []
    for p in c.snap.processes:
        if not c.on_wanted(p.devices):
            continue
        if p.state == "D" and (p.devices or p.role):
            out.append(
                Finding(
                    "stuck-processes",
                    "fail" if p.orphan or c.opts.expect_idle else "warn",
                    f"pid {p.pid} ({shorten(p.command, 40)}) is in uninterruptible sleep (D) in "
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


@check("stale-shm")
def stale_shm(c: Ctx) -> list[Finding]:
    """Shared-memory segments in /dev/shm that no live process has open or mapped."""
    stale = [a for a in c.snap.artifacts if a.stale and a.kind == "shm"]
    if not stale:
        return []
    size = sum(a.size_bytes for a in stale)
    return [
        Finding(
            "stale-shm",
            "warn",
            f"{len(stale)} stale shared-memory segment(s) in /dev/shm "
            f"({human_bytes(size)}) left by killed processes",
            "xpuctl reset",
            None,
            (),
            tuple(a.path for a in stale),
        )
    ]


@check("stale-ipc")
def stale_ipc(c: Ctx) -> list[Finding]:
    """oneCCL, vLLM FileStore and ZMQ files in /tmp that nothing uses any more."""
    stale = [a for a in c.snap.artifacts if a.stale and a.kind != "shm"]
    if not stale:
        return []
    kinds = sorted({a.kind for a in stale})
    return [
        Finding(
            "stale-ipc",
            "warn",
            f"{len(stale)} stale IPC file(s) ({', '.join(kinds)}) in /tmp",
            "xpuctl reset",
            None,
            (),
            tuple(a.path for a in stale),
        )
    ]


@check("ports")
def ports(c: Ctx) -> list[Finding]:
    """The serving port taken by a live server or by something else; ports kept by orphans."""
    out = []
    snap, opts = c.snap, c.opts
    orphan_ports: dict[int, list[int]] = {}
    for port in snap.ports:
        if port.pid is None:
            continue
        p = c.by_pid.get(port.pid)
        if port.orphan:
            top = p.top if p and p.top else port.pid
            orphan_ports.setdefault(top, []).append(port.port)
        elif port.port == opts.port:
            if p is not None and p.role is not None:
                out.append(
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
                out.append(
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
        tree_devs = sorted({b for m in c.trees.get(top, []) for b in m.devices})
        if not c.on_wanted(tree_devs):
            continue
        numbers = sorted(set(numbers))
        pids = tuple(sorted({pt.pid for pt in snap.ports if pt.orphan and pt.pid and pt.port in numbers}))
        shown = ", ".join(map(str, numbers[:8])) + (f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")
        serving = opts.port in numbers
        out.append(
            Finding(
                "ports",
                # with --device, another device's orphans only matter if they hold our port
                "fail" if serving or not (c.wanted and not tree_devs) else "warn",
                f"orphaned vLLM processes of tree {top} still listen on port(s) {shown}",
                f"xpuctl shutdown --pid {top}",
                None,
                pids,
            )
        )
    return out


@check("env")
def env(c: Ctx) -> list[Finding]:
    """Malformed device-selection variables in the caller's environment."""
    environ = c.snap.caller_env or {}
    intel = sum(1 for d in c.snap.devices if d.is_intel)
    problems = []
    if "ZE_AFFINITY_MASK" in environ:
        problems.append(envvars.check_affinity_mask(environ["ZE_AFFINITY_MASK"], intel or None))
    if "ONEAPI_DEVICE_SELECTOR" in environ:
        problems.append(envvars.check_device_selector(environ["ONEAPI_DEVICE_SELECTOR"]))
    if "ZE_FLAT_DEVICE_HIERARCHY" in environ:
        problems.append(envvars.check_hierarchy(environ["ZE_FLAT_DEVICE_HIERARCHY"]))
    return [Finding("env", "fail", problem, "fix or unset the variable before serving") for problem in filter(None, problems)]


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
    blocked = set(c.snap.blocked)
    out = [
        Finding(
            "inspection",
            "warn" if issue.source in ("/proc", "ray") else "info",
            issue.reason if issue.source == "pid-namespace" else f"{issue.source}: {issue.reason}",
            _REMEDY_BY_SOURCE.get(issue.source),
        )
        for issue in c.snap.issues
        if issue not in blocked  # said by blocked-reads
    ]
    deep = c.snap.deep
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
    for u in c.snap.unreadable_processes:
        if not u.blocked:
            continue
        held = sorted(b for b in (d.bdf for d in c.snap.devices) if u.pid in c.snap.unknown_holders(b))
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
    for issue in c.snap.blocked:
        if issue.source.startswith("/proc/") and issue.source.split("/")[2].isdigit():
            continue  # a process: above
        out.append(Finding("blocked-reads", sev, f"{issue.source} {issue.reason}", remedy,
                           paths=(issue.source,)))
    return out


def _wanted_views(c: Ctx):  # -> Iterator[RuntimeView]
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


def last_run_keys(run: LastRun | None) -> list[str]:
    """The advice keys (core.advice.BY_SIGNATURE) of the newest run: none when it went well."""
    if run is None:
        return []
    return (["not-ready"] if run.not_ready else []) + [s.key for s in run.signatures]


def last_run_findings(run: LastRun | None) -> list[Finding]:
    """The relaunch advice for the state directory's newest run (also used by reset)."""
    keys = last_run_keys(run)
    if run is None or not keys:
        return []
    said = []
    if run.not_ready:
        said.append(f"was not ready in time (stuck in: {run.phase})")
    shown = [s for s in run.signatures if not (run.not_ready and s.key == "xccl-stuck")]
    if shown:
        said.append("its log shows " + ", ".join(s.what for s in shown))
    line = next((s.line for s in run.signatures if s.line), "")
    quoted = f": {line[:160]}" if line else ""
    return [
        Finding(
            "last-run",
            "warn",
            f"the last run {run.name} {' and '.join(said)}{quoted} (log {run.log_path})",
            "before the next launch, try (advice only; each has a cost): "
            + "; ".join(advice.lines(keys)),
            paths=(run.log_path,),
        )
    ]


@check("last-run")
def last_run(c: Ctx) -> list[Finding]:
    """The newest run ended in a readiness timeout or its log shows a oneCCL hang signature."""
    return last_run_findings(c.snap.last_run)


# Output order of the ids; every registered check has a place here (a test holds them equal).
CHECKS = (
    "no-device",
    "device-holders",
    "orphans",
    "device-memory",
    "stuck-processes",
    "stale-shm",
    "stale-ipc",
    "ports",
    "env",
    "unattributed-memory",
    "device-lost",
    "probe-timeout",
    "last-run",
    "blocked-reads",
    "inspection",
)


def _context(snap: Scan, opts: Options) -> Ctx:
    by_pid = {p.pid: p for p in snap.processes}
    trees: dict[int, list[Process]] = {}
    for p in snap.processes:
        if p.orphan and not p.is_zombie:
            trees.setdefault(p.top or p.pid, []).append(p)
    return Ctx(snap, opts, frozenset(opts.devices), by_pid, trees)


def evaluate(snap: Scan, opts: Options) -> Report:
    c = _context(snap, opts)
    findings = [f for check_id in CHECKS for f in REGISTRY[check_id](c)]
    failed = any(f.severity == "fail" for f in findings)
    busy = any(snap.holders(d.bdf) for d in c.devices()) or any(
        p.pid is not None and p.port == opts.port for p in snap.ports
    )
    status = "dirty" if failed else ("busy" if busy else "clean")
    if status == "clean" and snap.blocked:
        status = "unknown"  # something did not answer: never judged clean
    order = {"fail": 0, "warn": 1, "info": 2}
    findings.sort(key=lambda f: (order[f.severity], CHECKS.index(f.check)))
    return Report(snap, tuple(findings), status)
