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
from xpuctl.serve.pump import Pump, open_log
from xpuctl.serve.watch import Observer, probe_timeout
from xpuctl.serve.watchloop import WatchLoop

__all__ = ["RunSupervisor", "open_log"]


class RunSupervisor(WatchLoop):
    """One run from launch to exit, in named steps: `launch`, `wait_ready` (the start shown
    as it happens; a readiness deadline), then `not_ready` (diagnose, stop with the teardown
    budget, advise) or `watch` (until vLLM exits or a signal asks for a stop). Each job is a
    class of its own module: `record` (the run record), `stopping` (the ladder), `exits`
    (how the run ended), `readiness`, `watchloop`."""

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Count it, nothing more: the steps read the count where it is safe (a second one
        during the ladder means "kill now", at the ladder's next wait: stopping._hurry). An
        exception raised from here could land inside a read of the host and break the
        reader's protocol: the exit 70 of two quick Ctrl-C (issue 36)."""
        self.signals += 1

    def launch(self) -> None:
        become_subreaper()
        log_fd = open_log(self.rec.log_path)
        self.t0 = self.tracker.t0 = self.tracker.since = time.monotonic()
        self.proc = subprocess.Popen(
            self.plan.argv,
            env=self.plan.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=set_parent_death_signal,  # noqa: PLW1509 (no threads yet)
            close_fds=True,
        )
        # the kernel's records are read from here on: a device wedged while vLLM starts counts
        self.observer = Observer(self.host, self.prober, self.plan.bdfs, self.lines,
                                 probe_timeout(self.opts.health_interval, self.notify.watchdog))
        assert self.proc.stdout is not None  # stdout=PIPE
        self.pump = Pump(self.proc.stdout, log_fd, self._on_line,
                          self.view.echo if self.foreground else None)
        self.pump.start()
        t = target_of(self.host, self.proc.pid)
        self._set(pid=self.proc.pid, start_ticks=t.start_ticks if t else None,
                  session=self.proc.pid, started_at=time.time(), state="starting")
        self.say(f"xpuctl: started {self.rec.name} (pid {self.proc.pid}, run {self.rec.run_id}), "
                 f"log {self.rec.log_path}")
        self.notify.status(f"starting vLLM (pid {self.proc.pid}): waiting for /health and "
                           f"/v1/models on {self.url}")

    def run(self) -> int:
        """Supervise until vLLM is gone. Returns the exit code for xpuctl."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.launch()
        try:
            return self._supervise()
        finally:
            if self.observer is not None:
                self.observer.close()
            self.notify.close()

    def _supervise(self) -> int:
        outcome = self.wait_ready()
        if outcome == "ready":
            self.became_ready()
            self._start_watch()
            self.end("ready")
            return self.watch()
        self.view.finish()  # no status line over the diagnosis or the stop timeline
        if outcome == "signal":
            return self._stop_on_signal()
        if outcome == "timeout":
            return self.not_ready()
        assert isinstance(outcome, int)
        self.exited_before_ready(outcome)
        return self._after_exit(outcome, requested=False, ready=False)
