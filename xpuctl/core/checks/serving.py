"""The serving port and the device-selection environment."""

from __future__ import annotations

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Finding, Process
from xpuctl.parse import envvars


@check("ports")
def ports(c: Ctx) -> list[Finding]:
    """The serving port taken by a live server or by something else; ports kept by orphans."""
    out = []
    scan, opts = c.scan, c.opts
    orphan_ports: dict[int, list[int]] = {}
    for port in scan.ports:
        if port.pid is None:
            continue
        p = c.by_pid.get(port.pid)
        if port.orphan:
            top = p.top if p and p.top else port.pid
            orphan_ports.setdefault(top, []).append(port.port)
        elif port.port == opts.port:
            out += _serving_port(c, port.port, port.pid, p)
    for top, numbers in sorted(orphan_ports.items()):
        out += _orphan_ports(c, top, sorted(set(numbers)))
    return out


def _serving_port(c: Ctx, number: int, pid: int, p: Process | None) -> list[Finding]:
    """The serving port, held by a live vLLM server (info; fail with --expect-idle) or by
    something else (warn; fail when the port was named)."""
    opts = c.opts
    if p is None or p.role is None:
        return [Finding(
            "ports", "fail" if opts.port_explicit or opts.expect_idle else "warn",
            f"port {number} is in use by pid {pid}, not a vLLM server; a server on it will "
            "fail with 'Address already in use'",
            f"pick another --port or stop pid {pid}", None, (pid,))]
    top = p.top or p.pid
    tree_devs = sorted({b for q in c.scan.processes if (q.top or q.pid) == top for b in q.tied})
    if not opts.port_explicit and not c.on_wanted(tree_devs):
        return []  # --device, default port: a server on other devices is not theirs
    return [Finding("ports", "fail" if opts.expect_idle else "info",
                    f"port {number} is served by the live vLLM server {top}", None, None,
                    (pid,))]


def _orphan_ports(c: Ctx, top: int, numbers: list[int]) -> list[Finding]:
    """The ports an orphaned tree still listens on (with --device, only its devices' trees)."""
    tree_devs = sorted({b for m in c.trees.get(top, []) for b in m.tied})
    if not c.on_wanted(tree_devs):
        return []
    pids = tuple(sorted({pt.pid for pt in c.scan.ports
                         if pt.orphan and pt.pid and pt.port in numbers}))
    shown = ", ".join(map(str, numbers[:8])) + (
        f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")
    serving = c.opts.port in numbers
    return [Finding(
        "ports",
        # with --device, another device's orphans only matter if they hold our port
        "fail" if serving or not (c.wanted and not tree_devs) else "warn",
        f"orphaned vLLM processes of tree {top} still listen on port(s) {shown}",
        f"xpuctl shutdown --pid {top}", None, pids)]


@check("env")
def env(c: Ctx) -> list[Finding]:
    """Malformed device-selection variables in the caller's environment."""
    environ = c.scan.caller_env or {}
    intel = sum(1 for d in c.scan.devices if d.is_intel)
    problems = []
    if "ZE_AFFINITY_MASK" in environ:
        problems.append(envvars.check_affinity_mask(environ["ZE_AFFINITY_MASK"], intel or None))
    if "ONEAPI_DEVICE_SELECTOR" in environ:
        problems.append(envvars.check_device_selector(environ["ONEAPI_DEVICE_SELECTOR"]))
    if "ZE_FLAT_DEVICE_HIERARCHY" in environ:
        problems.append(envvars.check_hierarchy(environ["ZE_FLAT_DEVICE_HIERARCHY"]))
    remedy = "fix or unset the variable before serving"
    return [Finding("env", "fail", problem, remedy) for problem in filter(None, problems)]


@check("run-health")
def run_health(c: Ctx) -> list[Finding]:
    """A live run whose watch (serve's --health-interval) found it unhealthy or stalled, or
    whose supervisor has not checked it for more than three intervals."""
    if not c.scan.runs:
        return []  # and the watch's rules are not loaded
    from xpuctl.core.watch import judge

    out = []
    for run in c.scan.runs:
        if not c.on_wanted(run.devices):
            continue
        seen = judge(run.state, run.health, c.scan.taken_at)
        if seen.healthy or seen.status in ("unknown", "stopping"):
            continue  # a run of an xpuctl without the watch; a run on its way out
        detail = seen.detail.removeprefix(f"{seen.status}: ")
        out.append(Finding(
            "run-health", "fail",
            f"run {run.name} is unhealthy ({seen.status}): {detail}",
            f"`xpuctl logs {run.name}`; stop it with `xpuctl shutdown {run.name}` (serve "
            "--on-unhealthy stop does that by itself)",
        ))
    return out
