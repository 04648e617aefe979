"""How a run ended, classified (docs/serve-exits.md): an exit of vLLM that was asked for, an
engine death under a ready run, or an exit nobody asked for (a failure, whatever its code)."""

from __future__ import annotations

import time

from xpuctl.core.watch import Observation, WatchConfig
from xpuctl.errors import ExitCode
from xpuctl.output.safetext import safe
from xpuctl.serve.stopping import Stopping

LAST_LINES = 20  # of vLLM's output, kept in the record of a run that failed


class ExitJudge(Stopping):
    """vLLM exited: the passive ladder, then the exit classified."""

    def _after_exit(self, code: int, requested: bool, ready: bool) -> int:
        from xpuctl.shutdown.ladder import stop

        self.say(f"xpuctl: vLLM exited with code {code}")
        self.notify.stopping(f"stopping: vLLM exited with code {code}", self.stop_budget)
        if self.pump is not None:
            self.pump.join(timeout=0.5)  # orphans may keep the pipe open
        # its tree should follow; whatever carries our run id and stays is a leftover.
        # When `xpuctl shutdown` is stopping the run, it owns the ladder: only watch.
        stopper, someone_else = self._stopper, self._stopped_by_other

        # a shutdown asked for this exit, even one that died after its SIGTERM (abandoned: we
        # finish the stop ourselves, but the exit was still asked for); unless that shutdown
        # is gone and vLLM's own lines say its engine died: then it died before the stop
        # reached it, or by itself (a shutdown killed before its first signal asked nothing)
        passive = someone_else()
        asked = stopper() is not None and (passive or not self._engine_died())

        result = stop(self.host, [self._tree()], timeout=self.opts.teardown_timeout,
                      kill_after=self.opts.kill_after, release_timeout=self.opts.teardown_timeout,
                      on_event=lambda ev: self._show(ev) if ev.phase not in ("gone", "drain") else None,
                      passive=passive, yield_to=someone_else, on_wait=self.view.wait)
        # asked for: `xpuctl shutdown` is (or was) stopping the run, or serve or its supervisor
        # got a signal (which it turns into its own stop; vLLM may have exited first)
        requested = requested or asked or passive or self.signals > 0
        if requested:  # 0 once released, whatever vLLM's code (a SIGKILL, a stopped start)
            leftovers = result.verdict == "leftovers"
            self._set(state="failed" if leftovers else "stopped", exit_code=code,
                      stopped_at=time.time())
            rv = int(ExitCode.PROBLEMS if leftovers else ExitCode.OK)
            if not ready:
                self.end("stopped" if rv == ExitCode.OK else f"exit {rv}")
            return rv
        if ready and self.lines.death is not None and self.opts.on_unhealthy == "stop":
            # its engine died under a ready run: the watch's case, whoever was faster (vLLM
            # exits within seconds of its engine unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)
            return self._unhealthy_end(self._death_reason(), result.verdict)
        leftovers = result.verdict != "clean"
        self._set(state="failed", exit_code=code, stopped_at=time.time(),
                  **self._unasked_exit(code))
        self._next(result.verdict)
        if not ready:
            self.end(f"exit {code}")
        if self.lines.stop_line is not None:
            return ExitCode.PROBLEMS  # a signal from outside the run: nobody asked serve
        if code < 0:
            code = 128 - code
        if code == 0 and (leftovers or not requested):
            return ExitCode.PROBLEMS
        return code

    def _unhealthy_end(self, reason: str, verdict: str) -> int:
        lines = list(self.pump.tail) if self.pump is not None else []
        leftovers = verdict == "leftovers"
        self._set(state="failed", exit_code=self.exit_code(), stopped_at=time.time(),
                  reason=reason, last_lines=lines[-LAST_LINES:])
        code = ExitCode.PROBLEMS if leftovers else ExitCode.UNHEALTHY
        self.say(f"xpuctl: stopped: {verdict}: the run was {reason.split(':', 1)[0]}; serve "
                 f"exits {int(code)}")
        self._next(verdict)
        return code

    def _unasked_exit(self, code: int) -> dict[str, object]:
        """vLLM exited and nobody asked it to: a failure whatever its code (vLLM can exit 0
        after its engine died, vLLM #48966). Said here, and the record's reason and last
        lines."""
        from xpuctl.parse.enginedeath import engine_death

        lines = list(self.pump.tail) if self.pump is not None else []
        death = engine_death(lines)
        if self.lines.stop_line is not None:
            reason = (f"vLLM exited with code {code} after a signal from outside this run (it "
                      "logged \"[shutdown] API server: shutdown triggered\"; no xpuctl shutdown, "
                      "readiness deadline or signal to serve asked for it)")
        else:
            reason = (f"vLLM exited with code {code} and nobody asked it to (no shutdown, no "
                      "readiness deadline, no signal to serve)")
        if death is not None:
            reason += f": {death.what}: {death.line}"
        self.say(f"xpuctl: {safe(reason, 400)}")
        if code == 0 or self.lines.stop_line is not None:
            self.say("xpuctl: the run failed: serve exits 1 (an exit nobody asked serve for is "
                     "a failure)")
        return {"reason": reason, "last_lines": lines[-LAST_LINES:]}

    def _death_reason(self) -> str:
        """The watch's reason for an engine death vLLM reported before exiting."""
        if self.watcher is not None and not self.watcher.verdict.healthy:
            return self.watcher.verdict.reason or self.watcher.verdict.state
        now = time.monotonic()
        config = WatchConfig(self.opts.health_interval, self.opts.unhealthy_after,
                             self.opts.stall_after)
        from xpuctl.core.watch import Watch

        verdict = Watch(config, now).feed(Observation(now, None, "vLLM exited", None,
                                                      self.lines.death))
        return verdict.reason or verdict.state

    def _engine_died(self) -> bool:
        from xpuctl.parse.enginedeath import engine_death

        return engine_death(list(self.pump.tail) if self.pump is not None else []) is not None
