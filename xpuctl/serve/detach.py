"""`serve --detach`: the run supervisor forks into its own session and keeps running; this
process shows the start through a pipe (output/progress.PipeSink on one end, `replay` on the
other) and returns once vLLM is ready or the start failed.

The pipe's last message says how the start ended: "ready", "failed N" (not ready in time),
"exit N" (vLLM or the supervisor exited first) or "error TEXT" (the supervisor failed).
"""

from __future__ import annotations

import os
import sys

from xpuctl.errors import ExitCode
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.output.lines import audit_warning
from xpuctl.serve.launch import LaunchPlan, ServeOptions
from xpuctl.serve.supervise import RunSupervisor, open_log
from xpuctl.state import audit
from xpuctl.state.runs import Locks, RunRecord


def _supervise_child(host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                     state_dir: str, locks: Locks, wfd: int) -> None:
    """In the forked child: a new session, no terminal, the run supervised to its end."""
    code = 1
    # opened once: the log of this run, even if the state directory is replaced meanwhile
    log_fd = open_log(rec.log_path)

    def log(msg: str) -> None:
        if log_fd is None:
            return
        try:
            os.write(log_fd, (msg + "\n").encode("utf-8", "backslashreplace"))
        except OSError:
            pass

    sink = progress.PipeSink(wfd, log)
    try:
        os.setsid()
        locks.relabel(f"{rec.name} pid {os.getpid()}")
        rec.supervisor_pid = os.getpid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        code = RunSupervisor(host, opts, plan, rec, state_dir, sink, foreground=False).run()
        warning = audit_warning(audit.active()) if audit.active() is not None else None
        if warning:  # nobody sees our stderr: the run log says it
            log(warning)
        sink.end(f"exit {code}")
    except BaseException as exc:
        log(f"xpuctl: supervisor error: {exc}")
        sink.end(f"error {exc}")
    finally:
        os._exit(int(code) if isinstance(code, int) else 1)


def _outcome(msg: str, name: str, log_path: str, view: progress.View) -> int:
    """The exit code for the pipe's last message."""
    if msg == "ready":
        return ExitCode.OK
    if msg.startswith("failed"):
        view.say(f"xpuctl: {name} was not ready in time; stopped (see {log_path})")
        return ExitCode.NOT_READY
    if msg.startswith("exit"):
        code = int(msg.split()[1])
        view.say(f"xpuctl: {name} exited before it was ready (code {code}); see {log_path}")
        return code or ExitCode.PROBLEMS
    view.say(f"xpuctl: {name}: supervisor failed: {msg or 'no answer'}; see {log_path}")
    return ExitCode.PROBLEMS


def run_detached(host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord, state_dir: str,
                 keys: list[str], view: progress.View) -> int:
    """A supervisor child keeps running; this process shows its start (through a pipe) and
    returns once it is ready or failed.

    The locks are taken here and inherited: flock belongs to the open file, which the child
    shares, so there is no moment where another run could slip in."""
    name, log_path = rec.name, rec.log_path
    locks = Locks(state_dir)
    locks.acquire(keys, f"{name} (starting)")
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # supervisor
        os.close(rfd)
        _supervise_child(host, opts, plan, rec, state_dir, locks, wfd)
    os.close(wfd)
    locks.release()  # our copies only: the supervisor's keep the locks
    view.say(f"xpuctl: {name}: supervisor {pid}, log {log_path}; waiting for readiness "
             f"(up to {opts.ready_timeout:g}s)")
    try:
        msg = progress.replay(rfd, view)
    finally:
        os.close(rfd)
        view.finish()
    return _outcome(msg, name, log_path, view)
