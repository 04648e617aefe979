"""A start that failed: vLLM stuck past serve's readiness deadline (diagnosed, stopped with
the teardown budget, advised), or exited before it was ready (diagnosed when its log says
why). The diagnosis reads the start's own log: the phase it reached, a oneCCL crash, a known
hang, the known-issues rows its lines show."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from xpuctl.actions.signals import own_identity
from xpuctl.errors import ExitCode, XpuctlError
from xpuctl.output.safetext import safe
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper

if TYPE_CHECKING:  # types only: the log's parser is imported where used
    from xpuctl.parse.vllmlog import LogSignature


class FailedStart:
    """What serve says and does when vLLM did not become ready."""

    def __init__(self, keeper: RecordKeeper, stopper: Stopper) -> None:
        self.keeper = keeper
        self.stopper = stopper

    def exited_before_ready(self, code: int) -> None:
        """vLLM exited during its start: when its log says why (a oneCCL crash, a known
        signature), the phase, the cause and what to try, before the exit is handled."""
        from xpuctl.core import advice

        run = self.keeper
        lines = run.last_lines()
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
