"""`serve --detach`: the run supervisor forks into its own session and keeps running; this
process shows the start through a pipe (output/progress.PipeSink on one end, `replay` on the
other) and returns once vLLM is ready or the start failed.

The pipe's last message says how the start ended: "ready", "failed N" (not ready in time),
"stopped" (a stop that was asked for ended the start: exit 0), "exit N" (vLLM or the
supervisor exited first) or "error TEXT" (the supervisor failed).

Under systemd's notify protocol (`NOTIFY_SOCKET`; host/notify.py) this process is the unit's
main process, and with `NotifyAccess=main` the manager hears only it. So before the supervisor
says anything, this process hands the role over: `MAINPID=<supervisor>`, then a byte on a
second pipe lets the supervisor start; a `WATCHDOG_PID` naming this process is the
supervisor's from then on. A `Type=notify` unit should still run serve in the foreground:
it is one process less, and nothing depends on the hand-over (docs/serve-exits.md).
"""

from __future__ import annotations

import os
import select
import sys

from xpuctl.errors import ExitCode
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.output.lines import audit_warning
from xpuctl.serve.launch import LaunchPlan, ServeOptions
from xpuctl.serve.supervise import RunSupervisor, open_log
from xpuctl.state import audit
from xpuctl.state.runs import Locks, RunRecord

GO_WAIT = 5.0  # seconds the supervisor waits for the hand-over of the main pid


def _handed_over(go: int | None, front: int, environ: dict[str, str]) -> Notifier:
    """The supervisor's notifier, once the front process told the manager the main pid is
    the supervisor's (`go` is read; without a notify socket there is nothing to wait for)."""
    if go is not None:
        try:
            select.select([go], [], [], GO_WAIT)
        finally:
            os.close(go)
    env = dict(environ)
    if env.get("WATCHDOG_PID", "").strip() == str(front):
        env["WATCHDOG_PID"] = str(os.getpid())  # the keep-alives are ours now
    return Notifier(env)


def _supervise_child(host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                     state_dir: str, locks: Locks, wfd: int, environ: dict[str, str],
                     go: int | None, front: int) -> None:
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
        notifier = _handed_over(go, front, environ)
        code = RunSupervisor(host, opts, plan, rec, state_dir, sink, foreground=False,
                             notifier=notifier).run()
        audit_log = audit.active()
        warning = audit_warning(audit_log) if audit_log is not None else None
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
    if msg == "stopped":
        view.say(f"xpuctl: {name} was stopped before it was ready (a stop was asked for; the "
                 f"GPU was released); see {log_path}")
        return ExitCode.OK
    if msg.startswith("failed"):
        view.say(f"xpuctl: {name} was not ready in time; stopped (see {log_path})")
        return ExitCode.NOT_READY
    if msg.startswith("exit"):  # vLLM's own code (or the supervisor's): serve exits 1
        code = int(msg.split()[1])
        view.say(f"xpuctl: {name} exited before it was ready (code {code}); see {log_path}")
        return ExitCode.PROBLEMS
    view.say(f"xpuctl: {name}: supervisor failed: {msg or 'no answer'}; see {log_path}")
    return ExitCode.PROBLEMS


def run_detached(host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord, state_dir: str,
                 locks: Locks, view: progress.View, environ: dict[str, str]) -> int:
    """A supervisor child keeps running; this process shows its start (through a pipe) and
    returns once it is ready or failed.

    The locks (taken before the preflight, held) are inherited: flock belongs to the open
    file, which the child shares, so there is no moment where another run could slip in."""
    name, log_path = rec.name, rec.log_path
    locks.relabel(f"{name} (starting)")
    notifier = Notifier(environ)
    rfd, wfd = os.pipe()
    go_r, go_w = os.pipe() if notifier.enabled else (None, None)
    front = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # supervisor
        os.close(rfd)
        if go_w is not None:
            os.close(go_w)
        _supervise_child(host, opts, plan, rec, state_dir, locks, wfd, environ, go_r, front)
    os.close(wfd)
    if go_r is not None and go_w is not None:
        os.close(go_r)
        notifier.main_pid(pid)  # the manager hears the supervisor from now on
        notifier.close()
        os.close(go_w)  # the supervisor may speak
    locks.release()  # our copies only: the supervisor's keep the locks
    view.say(f"xpuctl: {name}: supervisor {pid}, log {log_path}; waiting for readiness "
             f"(up to {opts.ready_timeout:g}s)")
    try:
        msg = progress.replay(rfd, view)
    finally:
        os.close(rfd)
        view.finish()
    return _outcome(msg, name, log_path, view)
