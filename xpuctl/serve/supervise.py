"""The run supervisor: one vLLM run from launch to exit (foreground, or in the detached child).

The run supervisor (this process, or a detached child of it) is a child subreaper; vLLM runs
in a new session with SIGTERM as its parent-death signal, `XPUCTL_RUN_ID` and `SPT_NOENV=1`
in its environment, output streamed to the terminal and a log file, and a run record in the
state directory. Readiness has a deadline vLLM itself lacks. Once ready, a liveness watch
(serve/watch.py, core/watch.py) checks the run every `--health-interval` seconds: an engine
that died or spins under a living API server is unhealthy or stalled, and with
`--on-unhealthy stop` the run is stopped (exit 7). The service manager is told every phase
(systemd's notify protocol, host/notify.py) when it asked for that.

How a run ends is one table (docs/serve-exits.md): a stop that was asked for (`xpuctl
shutdown`, a signal to serve) exits 0 once the release is proven; an exit of vLLM that nobody
asked for is a failure, whatever its code: the record says `failed` with the reason and
vLLM's last lines, and a code of 0 becomes 1 (vLLM can exit 0 after its engine died, vLLM
#48966); vLLM stopped by a signal from outside the run exits 1.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import FrameType

from xpuctl.actions.signals import become_subreaper, set_parent_death_signal, target_of
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.serve.exits import ExitJudge
from xpuctl.serve.failedstart import FailedStart
from xpuctl.serve.launch import LaunchPlan, ServeOptions
from xpuctl.serve.pump import Pump, open_log
from xpuctl.serve.readiness import Readiness
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper
from xpuctl.serve.watch import Observer, probe_timeout
from xpuctl.serve.watchloop import WatchLoop
from xpuctl.state.runs import RunRecord

__all__ = ["RunSupervisor", "open_log"]


class RunSupervisor:
    """One run from launch to exit, in named steps: `launch`, `wait_ready` (the start shown
    as it happens; a readiness deadline), then `not_ready` (diagnose, stop with the teardown
    budget, advise) or `watch` (until vLLM exits or a signal asks for a stop). Each job is an
    object of its own module, handed the run's shared state (`record.RecordKeeper`) and the
    jobs it asks: `stopping.Stopper` (the ladder), `exits.ExitJudge` (how the run ended),
    `readiness.Readiness`, `failedstart.FailedStart`, `watchloop.WatchLoop`."""

    def __init__(self, host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                 state_dir: str, view: progress.View, foreground: bool,
                 notifier: Notifier | None = None) -> None:
        self.keeper = RecordKeeper(host, opts, plan, rec, state_dir, view, foreground, notifier)
        self.stopper = Stopper(self.keeper)
        self.judge = ExitJudge(self.keeper, self.stopper)
        self.readiness = Readiness(self.keeper, self.stopper)
        self.failed = FailedStart(self.keeper, self.stopper)
        self.loop = WatchLoop(self.keeper, self.stopper, self.judge)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Count it, nothing more: the steps read the count where it is safe (a second one
        during the ladder means "kill now", at the ladder's next wait: stopping._hurry). An
        exception raised from here could land inside a read of the host and break the
        reader's protocol: the exit 70 of two quick Ctrl-C (issue 36)."""
        self.keeper.signals += 1

    def launch(self) -> None:
        run = self.keeper
        become_subreaper()
        log_fd = open_log(run.rec.log_path)
        run.t0 = run.tracker.t0 = run.tracker.since = time.monotonic()
        run.proc = subprocess.Popen(
            run.plan.argv,
            env=run.plan.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=set_parent_death_signal,  # noqa: PLW1509 (no threads yet)
            close_fds=True,
        )
        # the kernel's records are read from here on: a device wedged while vLLM starts counts
        run.observer = Observer(run.host, run.prober, run.plan.bdfs, run.lines,
                                probe_timeout(run.opts.health_interval, run.notify.watchdog))
        assert run.proc.stdout is not None  # stdout=PIPE
        run.pump = Pump(run.proc.stdout, log_fd, self.readiness.on_line,
                        run.view.echo if run.foreground else None)
        run.pump.start()
        t = target_of(run.host, run.proc.pid)
        run.set(pid=run.proc.pid, start_ticks=t.start_ticks if t else None,
                session=run.proc.pid, started_at=time.time(), state="starting")
        run.say(f"xpuctl: started {run.rec.name} (pid {run.proc.pid}, run {run.rec.run_id}), "
                f"log {run.rec.log_path}")
        run.notify.status(f"starting vLLM (pid {run.proc.pid}): waiting for /health and "
                          f"/v1/models on {run.url}")

    def run(self) -> int:
        """Supervise until vLLM is gone. Returns the exit code for xpuctl."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.launch()
        try:
            return self._supervise()
        finally:
            if self.keeper.observer is not None:
                self.keeper.observer.close()
            self.keeper.notify.close()

    def _supervise(self) -> int:
        outcome = self.readiness.wait_ready()
        if outcome == "ready":
            self.readiness.became_ready()
            self.loop.start()
            self.stopper.end("ready")
            return self.loop.watch()
        self.keeper.view.finish()  # no status line over the diagnosis or the stop timeline
        if outcome == "signal":
            return self.stopper.stop_on_signal()
        if outcome == "timeout":
            return self.failed.not_ready()
        assert isinstance(outcome, int)
        self.failed.exited_before_ready(outcome)
        return self.judge.after_exit(outcome, requested=False, ready=False)
