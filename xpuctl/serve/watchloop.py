"""The watch loop of a ready run: a check when due (serve/watch.py, core/watch.py), its verdict
said when it changes, and with `--on-unhealthy stop` the run stopped (exit 7)."""

from __future__ import annotations

from xpuctl.core.watch import Verdict, WatchConfig
from xpuctl.output.safetext import safe
from xpuctl.serve.exits import ExitJudge
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper
from xpuctl.serve.watch import Watcher


class WatchLoop:
    """Supervise a ready run until vLLM exits, a signal asks, or the watch stops it."""

    def __init__(self, keeper: RecordKeeper, stopper: Stopper, judge: ExitJudge) -> None:
        self.keeper = keeper
        self.stopper = stopper
        self.judge = judge

    def start(self) -> None:
        """The liveness watch, from now on (its first verdict, healthy, is recorded)."""
        run = self.keeper
        config = WatchConfig(run.opts.health_interval, run.opts.unhealthy_after,
                             run.opts.stall_after)
        assert run.observer is not None
        run.watcher = Watcher(config, run.observer, run.notify, run.record_health,
                              f"ready on {run.url}")

    def watch(self) -> int:
        """Supervise a ready server until vLLM exits, a signal asks for a stop, or (with
        `--on-unhealthy stop`) the watch finds it unhealthy or stalled."""
        run = self.keeper
        assert run.watcher is not None
        while True:
            code = self.stopper.exit_code()
            if code is not None:
                return self.judge.after_exit(code, requested=False, ready=True)
            if run.signals:
                return self.stopper.stop_on_signal()
            before = run.watcher.verdict
            verdict = run.watcher.tick()
            if verdict is not None and verdict.state != before.state:
                self._said(verdict)
            if (verdict is not None and not verdict.healthy and run.opts.on_unhealthy == "stop"
                    and not run.stopped_by_other()):  # a shutdown's stop: vLLM's lines too
                return self._stop_unhealthy(verdict)
            run.watcher.sleep()

    def _said(self, verdict: Verdict) -> None:
        """A change of the watch's verdict, on the terminal (or the run log)."""
        run = self.keeper
        if verdict.healthy:  # healthy again, or sleeping (vLLM's sleep mode: as asked)
            run.say(f"xpuctl: {run.rec.name} is {safe(verdict.reason or 'healthy again', 600)}")
            return
        if run.stopped_by_other():
            then = "a shutdown is stopping it"
        elif run.opts.on_unhealthy == "stop":
            then = "stopping it"
        else:
            then = "--on-unhealthy report: it keeps running"
        run.say(f"xpuctl: {run.rec.name}: {safe(verdict.reason or verdict.state, 600)}; {then}")

    def _stop_unhealthy(self, verdict: Verdict) -> int:
        """`--on-unhealthy stop`: the normal ladder, the release proven; exit 7 (1 when
        something was left)."""
        result = self.stopper.stop_tree(f"stopping: {verdict.reason}")
        return self.judge.unhealthy_end(verdict.reason or verdict.state, result.verdict)
