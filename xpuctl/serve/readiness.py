
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
from xpuctl.serve.launch import ray_python
from xpuctl.serve.reach import READY, startup_complete
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper
from xpuctl.serve.watch import starting_health

if TYPE_CHECKING:  # types only: the log's parser is imported where used
    from xpuctl.parse.vllmlog import LogSignature

READY_POLL = 0.1  # seconds between readiness probes
READY_PROBE_TIMEOUT = 0.3  # one probe of /health (and /v1/models)
EXTEND_EVERY = 10.0  # seconds between EXTEND_TIMEOUT_USEC messages while vLLM starts


class Readiness:
    """From launch to ready (or to a start that failed)."""

    def __init__(self, keeper: RecordKeeper, stopper: Stopper) -> None:
        self.keeper = keeper
        self.stopper = stopper

    def on_line(self, line: str) -> None:
        run = self.keeper
        run.lines.feed(line, run.ready)
        if run.ready:
            return
        if startup_complete(line):
            run.started = True
        with run.track_lock:
            changed = run.tracker.feed(line, time.monotonic())
        if changed is not None:
            run.view.phase(time.monotonic() - run.t0, changed.label)
        run.view.line(line)

    def _starting_beat(self, now: float, phase: str) -> None:
        """While vLLM starts: the record says the supervisor is alive (health "starting"),
        and the service manager may wait until our own readiness deadline and the stop
        after it (EXTEND_TIMEOUT_USEC)."""
        run = self.keeper
        try:
            run.set(health=starting_health(run.rec.started_at or time.time(), time.time(),
                                           run.opts.health_interval))
        except OSError:
            pass  # the record is the state directory's business; the start goes on
        left = max(0.0, run.t0 + run.opts.ready_timeout - now)
        run.notify.extend(left + run.stop_budget + EXTEND_EVERY)

    def wait_ready(self) -> str | int:
        """"ready", "signal", "timeout", or vLLM's exit code when it exited first.

        /health is probed every POLL seconds with a short timeout: vLLM binds its port
        before the engine starts and answers once it is up, so readiness is noticed within
        about POLL + one probe of /health first answering."""
        run = self.keeper
        deadline = run.t0 + run.opts.ready_timeout
        phase = STARTING.label  # launch() said what it waits for
        next_beat = time.monotonic()
        while True:
            code = self.stopper.exit_code()
            if code is not None:
                return code
            if run.signals:
                return "signal"
            if run.prober.ready(READY_PROBE_TIMEOUT, run.started) == READY:
                return "ready"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            with run.track_lock:
                label = run.tracker.phase.label
            if label != phase:
                phase = label
                run.notify.status(f"starting vLLM: {label} after {now - run.t0:.0f}s "
                                  f"(ready by {run.opts.ready_timeout:g}s or stopped)")
            if now >= next_beat:
                self._starting_beat(now, label)
                next_beat = now + min(run.opts.health_interval, EXTEND_EVERY)
            run.view.tick()
            time.sleep(READY_POLL)

    def _note_ray_nodes(self) -> None:
        """A Ray run: the nodes its actors landed on, in the record (a Ray that cannot be
        asked is a note, never a failed start)."""
        from xpuctl.errors import RayError
        from xpuctl.ray.launch import run_nodes
        from xpuctl.shutdown.targets import members

        run = self.keeper
        if not run.rec.ray_cluster:
            return
        drivers = {t.pid for t in members(run.host, self.stopper.tree())}
        try:
            nodes = run_nodes(run.rec.ray_cluster, run.plan.env, ray_python(run.plan), drivers)
        except RayError as exc:
            run.set(notes=[*run.rec.notes, f"Ray nodes unknown: {exc}"])
            return
        run.set(ray_nodes=nodes)

    def became_ready(self) -> None:
        run = self.keeper
        self._note_ray_nodes()
        now = time.monotonic()
        with run.track_lock:
            run.tracker.ready(now)
            summary = run.tracker.summary()
        run.ready = True
        run.set(state="ready", ready_at=time.time())
        run.notify.ready(f"ready on {run.url}: healthy (checked every "
                         f"{run.opts.health_interval:g}s)")
        url = run.url
        took = f"after {now - run.t0:.1f}s"
        if run.foreground:  # the wording scripts and units already look for, per mode
            run.view.ready(f"xpuctl: ready on {url} {took} ({run.rec.name}: {summary})")
        else:
            where = "on its unix socket" if run.plan.port is None else f"on port {run.plan.port}"
            run.view.ready(f"xpuctl: {run.rec.name} is ready {where} ({url}) {took}: {summary}")

    def exited_before_ready(self, code: int) -> None:
        """vLLM exited during its start: when its log says why (a oneCCL crash, a known
        signature), the phase, the cause and what to try, before the exit is handled."""
        from xpuctl.core import advice

        run = self.keeper
        lines = list(run.pump.tail) if run.pump is not None else []
        with run.track_lock:
            phase = run.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        sigs, keys, said = _start_diagnosis(lines, where, "")
        if not sigs:
            return
        run.say(f"xpuctl: {run.rec.name}: vLLM exited with code {code} before it was ready; "
                f"{said}")
        run.say("xpuctl: before the next launch, try (advice only; each has a cost):")
        for line in advice.lines(keys, skip=(advice.RESET,)):
            run.say(f"xpuctl:   - {line}")

    def not_ready(self) -> int:
        """Readiness timeout: diagnose (on the terminal and in the log), stop with the
        teardown budget, and say what to try before the next launch."""
        from xpuctl.core import advice

        run = self.keeper
        assert run.pump is not None
        # stopping from now on (the diagnosis may take a while): never "starting" then stale
        run.set(state="stopping", stopping_by=own_identity())
        lines = list(run.pump.tail)
        with run.track_lock:
            phase = run.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        sigs, keys, said = _start_diagnosis(lines, where, phase.hint)
        run.say(f"xpuctl: {run.rec.name}: not ready after {run.opts.ready_timeout:g}s; {said}")
        if not run.foreground:  # in the foreground vLLM's lines are on the terminal already
            for line in lines[-10:]:
                run.say(f"xpuctl:   | {safe(line, 300)}")
        self._doctor_says()
        run.set(notes=[*run.rec.notes,
                       f"not ready after {run.opts.ready_timeout:g}s: {phase.label}"])
        result = self.stopper.stop_tree(f"stopping: not ready after "
                                        f"{run.opts.ready_timeout:g}s (stuck in: {where})")
        run.set(state="failed", exit_code=int(ExitCode.NOT_READY), stopped_at=time.time())
        crashed = any(s.kind == "crash" for s in sigs)  # the crash's own advice first
        keys = [*keys, "not-ready"] if crashed else ["not-ready", *keys]
        run.say("xpuctl: before the next launch, try (advice only; each has a cost):")
        for line in advice.lines(keys, skip=(advice.RESET,)):
            run.say(f"xpuctl:   - {line}")
        self.stopper.next_step(result.verdict)
        self.stopper.end(f"failed {int(ExitCode.NOT_READY)}")
        return ExitCode.NOT_READY

    def _doctor_says(self) -> None:
        """What doctor finds on the run's devices, and the known-issues rows the run's own
        versions fall in (core/known; bounded at 5 s), said before the stop."""
        run = self.keeper
        try:
            from xpuctl.diagnosis import diagnose
            from xpuctl.probes.versions import known_rows

            report = diagnose(run.host, run.plan.bdfs or None, None)
            for f in report.findings:
                if f.severity != "info":
                    run.say(f"xpuctl:   doctor {f.severity} {f.check}: {safe(f.message)}")
            for line in known_rows(run.host, run.plan.env, 5.0):  # its versions: core/known
                run.say(f"xpuctl:   {safe(line)}")
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
