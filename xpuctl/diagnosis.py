"""The diagnosis behind `xpuctl doctor` (and serve's preflight, rebind's check, a Ray node's
answer): scan, judge, and optionally wait until the host is clean. The command itself is
cli/doctor.py; the checks that judge are core/checks/."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from xpuctl.core.collective import CollectiveResult
from xpuctl.core.model import Issue, Report, Scan, ShmRoom, Version
from xpuctl.core.runrecords import RecordedRun
from xpuctl.host.devices import resolve_device_specs
from xpuctl.host.scan import DEFAULT_PORT, request_scan, take_scan
from xpuctl.host.seam import Host
from xpuctl.parse.procfs import parse_status_nspid

if TYPE_CHECKING:  # types only: imported where used (a plain doctor has no probe, no wait)
    from xpuctl.core.waits import Wait
    from xpuctl.parse.probes import ProbeResult
    from xpuctl.ray.actors import StateFetch


class RecordedProbes(NamedTuple):
    """Probe results kept by `xpuctl snapshot --deep`: replayed instead of running probes."""

    results: tuple[ProbeResult, ...]
    probe_pids: tuple[int, ...]
    baseline: dict[str, int]
    baseline_problem: Issue | None = None
    versions: tuple[Version, ...] = ()  # the stack's versions the capture read (its manifest)


class DeepOptions(NamedTuple):
    """`--deep`: run the device-level probes (xpuctl.probes.runner) alongside the scan."""

    timeout: float = 10.0
    unattributed_threshold: int = 1 << 30
    state_dir: str | None = None  # where the idle baseline is kept
    since: float | None = None  # time.monotonic() of the command's start: the deadline counts from it
    recorded: RecordedProbes | None = None  # a snapshot's probes: nothing is run
    # a re-check (--wait-clean): the first look's versions, and xpu-smi is not run again
    # (`xpu-smi ps` allocates about 211 MB of device memory and lists itself: xpumanager
    # #116; never in a loop)
    again: tuple[Version, ...] | None = None


class CollectiveOptions(NamedTuple):
    """`--collective`: the bounded oneCCL/XCCL check (probes/collective) before the scan."""

    timeout: float = 30.0
    env: dict[str, str] | None = None  # the ranks' environment; None: the probes' (doctor's)
    # told what the ranks are doing and the deadline as it moves (the CLI's countdown)
    on_wait: Callable[[Wait | None], None] | None = None


def check_collective(host: Host, bdfs: tuple[str, ...] | list[str] | None, environ: dict[str, str],
                     opts: CollectiveOptions, state_dir: str | None = None) -> CollectiveResult:
    """The collective check, then the oneCCL-like files its ranks left (this machine's /tmp
    and /dev/shm), removed once the ranks are gone by the stale-file rules, each removal an
    audit line (in `state_dir` when given). The only files doctor deletes are its own. A check
    that passed proves its devices clean in `state_dir`: an unclean end of the last run on
    them no longer asks serve for the check (state/lastrun.py)."""
    from xpuctl.probes import collective, runner

    env = opts.env if opts.env is not None else runner.probe_env(environ)
    result = collective.run_collective(host, bdfs, env, opts.timeout, opts.on_wait)
    if result.files:
        result = result._replace(files=remove_collective_files(result.files, state_dir))
    note_proven(state_dir, result)
    return result


def note_proven(state_dir: str | None, result: CollectiveResult) -> None:
    """A collective check that passed proves its devices clean in `state_dir` (doctor
    --collective, and reset --rebind --collective once the device is back)."""
    if result.verdict == "ok" and result.ranks:
        from xpuctl.state.lastrun import note_clean

        note_clean(state_dir, [r.bdf for r in result.ranks], "collective check")


def remove_collective_files(paths: tuple[str, ...], state_dir: str | None) -> tuple[str, ...]:
    """Delete the files the collective check's ranks made, when the stale-file rules
    (core/rules: no live process has them open or mapped, the owner's pid is gone) agree,
    on a fresh scan of this machine. The ones kept, each with why ("path: reason")."""
    from contextlib import nullcontext

    from xpuctl.actions import cleanup
    from xpuctl.state import audit

    live = Host("/")
    scan = take_scan(live, port=None, want_env=False)
    wanted = set(paths)
    seen = {a.path: a for a in scan.artifacts if a.path in wanted}
    planned = [a for a in cleanup.removable(scan) if a.path in wanted]
    kept = [f"{a.path}: {a.reason}" for p, a in sorted(seen.items()) if a not in planned]
    if planned:
        with audit.recording(state_dir, "doctor") if state_dir else nullcontext():
            kept += [f"{r.path}: {r.reason}" for r in cleanup.remove(live, planned, scan)
                     if not r.removed]
    return tuple(kept)


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


SHM = "/dev/shm"


def shm_room(host: Host) -> ShmRoom | None:
    """/dev/shm's size and free room (statvfs), None when it cannot be asked."""
    try:
        size, free = host.statvfs(SHM)
    except OSError:
        return None
    return ShmRoom(SHM, size, free)


def deep_scan(host: Host, environ: dict[str, str], deep: DeepOptions, **options: Any) -> Scan:
    """The probes run while /proc is scanned; the probe children are left out of the scan.
    The software stack's versions are read meanwhile (probes/versions.py)."""
    from xpuctl.probes import baseline, reconcile, runner, versions

    stack: tuple[Version, ...] = ()
    if deep.recorded is not None:
        scan = take_scan(host, **options)
        results, pids, idle, problem, stack = deep.recorded
    else:
        names = runner.PROBES if deep.again is None else runner.ONCE_ONLY
        running = runner.start(environ, deep.timeout, names, since=deep.since)
        # the stack's versions: read once (a re-check carries them); the probe asks xpu-smi
        reading = versions.start(environ, deep.timeout, xpusmi=False) if deep.again is None \
            else None
        try:
            scan = take_scan(host, exclude_pids=running.pids, **options)
        except BaseException:
            if reading is not None:
                reading.abandon()
            raise
        finally:
            results = running.finish()
        if reading is not None:
            smi = next((r for r in results if r.name == "xpu-smi"), None)
            stack = reading.finish(host, scan.devices, smi)
        else:
            stack = deep.again or ()
            results = (*results, runner.not_again("xpu-smi"))
        pids = tuple(sorted(running.pids))
        idle, problem = baseline.load_baseline(deep.state_dir)
    if problem:
        scan = scan._replace(issues=scan.issues + (problem,))
    scan = reconcile.attach(host, scan, results, idle, pids)
    if stack and scan.deep is not None:
        scan = scan._replace(deep=scan.deep._replace(versions=stack))
    return scan


def again(deep: DeepOptions | None, report: Report) -> DeepOptions | None:
    """The --deep options of a re-check after `report` (--wait-clean): the first look's
    versions carried, xpu-smi not run again (DeepOptions.again)."""
    if deep is None or deep.recorded is not None or report.scan.deep is None:
        return deep
    return deep._replace(again=report.scan.deep.versions)


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
    collective: CollectiveOptions | CollectiveResult | None = None,
) -> Report:
    """Scan and judge. `state_dir`: also read its newest run for the relaunch advice.
    Ray actors holding devices are tied to their run through Ray's state (`ray_address`, or
    `ray_fetch`, a function returning that state: a Ray node's own). `collective`: run the
    collective check first (its options), or judge a result already taken."""
    bdfs = resolve_device_specs(host, devices or [])
    # the command's environment, the probes', the ranks' and Ray's (this process's when none is given)
    env = dict(os.environ) if caller_env is None else caller_env
    checked = collective if isinstance(collective, CollectiveResult) else None
    if isinstance(collective, CollectiveOptions):  # first: its ranks and files are gone before the scan
        checked = check_collective(host, bdfs, env, collective, state_dir)
    scan_port = port if port is not None else DEFAULT_PORT
    scanned = _ask_scan(host, env, deep, scan_port, caller_env, state_dir)
    # loaded while the reader takes the scan
    from xpuctl.core.checks import Options, evaluate
    from xpuctl.host.kernel import read_kernel
    from xpuctl.ray.actors import with_ray

    opts = Options(devices=bdfs, port=scan_port, port_explicit=port is not None,
                   expect_idle=expect_idle,
                   unattributed_threshold=deep.unattributed_threshold if deep else 1 << 30)
    scan = with_ray(host, scanned(), env, address=ray_address, fetch=ray_fetch)
    log, dumps, kernel_issues = read_kernel(host, scan.devices)
    scan = scan._replace(kernel=log, coredumps=dumps, issues=scan.issues + tuple(kernel_issues),
                         shm=shm_room(host))
    ns = pid_namespace_issue(host)
    if ns is not None:
        scan = scan._replace(issues=scan.issues + (ns,))
    if state_dir and os.path.isdir(state_dir):  # no directory, no run: nothing to import (9 ms)
        from xpuctl.state.lastrun import last_run
        from xpuctl.state.live import record_issues, run_healths

        scan = scan._replace(last_run=last_run(state_dir), records=record_issues(host, state_dir),
                             runs=run_healths(host, state_dir))
    if checked is not None:
        scan = scan._replace(collective=checked)
    return evaluate(scan, opts)


def _ask_scan(host: Host, env: dict[str, str], deep: DeepOptions | None, port: int,
              caller_env: dict[str, str] | None, state_dir: str | None) -> Callable[[], Scan]:
    """The scan, asked for: a plain one is sent to the reader now and collected by calling
    what this returns (the caller loads what judges it meanwhile: take_scan's imports are
    done, the judging's are not); a deep one runs its probes when called."""
    runs: tuple[RecordedRun, ...] = ()
    if state_dir and os.path.isdir(state_dir):  # the proof of a process's XPUCTL_RUN_ID
        from xpuctl.state.live import recorded_runs

        runs = recorded_runs(state_dir)
    if deep is not None:
        return lambda: deep_scan(host, env, deep, port=port, caller_env=caller_env, runs=runs)
    return request_scan(host, port, caller_env=caller_env, runs=runs)


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
