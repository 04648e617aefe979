"""Readiness: vLLM's start shown as it happens, /health and /v1/models probed until they
answer (a deadline vLLM itself lacks), then ready; or the start diagnosed (a timeout, an exit
before ready) and stopped."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from xpuctl.actions.signals import own_identity
from xpuctl.errors import ExitCode, XpuctlError
from xpuctl.output.safetext import safe
from xpuctl.parse.vllmlog import STARTING
from xpuctl.serve.exits import ExitJudge
from xpuctl.serve.launch import ray_python
from xpuctl.serve.reach import READY, startup_complete
from xpuctl.serve.watch import starting_health

if TYPE_CHECKING:  # types only: the log's parser is imported where used
    from xpuctl.parse.vllmlog import LogSignature

READY_POLL = 0.1  # seconds between readiness probes
READY_PROBE_TIMEOUT = 0.3  # one probe of /health (and /v1/models)
EXTEND_EVERY = 10.0  # seconds between EXTEND_TIMEOUT_USEC messages while vLLM starts


class Readiness(ExitJudge):
    """From launch to ready (or to a start that failed)."""

    def _on_line(self, line: str) -> None:
        self.lines.feed(line, self.ready)
        if self.ready:
            return
        if startup_complete(line):
            self.started = True
        with self.track_lock:
            changed = self.tracker.feed(line, time.monotonic())
        if changed is not None:
            self.view.phase(time.monotonic() - self.t0, changed.label)
        self.view.line(line)

    def _starting_beat(self, now: float, phase: str) -> None:
        """While vLLM starts: the record says the supervisor is alive (health "starting"),
        and the service manager may wait until our own readiness deadline and the stop
        after it (EXTEND_TIMEOUT_USEC)."""
        try:
            self._set(health=starting_health(self.rec.started_at or time.time(), time.time(),
                                             self.opts.health_interval))
        except OSError:
            pass  # the record is the state directory's business; the start goes on
        left = max(0.0, self.t0 + self.opts.ready_timeout - now)
        self.notify.extend(left + self.stop_budget + EXTEND_EVERY)

    def wait_ready(self) -> str | int:
        """"ready", "signal", "timeout", or vLLM's exit code when it exited first.

        /health is probed every POLL seconds with a short timeout: vLLM binds its port
        before the engine starts and answers once it is up, so readiness is noticed within
        about POLL + one probe of /health first answering."""
        deadline = self.t0 + self.opts.ready_timeout
        phase = STARTING.label  # launch() said what it waits for
        next_beat = time.monotonic()
        while True:
            code = self.exit_code()
            if code is not None:
                return code
            if self.signals:
                return "signal"
            if self.prober.ready(READY_PROBE_TIMEOUT, self.started) == READY:
                return "ready"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            with self.track_lock:
                label = self.tracker.phase.label
            if label != phase:
                phase = label
                self.notify.status(f"starting vLLM: {label} after {now - self.t0:.0f}s "
                                   f"(ready by {self.opts.ready_timeout:g}s or stopped)")
            if now >= next_beat:
                self._starting_beat(now, label)
                next_beat = now + min(self.opts.health_interval, EXTEND_EVERY)
            self.view.tick()
            time.sleep(READY_POLL)

    def _note_ray_nodes(self) -> None:
        """A Ray run: the nodes its actors landed on, in the record (a Ray that cannot be
        asked is a note, never a failed start)."""
        from xpuctl.errors import RayError
        from xpuctl.ray.launch import run_nodes
        from xpuctl.shutdown.targets import members

        if not self.rec.ray_cluster:
            return
        drivers = {t.pid for t in members(self.host, self._tree())}
        try:
            nodes = run_nodes(self.rec.ray_cluster, self.plan.env, ray_python(self.plan), drivers)
        except RayError as exc:
            self._set(notes=[*self.rec.notes, f"Ray nodes unknown: {exc}"])
            return
        self._set(ray_nodes=nodes)

    def became_ready(self) -> None:
        self._note_ray_nodes()
        now = time.monotonic()
        with self.track_lock:
            self.tracker.ready(now)
            summary = self.tracker.summary()
        self.ready = True
        self._set(state="ready", ready_at=time.time())
        self.notify.ready(f"ready on {self.url}: healthy (checked every "
                          f"{self.opts.health_interval:g}s)")
        url = self.url
        took = f"after {now - self.t0:.1f}s"
        if self.foreground:  # the wording scripts and units already look for, per mode
            self.view.ready(f"xpuctl: ready on {url} {took} ({self.rec.name}: {summary})")
        else:
            where = "on its unix socket" if self.plan.port is None else f"on port {self.plan.port}"
            self.view.ready(f"xpuctl: {self.rec.name} is ready {where} ({url}) "
                            f"{took}: {summary}")

    def exited_before_ready(self, code: int) -> None:
        """vLLM exited during its start: when its log says why (a oneCCL crash, a known
        signature), the phase, the cause and what to try, before the exit is handled."""
        from xpuctl.core import advice

        lines = list(self.pump.tail) if self.pump is not None else []
        with self.track_lock:
            phase = self.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        sigs, keys, said = _start_diagnosis(lines, where, "")
        if not sigs:
            return
        self.say(f"xpuctl: {self.rec.name}: vLLM exited with code {code} before it was ready; "
                 f"{said}")
        self.say("xpuctl: before the next launch, try (advice only; each has a cost):")
        for line in advice.lines(keys, skip=(advice.RESET,)):
            self.say(f"xpuctl:   - {line}")

    def not_ready(self) -> int:
        """Readiness timeout: diagnose (on the terminal and in the log), stop with the
        teardown budget, and say what to try before the next launch."""
        from xpuctl.core import advice

        assert self.pump is not None
        # stopping from now on (the diagnosis may take a while): never "starting" then stale
        self._set(state="stopping", stopping_by=own_identity())
        lines = list(self.pump.tail)
        with self.track_lock:
            phase = self.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        sigs, keys, said = _start_diagnosis(lines, where, phase.hint)
        self.say(f"xpuctl: {self.rec.name}: not ready after {self.opts.ready_timeout:g}s; {said}")
        if not self.foreground:  # in the foreground vLLM's lines are on the terminal already
            for line in lines[-10:]:
                self.say(f"xpuctl:   | {safe(line, 300)}")
        self._doctor_says()
        self._set(notes=[*self.rec.notes,
                         f"not ready after {self.opts.ready_timeout:g}s: {phase.label}"])
        result = self.stop_tree(f"stopping: not ready after {self.opts.ready_timeout:g}s "
                                f"(stuck in: {where})")
        self._set(state="failed", exit_code=int(ExitCode.NOT_READY), stopped_at=time.time())
        crashed = any(s.kind == "crash" for s in sigs)  # the crash's own advice first
        keys = [*keys, "not-ready"] if crashed else ["not-ready", *keys]
        self.say("xpuctl: before the next launch, try (advice only; each has a cost):")
        for line in advice.lines(keys, skip=(advice.RESET,)):
            self.say(f"xpuctl:   - {line}")
        self._next(result.verdict)
        self.end(f"failed {int(ExitCode.NOT_READY)}")
        return ExitCode.NOT_READY


    def _doctor_says(self) -> None:
        """What doctor finds on the run's devices, and the known-issues rows the run's own
        versions fall in (core/known; bounded at 5 s), said before the stop."""
        try:
            from xpuctl.diagnosis import diagnose
            from xpuctl.probes.versions import known_rows

            report = diagnose(self.host, self.plan.bdfs or None, None)
            for f in report.findings:
                if f.severity != "info":
                    self.say(f"xpuctl:   doctor {f.severity} {f.check}: {safe(f.message)}")
            for line in known_rows(self.host, self.plan.env, 5.0):  # its versions: core/known
                self.say(f"xpuctl:   {safe(line)}")
        except XpuctlError:
            pass

def _start_diagnosis(lines: list[str], where: str,
                     hint: str) -> tuple[list[LogSignature], list[str], str]:
    """A start's log read for the diagnosis: (its signatures, their advice keys, what to
    say). A oneCCL crash in the log: the start crashed in its phase, with the cause and the
    line; else it is stuck there, and a known hang (vLLM's shm-broadcast hang) is named; the
    rows of the known-issues table whose signs the log shows are named either way."""
    from xpuctl.core import known
    from xpuctl.parse.vllmlog import first_crash, furthest_phase, hang_signatures

    rows = "".join(f"; {known.named(k)}" for k in known.by_signs(lines))  # the table's rows
    sigs = hang_signatures(lines, ever_ready=False)
    keys = [s.key for s in sigs]
    crash = first_crash(sigs)
    if crash is not None:
        # the phase the log had reached at the crash (other ranks may have gone on)
        at = next((i for i, line in enumerate(lines) if line.strip() == crash.line), len(lines))
        phase = furthest_phase(lines[:at + 1])
        where = phase.label if phase.rank else where
        return sigs, keys, (f"crashed in: {where}: {crash.what}: {safe(crash.line, 300)}{rows}")
    said = f"stuck in: {where}" + (f": {hint}" if hint else "")
    named = [s for s in sigs if s.line]
    if named:
        said += f"; its log shows {named[0].what}: {safe(named[0].line, 300)}"
    return sigs, keys, said + rows
