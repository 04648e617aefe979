"""How a run ended, classified (docs/serve-exits.md): an exit of vLLM that was asked for, an
engine death under a ready run, or an exit nobody asked for (a failure, whatever its code)."""

from __future__ import annotations

import time

from xpuctl.actions.signals import own_identity
from xpuctl.core.runrecords import Health
from xpuctl.core.watch import Observation, WatchConfig
from xpuctl.errors import ExitCode
from xpuctl.output.safetext import safe
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper

LAST_LINES = 20  # of vLLM's output, kept in the record of a run that failed
#: the record's health once vLLM's API server is gone (never healthy: core/watch.judge)
EXITED = "exited"


class ExitJudge:
    """vLLM exited: the passive ladder, then the exit classified."""

    def __init__(self, keeper: RecordKeeper, stopper: Stopper) -> None:
        self.keeper = keeper
        self.stopper = stopper

    def after_exit(self, code: int, requested: bool, ready: bool) -> int:
        """vLLM exited: the record says so at once, the passive ladder runs (its tree should
        follow; whatever carries the run id and stays is a leftover), then the exit is
        classified (docs/serve-exits.md)."""
        from xpuctl.shutdown.ladder import stop

        run = self.keeper
        # a shutdown asked for this exit, even one that died after its SIGTERM (abandoned: we
        # finish the stop ourselves, but the exit was still asked for); unless that shutdown
        # is gone and vLLM's own lines say its engine died: then it died before the stop
        # reached it, or by itself (a shutdown killed before its first signal asked nothing).
        # When `xpuctl shutdown` is stopping the run, it owns the ladder: only watch.
        passive = run.stopped_by_other()
        asked = run.stopper() is not None and (passive or not self._engine_died())
        self._mark_exited(code, passive)
        run.say(f"xpuctl: vLLM exited with code {code}")
        run.notify.stopping(f"stopping: vLLM exited with code {code}", run.stop_budget)
        if run.pump is not None:
            run.pump.join(timeout=0.5)  # orphans may keep the pipe open
        show = self.stopper.show
        result = stop(run.host, [self.stopper.tree()], timeout=run.opts.teardown_timeout,
                      kill_after=run.opts.kill_after, release_timeout=run.opts.teardown_timeout,
                      on_event=lambda ev: show(ev) if ev.phase not in ("gone", "drain") else None,
                      passive=passive, yield_to=run.stopped_by_other, on_wait=run.view.wait)
        # asked for: `xpuctl shutdown` is (or was) stopping the run, or serve or its supervisor
        # got a signal (which it turns into its own stop; vLLM may have exited first)
        if requested or asked or passive or run.signals > 0:
            # 0 once released, whatever vLLM's code (a SIGKILL, a stopped start)
            leftovers = result.verdict == "leftovers"
            run.set(state="failed" if leftovers else "stopped", exit_code=code,
                    stopped_at=time.time())
            rv = int(ExitCode.PROBLEMS if leftovers else ExitCode.OK)
            if not ready:
                self.stopper.end("stopped" if rv == ExitCode.OK else f"exit {rv}")
            return rv
        if ready and run.lines.death is not None and run.opts.on_unhealthy == "stop":
            # its engine died under a ready run: the watch's case, whoever was faster (vLLM
            # exits within seconds of its engine unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)
            return self.unhealthy_end(self._death_reason(), result.verdict)
        run.set(state="failed", exit_code=code, stopped_at=time.time(),
                **self._unasked_exit(code))
        self.stopper.next_step(result.verdict)
        # serve's table is its own: vLLM's status (4, 5, 7 would read as serve's not ready,
        # locked, unhealthy) is in the record, `ps --json` and the line above; serve exits 1
        run.say(f"xpuctl: the run failed: serve exits {int(ExitCode.PROBLEMS)} (an exit "
                f"nobody asked serve for is a failure; vLLM's own exit status {code} is in "
                "the run record)")
        if not ready:
            self.stopper.end(f"exit {code}")  # vLLM's own: the front says it, and exits 1
        return ExitCode.PROBLEMS

    def _mark_exited(self, code: int, passive: bool) -> None:
        """The record says at once that vLLM is gone (before the ladder runs): state
        `stopping` (a shutdown's own mark is left as it is), health `exited` with vLLM's
        status, so `xpuctl health` is never 0 for a run without its API server."""
        run = self.keeper
        now = time.time()
        health = Health(EXITED, now, f"vLLM exited with code {code}", now,
                        run.opts.health_interval)
        if passive:
            run.set(health=health, exit_code=code)
        else:
            run.set(state="stopping", stopping_by=own_identity(), health=health,
                    exit_code=code)

    def unhealthy_end(self, reason: str, verdict: str) -> int:
        run = self.keeper
        lines = run.last_lines()
        leftovers = verdict == "leftovers"
        run.set(state="failed", exit_code=self.stopper.stopped_code(), stopped_at=time.time(),
                reason=reason, last_lines=lines[-LAST_LINES:])
        code = ExitCode.PROBLEMS if leftovers else ExitCode.UNHEALTHY
        run.say(f"xpuctl: stopped: {verdict}: the run was {reason.split(':', 1)[0]}; serve "
                f"exits {int(code)}")
        self.stopper.next_step(verdict)
        return code

    def _unasked_exit(self, code: int) -> dict[str, object]:
        """vLLM exited and nobody asked it to: a failure whatever its code (vLLM can exit 0
        after its engine died, vLLM #48966). Said here, and the record's reason and last
        lines."""
        from xpuctl.parse.enginedeath import engine_death

        run = self.keeper
        lines = run.last_lines()
        death = engine_death(lines)
        if run.lines.stop_line is not None:
            reason = (f"vLLM exited with code {code} after a signal from outside this run (it "
                      "logged \"[shutdown] API server: shutdown triggered\"; no xpuctl shutdown, "
                      "readiness deadline or signal to serve asked for it)")
        else:
            reason = (f"vLLM exited with code {code} and nobody asked it to (no shutdown, no "
                      "readiness deadline, no signal to serve)")
        if death is not None:
            reason += f": {death.what}: {death.line}"
        run.say(f"xpuctl: {safe(reason, 400)}")
        return {"reason": reason, "last_lines": lines[-LAST_LINES:]}

    def _death_reason(self) -> str:
        """The watch's reason for an engine death vLLM reported before exiting."""
        run = self.keeper
        if run.watcher is not None and not run.watcher.verdict.healthy:
            return run.watcher.verdict.reason or run.watcher.verdict.state
        now = time.monotonic()
        config = WatchConfig(run.opts.health_interval, run.opts.unhealthy_after,
                             run.opts.stall_after)
        from xpuctl.core.watch import Watch

        verdict = Watch(config, now).feed(Observation(now, None, "vLLM exited", None,
                                                      run.lines.death))
        return verdict.reason or verdict.state

    def _engine_died(self) -> bool:
        from xpuctl.parse.enginedeath import engine_death

        return engine_death(self.keeper.last_lines()) is not None
