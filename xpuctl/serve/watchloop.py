"""The watch loop of a ready run: a check when due (serve/watch.py, core/watch.py), its verdict
said when it changes, and with `--on-unhealthy stop` the run stopped (exit 7)."""

from __future__ import annotations

from xpuctl.core.watch import Verdict, WatchConfig
from xpuctl.output.safetext import safe
from xpuctl.serve.readiness import Readiness
from xpuctl.serve.watch import Watcher


class WatchLoop(Readiness):
    """Supervise a ready run until vLLM exits, a signal asks, or the watch stops it."""

    def _start_watch(self) -> None:
        """The liveness watch, from now on (its first verdict, healthy, is recorded)."""
        config = WatchConfig(self.opts.health_interval, self.opts.unhealthy_after,
                             self.opts.stall_after)
        assert self.observer is not None
        self.watcher = Watcher(config, self.observer, self.notify, self._record_health,
                               f"ready on {self.url}")

    def watch(self) -> int:
        """Supervise a ready server until vLLM exits, a signal asks for a stop, or (with
        `--on-unhealthy stop`) the watch finds it unhealthy or stalled."""
        assert self.watcher is not None
        while True:
            code = self.exit_code()
            if code is not None:
                return self._after_exit(code, requested=False, ready=True)
            if self.signals:
                return self._stop_on_signal()
            before = self.watcher.verdict
            verdict = self.watcher.tick()
            if verdict is not None and verdict.state != before.state:
                self._said(verdict)
            if (verdict is not None and not verdict.healthy and self.opts.on_unhealthy == "stop"
                    and not self._stopped_by_other()):  # a shutdown's stop: vLLM's lines too
                return self._stop_unhealthy(verdict)
            self.watcher.sleep()

    def _said(self, verdict: Verdict) -> None:
        """A change of the watch's verdict, on the terminal (or the run log)."""
        if verdict.healthy:  # healthy again, or sleeping (vLLM's sleep mode: as asked)
            self.say(f"xpuctl: {self.rec.name} is {safe(verdict.reason or 'healthy again', 600)}")
            return
        if self._stopped_by_other():
            then = "a shutdown is stopping it"
        elif self.opts.on_unhealthy == "stop":
            then = "stopping it"
        else:
            then = "--on-unhealthy report: it keeps running"
        self.say(f"xpuctl: {self.rec.name}: {safe(verdict.reason or verdict.state, 600)}; {then}")

    def _stop_unhealthy(self, verdict: Verdict) -> int:
        """`--on-unhealthy stop`: the normal ladder, the release proven; exit 7 (1 when
        something was left)."""
        result = self.stop_tree(f"stopping: {verdict.reason}")
        return self._unhealthy_end(verdict.reason or verdict.state, result.verdict)
