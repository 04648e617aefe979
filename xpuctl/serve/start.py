"""`xpuctl serve`: plan the launch, run the preflight doctor, claim the name, port and devices,
then supervise the run here (foreground) or in a detached child (serve/detach)."""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from xpuctl.actions.signals import can_signal
from xpuctl.core.waits import Wait
from xpuctl.errors import UsageError, XpuctlError
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.output.lines import audit_warning
from xpuctl.output.safetext import safe
from xpuctl.serve.launch import LaunchPlan, ServeOptions, plan_launch, ray_python
from xpuctl.serve.reach import check_probe_cert, recorded_command
from xpuctl.serve.supervise import RunSupervisor
from xpuctl.state import audit
from xpuctl.state.runs import NAME_RE, Locks, RunRecord, ensure_state_dir
from xpuctl.state.statedir import check_writable

if TYPE_CHECKING:  # types only: doctor is imported where used
    from xpuctl.diagnosis import CollectiveOptions


class _Planned(NamedTuple):
    state_dir: str
    plan: LaunchPlan
    name: str
    run_id: str
    keys: list[str]  # the locks the run holds from before its preflight to its end


class _Prepared(NamedTuple):
    state_dir: str
    plan: LaunchPlan
    rec: RunRecord
    keys: list[str]


def _collective(opts: ServeOptions, plan: LaunchPlan, out: Callable[[str], None],
                on_wait: Callable[[Wait | None], None] | None = None) -> CollectiveOptions | None:
    """doctor.CollectiveOptions for the run's own environment (its ZE_AFFINITY_MASK, CCL_*,
    PCI device order unless it says otherwise) when `--preflight collective` asks for the
    collective check, or, without an explicit --preflight, when the last run on one of the
    run's devices did not end cleanly (said in one line); else None."""
    from xpuctl.diagnosis import CollectiveOptions
    from xpuctl.state.lastrun import unclean_run_on

    if not opts.collective_preflight:
        last = unclean_run_on(opts.state_dir, plan.bdfs) if opts.collective_auto else None
        if last is None:
            return None
        out(f"xpuctl: preflight: the last run on these devices ({safe(last[0])}) {safe(last[1])}: "
            "running the collective check first (skip it with --preflight fast)")
    # the run's tag stays off the ranks: they are not the run's processes
    env = {k: v for k, v in plan.env.items() if k not in ("XPUCTL_RUN_ID", "XPUCTL_ROOT")}
    env.setdefault("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1")  # the mask's indices are in PCI order
    return CollectiveOptions(opts.collective_timeout, env, on_wait)


def _preflight(host: Host, opts: ServeOptions, plan: LaunchPlan,
               show_findings: Callable[[object], None], out: Callable[[str], None],
               on_wait: Callable[[Wait | None], None] | None = None) -> None:
    """doctor on the run's devices and port (and the collective check when asked for or
    after an unclean last run, its countdown told to `on_wait`); XpuctlError when they are
    not clean. The collective check's verdict is said also when serve goes on: a pass, or a
    warning (no torch with XPU, no backend: nothing was proven)."""
    from xpuctl.diagnosis import diagnose

    coll = _collective(opts, plan, out, on_wait)
    # plan.port is None with --uds: a unix socket has no port to find taken
    report = diagnose(host, plan.bdfs or None, plan.port, caller_env=plan.env,
                      deep=opts.deep_preflight, collective=coll)
    for f in report.findings:
        if f.check == "collective" and f.severity == "info":
            out(f"xpuctl: preflight: {safe(f.message)}")
        elif f.check == "collective" and f.severity == "warn" and not report.failed:
            out(f"xpuctl: preflight warn collective: {safe(f.message)}")
    if report.failed:
        show_findings(report)
        raise XpuctlError(
            "preflight failed: the devices or port are not clean (fix the findings above, "
            "e.g. `xpuctl reset`, or start anyway with --force)"
        )


def _last_run_advice(state_dir: str, out: Callable[[str], None]) -> None:
    """The state directory's newest run (not this one: its record is not written yet) hung
    or was not ready: say so, and what to try with each one's cost, before launching."""
    from xpuctl.core import advice
    from xpuctl.core.checks import last_run_findings, last_run_keys
    from xpuctl.state.lastrun import last_run

    run = last_run(state_dir)
    for f in last_run_findings(run):
        out(f"xpuctl: preflight {f.severity} {f.check}: {safe(f.message)}")
        out("xpuctl: before this launch, consider (advice only; xpuctl sets none; each has a cost):")
        for line in advice.lines(last_run_keys(run)):
            out(f"xpuctl:   - {line}")


def _shm_warning(host: Host, plan: LaunchPlan, out: Callable[[str], None]) -> None:
    """One line when /dev/shm has less room than vLLM's rings take for the run's parallel
    size (core/shmroom.py): vLLM >= #48879 then fails at start, older ones die of SIGBUS
    under load."""
    from xpuctl.core.shmroom import needed_bytes
    from xpuctl.core.units import human_bytes
    from xpuctl.diagnosis import shm_room
    from xpuctl.parse.vllmargs import parallel_sizes

    tp, pp = parallel_sizes(plan.argv)
    need = needed_bytes(tp, pp, plan.env)
    room = shm_room(host) if need else None
    if room is None or room.free_bytes >= need:
        return
    size = f"TP={tp}" + (f" x PP={pp}" if pp > 1 else "")
    out(f"xpuctl: warning: {room.path} has {human_bytes(room.free_bytes)} free of "
        f"{human_bytes(room.size_bytes)}; vLLM's shared-memory rings take about "
        f"{human_bytes(need)} at {size} (vLLM #50606): it may fail to start or die under load "
        "(a container needs --shm-size, or a larger emptyDir medium: Memory)")


def _ray_preflight(plan: LaunchPlan, opts: ServeOptions, out: Callable[[str], None]) -> str | None:
    """A Ray launch: its cluster (None when vLLM does not use Ray); onto an existing cluster,
    doctor on every alive node first (a failing node blocks unless --force)."""
    from xpuctl.ray import launch

    if not launch.uses_ray(plan.argv):
        return None
    cluster = launch.cluster_of(plan.env)
    if cluster != launch.LOCAL and not opts.force:
        result = launch.preflight(cluster, plan.env, ray_python(plan))
        out(f"xpuctl: preflight: the {len(result.nodes)} node(s) of Ray cluster {cluster} "
            "are clean")
    return cluster


def _plan(host: Host, opts: ServeOptions, environ: dict[str, str],
          out: Callable[[str], None]) -> _Planned:
    """Plan the launch and check the name: what the run will claim."""
    if not can_signal(host):
        raise UsageError("serve needs the live /proc (a root whose proc is the real /proc)")
    assert opts.state_dir is not None  # resolve_state_dir gives one wherever /proc is live
    state_dir = ensure_state_dir(opts.state_dir)
    check_writable(state_dir)  # read-only or full: refused before anything starts
    check_probe_cert(opts.probe_cert, opts.probe_key)
    run_id = uuid.uuid4().hex[:16]
    plan = plan_launch(opts, host, environ, run_id)
    for note in plan.notes:
        out(f"xpuctl: note: {note}")
    name = opts.name or _default_name(plan)
    if not NAME_RE.fullmatch(name):
        raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-'")
    keys = [f"run-{name}", _address_key(plan)] + [f"device-{b}" for b in plan.bdfs]
    return _Planned(state_dir, plan, name, run_id, keys)


def _address_key(plan: LaunchPlan) -> str:
    """The lock of the run's address: its port, or its unix socket (`--uds`: no port)."""
    if plan.reach.uds:
        return f"uds-{_socket_id(plan.reach.uds)}"
    return f"port-{plan.port}"


def _default_name(plan: LaunchPlan) -> str:
    """A run's name without --name: vllm-PORT, or for a unix socket vllm-uds-ID (the
    socket's path, hashed: as unique as the path, and always a valid name)."""
    if plan.reach.uds:
        return f"vllm-uds-{_socket_id(plan.reach.uds)[:8]}"
    return f"vllm-{plan.port}"


def _socket_id(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _prepare(host: Host, opts: ServeOptions, p: _Planned, out: Callable[[str], None],
             show_findings: Callable[[object], None],
             on_wait: Callable[[Wait | None], None] | None = None) -> _Prepared:
    """Run the preflight doctor (the run's locks are held: a second serve of the same name,
    port or device was refused before it); the record to write."""
    _last_run_advice(p.state_dir, out)  # also with --force: advice only, it refuses nothing
    _shm_warning(host, p.plan, out)
    cluster = _ray_preflight(p.plan, opts, out)
    if not opts.force:
        _preflight(host, opts, p.plan, show_findings, out, on_wait)
    plan, name = p.plan, p.name
    log_path = os.path.join(p.state_dir, "logs", f"{name}.log")
    rec = RunRecord(name=name, run_id=p.run_id, pid=None, start_ticks=None, session=None,
                    command=recorded_command(plan.argv, plan.reach), devices=plan.bdfs,
                    port=plan.port, bind=plan.bind or "127.0.0.1",
                    shutdown_timeout=plan.shutdown_timeout, drain_timeout=opts.drain_timeout,
                    teardown_timeout=opts.teardown_timeout, log_path=log_path,
                    notes=list(plan.notes), ray_cluster=cluster)
    return _Prepared(p.state_dir, plan, rec, p.keys)


def _run_foreground(host: Host, opts: ServeOptions, p: _Prepared, locks: Locks,
                    view: progress.View, environ: dict[str, str]) -> int:
    locks.relabel(f"{p.rec.name} pid {os.getpid()}")
    p.rec.supervisor_pid = os.getpid()
    return RunSupervisor(host, opts, p.plan, p.rec, p.state_dir, view, foreground=True,
                         notifier=Notifier(environ)).run()


def serve(host: Host, opts: ServeOptions, environ: dict[str, str], out: Callable[[str], None],
          show_findings: Callable[[object], None], view: progress.View | None = None) -> int:
    """Every signal of the run (its stops on Ctrl-C, on a readiness timeout, the cleanup of
    what vLLM left, in the foreground or the --detach supervisor, which inherits the
    recording across its fork) is a line in the state directory's audit log."""
    assert opts.state_dir is not None
    with audit.recording(opts.state_dir, "serve") as log:
        code = _start(host, opts, environ, out, show_findings, view)
    warning = audit_warning(log)
    if warning:
        out(warning)
    return code


def _start(host: Host, opts: ServeOptions, environ: dict[str, str], out: Callable[[str], None],
           show_findings: Callable[[object], None], view: progress.View | None) -> int:
    planned = _plan(host, opts, environ, out)
    # the run's name, port and devices are claimed before the preflight: a second serve of
    # the same is refused at once (exit 5), not after this one's preflight
    locks = Locks(planned.state_dir)
    locks.acquire(planned.keys, f"{planned.name} pid {os.getpid()} (preflight)")
    try:
        before = view or progress.choose(sys.stderr, planned.name, quiet=opts.quiet)
        try:
            prepared = _prepare(host, opts, planned, out, show_findings, before.wait)
        finally:
            before.wait(None)
            if before is not view:
                before.finish()  # the start has a view of its own
        if view is None:
            view = progress.choose(sys.stderr, prepared.rec.name, quiet=opts.quiet)
        if opts.detach:
            from xpuctl.serve.detach import run_detached

            p = prepared
            return run_detached(host, opts, p.plan, p.rec, p.state_dir, locks, view, environ)
        return _run_foreground(host, opts, prepared, locks, view, environ)
    finally:
        locks.release()
