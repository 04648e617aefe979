"""Stopping the supervisor's own tree: the ladder (drain, escalation, the release proven),
on a signal, a readiness timeout or an unhealthy verdict; a second signal kills the tree."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from xpuctl.actions.signals import EXITED, Target, own_identity, reap_children
from xpuctl.errors import ExitCode
from xpuctl.output import progress
from xpuctl.output.lines import event_line, next_line
from xpuctl.serve.record import RecordKeeper

if TYPE_CHECKING:  # types only: the ladder is imported where used
    from xpuctl.shutdown.ladder import Event, StopResult
    from xpuctl.shutdown.targets import ServerTree


REAP_WAIT = 5.0  # seconds: the longest a gone API server's status may take to be reaped


class Interrupted(BaseException):
    """A second signal during the ladder: kill the tree now (a BaseException: no `except
    Exception` on the ladder's way swallows it)."""


class Stopper:
    """The stop ladder on the run's own tree."""

    def __init__(self, keeper: RecordKeeper) -> None:
        self.keeper = keeper

    def exit_code(self) -> int | None:
        run = self.keeper
        assert run.proc is not None
        reap_children()
        code = EXITED.get(run.proc.pid)
        if code is not None:
            run.proc.returncode = code  # we reaped it, not Popen
        return code

    def stopped_code(self, wait: float = REAP_WAIT) -> int | None:
        """vLLM's exit status once a stop proved it gone. The ladder counts a zombie as gone,
        but a thread-group leader whose other threads still exit cannot be reaped yet: its
        status comes a moment later (None when it never does)."""
        end = time.monotonic() + wait
        code = self.exit_code()
        while code is None and time.monotonic() < end:
            time.sleep(0.02)
            code = self.exit_code()
        return code

    def tree(self) -> ServerTree:
        from xpuctl.shutdown.targets import ServerTree

        run = self.keeper
        assert run.proc is not None
        top = Target(run.proc.pid, run.rec.start_ticks or 0, "api-server")
        return ServerTree(top=top, role="api-server", orphan=False, run_id=run.rec.run_id,
                          session=run.rec.session, devices=tuple(run.plan.bdfs),
                          port=run.plan.port, bind=run.plan.bind,
                          shutdown_timeout=run.plan.shutdown_timeout, log_path=run.rec.log_path,
                          record=run.rec, known=[top], never_ready=not run.ready,
                          endpoint=run.prober.endpoint)

    def show(self, ev: Event) -> None:
        """One step of a stop's timeline. vLLM's own lines (`vllm` steps, read from its log)
        are left out in the foreground: its output is echoed there already."""
        if self.keeper.foreground and ev.phase == "vllm":
            return
        self.keeper.say(f"xpuctl: {event_line(ev)}")

    def next_step(self, verdict: str) -> None:
        """After a failure: the one command to run next (output.lines.next_line)."""
        run = self.keeper
        run.say(next_line(run.plan.bdfs, run.plan.port, verdict))

    def end(self, status: str) -> None:
        """Tell a waiting `serve --detach` how the start ended (nothing in the foreground)."""
        if isinstance(self.keeper.view, progress.PipeSink):
            self.keeper.view.end(status)

    def stop_tree(self, why: str) -> StopResult:
        """The ladder on our own tree. A server that never became ready has nothing to
        drain: the tree gets the teardown budget only (ServerTree.never_ready). A second
        signal (before or during the ladder) kills the tree now: the kill pass, which no
        further signal interrupts; the release is proven either way."""
        run = self.keeper
        run.notify.stopping(why, run.stop_budget)
        run.set(state="stopping", stopping_by=own_identity())
        try:
            if run.signals < 2:
                return self._ladder(interruptible=True)
        except Interrupted:
            pass
        try:
            run.view.wait(None)
            run.say("xpuctl: second interrupt: killing the tree now")
            return self._ladder(interruptible=False)
        finally:
            if run.foreground and run.pump is not None:
                # the tree is gone: vLLM's last lines reach the terminal (they are left out
                # of the timeline there) before anything else is said
                run.pump.join(timeout=1.0)

    def _hurry(self) -> None:
        """The ladder's hook between the steps of its waits: a second signal ends it there
        (never inside a read of the host: the reader's protocol stays whole)."""
        if self.keeper.signals >= 2:
            raise Interrupted()

    def _ladder(self, interruptible: bool) -> StopResult:
        """The ladder (drain and escalation), or the kill pass (no drain, SIGKILL now)."""
        from xpuctl.shutdown.ladder import stop

        run = self.keeper
        result = stop(run.host, [self.tree()],
                      kill_after=run.opts.kill_after if interruptible else 0,
                      release_timeout=run.opts.teardown_timeout, on_event=self.show,
                      skip_drain=not interruptible, on_wait=run.view.wait,
                      hurry=self._hurry if interruptible else None)
        if interruptible and run.foreground and run.pump is not None:
            run.pump.join(timeout=1.0)
        return result

    def stop_on_signal(self) -> int:
        self.keeper.say("xpuctl: stopping (signal received; press Ctrl-C again to kill)")
        result = self.stop_tree("stopping: signal received")
        code = self.after_stop(result)
        self.end("stopped" if code == ExitCode.OK else f"exit {int(code)}")
        return code

    def after_stop(self, result: StopResult) -> int:
        """A stop that was asked for: 0 once the release is proven (also after a SIGKILL,
        and during start-up), 1 when something was left."""
        code = self.stopped_code()
        leftovers = result.verdict == "leftovers"
        self.keeper.set(state="stopped" if not leftovers else "failed", exit_code=code,
                        stopped_at=time.time())
        self.keeper.say(f"xpuctl: stopped: {result.verdict}")
        return ExitCode.PROBLEMS if leftovers else ExitCode.OK
