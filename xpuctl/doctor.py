"""doctor: scan, judge, and optionally wait until the host is clean."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from xpuctl.core.checks import Options, evaluate
from xpuctl.core.model import Issue, Report, Scan
from xpuctl.host.devices import resolve_device_specs
from xpuctl.host.scan import DEFAULT_PORT, take_scan
from xpuctl.host.seam import Host
from xpuctl.parse.procfs import parse_status_nspid

if TYPE_CHECKING:  # types only: imported where used
    from xpuctl.ray.actors import StateFetch


class RecordedProbes(NamedTuple):
    """Probe results kept by `xpuctl snapshot --deep`: replayed instead of running probes."""

    results: tuple  # tuple[ProbeResult, ...]
    probe_pids: tuple[int, ...]
    baseline: dict[str, int]
    baseline_problem: Issue | None = None


class DeepOptions(NamedTuple):
    """`--deep`: run the device-level probes (xpuctl.probes.runner) alongside the scan."""

    timeout: float = 10.0
    unattributed_threshold: int = 1 << 30
    state_dir: str | None = None  # where the idle baseline is kept
    since: float | None = None  # time.monotonic() of the command's start: the deadline counts from it
    recorded: RecordedProbes | None = None  # a snapshot's probes: nothing is run


def pid_namespace_issue(host: Host) -> Issue | None:
    """xpuctl in a child PID namespace (NSpid has more than one entry) cannot see the holders
    in other namespaces through /proc."""
    try:
        text = host.read_text("/proc/self/status", 1 << 16)
    except OSError:
        return None
    ids = parse_status_nspid(text)
    if len(ids) <= 1:
        return None
    return Issue(
        "pid-namespace",
        f"xpuctl runs in a child PID namespace (NSpid {' '.join(ids[:8])}): device "
        "holders in other namespaces are invisible to /proc; --deep asks the device itself",
    )


def deep_scan(host: Host, environ: dict[str, str], deep: DeepOptions, **scan: Any) -> Scan:
    """The probes run while /proc is scanned; the probe children are left out of the scan."""
    from xpuctl.probes import baseline, reconcile, runner

    if deep.recorded is not None:
        snap = take_scan(host, **scan)
        results, pids, idle, problem = deep.recorded
    else:
        running = runner.start(environ, deep.timeout, since=deep.since)
        try:
            snap = take_scan(host, exclude_pids=running.pids, **scan)
        finally:
            results = running.finish()
        pids = tuple(sorted(running.pids))
        idle, problem = baseline.load_baseline(deep.state_dir)
    if problem:
        snap = snap._replace(issues=snap.issues + (problem,))
    return reconcile.attach(host, snap, results, idle, pids)


def diagnose(
    host: Host,
    devices: list[str] | None = None,
    port: int | None = None,
    expect_idle: bool = False,
    caller_env: dict[str, str] | None = None,
    deep: DeepOptions | None = None,
    state_dir: str | None = None,
    ray_address: str | None = None,
    ray_fetch: StateFetch | None = None,
) -> Report:
    """Scan and judge. `state_dir`: also read its newest run for the relaunch advice.
    Ray actors holding devices are tied to their run through Ray's state (`ray_address`, or
    `ray_fetch`, a function returning that state: a Ray node's own)."""
    bdfs = resolve_device_specs(host, devices or [])
    opts = Options(
        devices=bdfs,
        port=port if port is not None else DEFAULT_PORT,
        port_explicit=port is not None,
        expect_idle=expect_idle,
        unattributed_threshold=deep.unattributed_threshold if deep else 1 << 30,
    )
    from xpuctl.ray.actors import scan_with_ray

    # the command's environment, the probes' and Ray's (this process's when none is given)
    env = dict(os.environ) if caller_env is None else caller_env

    def deep_scanned() -> Scan:
        assert deep is not None
        return deep_scan(host, env, deep, port=opts.port, caller_env=caller_env)

    snap = scan_with_ray(host, env, address=ray_address, fetch=ray_fetch,
                         scan=deep_scanned if deep is not None else None,
                         port=opts.port, caller_env=caller_env)
    from xpuctl.host.kernel import read_kernel

    log, dumps, kernel_issues = read_kernel(host, snap.devices)
    snap = snap._replace(kernel=log, coredumps=dumps, issues=snap.issues + tuple(kernel_issues))
    ns = pid_namespace_issue(host)
    if ns is not None:
        snap = snap._replace(issues=snap.issues + (ns,))
    if state_dir:
        from xpuctl.state.lastrun import last_run

        snap = snap._replace(last_run=last_run(state_dir))
    return evaluate(snap, opts)


def write_textfile(path: str, text: str, state_dir: str | None) -> None:
    """`doctor --textfile`: remove our own stale temporary files beside PATH (audited in
    `state_dir`), then write PATH atomically."""
    from xpuctl.actions import cleanup
    from xpuctl.state import atomic, audit, textfile

    full = textfile.check_target(path)
    if state_dir:
        with audit.recording(state_dir, "doctor"):
            cleanup.remove_stale_temps(os.path.dirname(full), atomic.temp_pattern(full),
                                       textfile.STALE_TEMP_SECONDS)
    textfile.write_atomic(full, text)


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
