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

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import IO, TYPE_CHECKING

from xpuctl.actions.signals import (
    EXITED,
    Target,
    become_subreaper,
    own_identity,
    reap_children,
    set_parent_death_signal,
    target_of,
)
from xpuctl.core.runrecords import Health
from xpuctl.core.watch import Observation, Verdict, WatchConfig
from xpuctl.errors import ExitCode, XpuctlError
from xpuctl.host import http
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.output.lines import event_line, next_line
from xpuctl.output.safetext import safe
from xpuctl.parse.vllmlog import STARTING
from xpuctl.serve.budget import worst_stop_seconds
from xpuctl.serve.launch import LaunchPlan, ServeOptions, ray_python
from xpuctl.serve.watch import LineWatch, Observer, Watcher, probe_timeout, starting_health
from xpuctl.state import audit
from xpuctl.state.regular import open_regular
from xpuctl.state.runs import (
    PinnedRuns,
    RunRecord,
    StateDirChangedError,
    stop_abandoned,
    update_record,
)

if TYPE_CHECKING:  # types only: the log's parser and the ladder are imported where used
    from xpuctl.parse.vllmlog import LogSignature
    from xpuctl.shutdown.ladder import Event, StopResult
    from xpuctl.shutdown.targets import ServerTree

READY_POLL = 0.1  # seconds between readiness probes
READY_PROBE_TIMEOUT = 0.3  # one probe of /health (and /v1/models)
LAST_LINES = 20  # of vLLM's output, kept in the record of a run that failed
EXTEND_EVERY = 10.0  # seconds between EXTEND_TIMEOUT_USEC messages while vLLM starts


def open_log(log_path: str) -> int | None:
    """The run log, opened once for the run's life (appended; a regular file only: a FIFO
    there would block serve). None when it cannot be opened: the run goes on unlogged."""
    try:
        return open_regular(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return None


class _Pump(threading.Thread):
    """Copy vLLM's output to the log file, keeping the last lines, and hand each line to
    `on_line` (the start-up tracker) and `echo` (foreground: the terminal)."""

    def __init__(self, stream: IO[bytes], log_fd: int | None, on_line: Callable[[str], None],
                 echo: Callable[[str], None] | None) -> None:
        super().__init__(daemon=True, name="xpuctl-log")
        self.stream = stream
        self.log_fd = log_fd
        self.on_line = on_line
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=200)

    def write(self, raw: bytes) -> None:
        """One write(2) onto the log (O_APPEND): vLLM's lines and xpuctl's never mix inside
        a line. A full or read-only disk loses the line, never the run. (The descriptor
        stays open until serve exits: xpuctl's own lines may still come after vLLM's.)"""
        if self.log_fd is None:
            return
        try:
            os.write(self.log_fd, raw)
        except OSError:
            pass

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            if not raw.endswith(b"\n"):
                raw += b"\n"
            self.write(raw)
            text = raw.decode("utf-8", "surrogateescape").rstrip("\n")
            self.tail.append(text)
            if self.echo is not None:  # the log keeps the exact bytes; the terminal, escapes
                self.echo(text)
            self.on_line(text)


class _Interrupted(Exception):
    pass


class RunSupervisor:
    """One run from launch to exit, in named steps: `launch`, `wait_ready` (the start shown
    as it happens; a readiness deadline), then `not_ready` (diagnose, stop with the teardown
    budget, advise) or `watch` (until vLLM exits or a signal asks for a stop)."""

    def __init__(self, host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                 state_dir: str, view: progress.View, foreground: bool,
                 notifier: Notifier | None = None) -> None:
        self.host = host
        self.opts = opts
        self.plan = plan
        self.rec = rec
        self.state_dir = state_dir
        self.view = view
        self.foreground = foreground
        self.signals = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: _Pump | None = None
        self.t0 = time.monotonic()
        self.tracker = progress.Tracker(self.t0)
        self.track_lock = threading.Lock()
        self.ready = False
        self.pinned: PinnedRuns | None = None
        self.pin_error: OSError | None = None
        try:  # the state directory as it is now: records go there, or nowhere
            self.pinned = PinnedRuns(state_dir)
        except OSError as exc:
            self.pin_error = exc
        self.lost: set[str] = set()  # the record faults already said (once each)
        self.notify = notifier if notifier is not None else Notifier({})
        self.lines = LineWatch()
        self.watcher: Watcher | None = None
        self.observer: Observer | None = None
        self.url = f"http://{http.local_host(plan.bind)}:{plan.port}"
        self.stop_budget = worst_stop_seconds(opts.drain_timeout, opts.teardown_timeout,
                                              opts.kill_after)

    def say(self, msg: str) -> None:
        self.view.say(msg)

    def _set(self, **changes: object) -> None:
        """Note `changes` in the run record. A record that cannot be written (a full or
        read-only disk, a state directory deleted or replaced) stops nothing: the run is
        supervised and stopped as on a writable one, and the fault is said once."""
        try:
            if self.pinned is None:
                for k, v in changes.items():
                    setattr(self.rec, k, v)
                assert self.pin_error is not None
                raise self.pin_error
            update_record(self.state_dir, self.rec, pinned=self.pinned, **changes)
        except OSError as exc:
            self._record_lost(exc)

    def _record_lost(self, exc: OSError) -> None:
        """Say once (per kind) that the record is not being written: on the terminal (or in
        a detached run's log), and in the run log. A storage fault also covers the audit
        lines that are lost with it: the end of serve does not say it again."""
        kind = ("changed" if isinstance(exc, StateDirChangedError)
                else "locked" if isinstance(exc, TimeoutError) else "failed")
        if kind in self.lost:
            return
        self.lost.add(kind)
        sdir, name, why = safe(self.state_dir), safe(self.rec.name), safe(exc.strerror or str(exc))
        if kind == "changed":
            msg = (f"xpuctl: warning: state directory {sdir} was {why} while {name} ran: its "
                   "record is no longer written (a run there may take its name); the run is "
                   "still supervised and stopped as usual")
        elif kind == "locked":  # a stopped or stuck xpuctl holds the record's lock
            msg = (f"xpuctl: warning: the record of {name} was not updated ({why}); the run "
                   "is still supervised and stopped as usual")
        else:
            msg = (f"xpuctl: warning: state directory {sdir} cannot be written ({why}): the "
                   f"record of {name} (and its audit lines) are not kept; the run is still "
                   "supervised and stopped as usual")
            sink = audit.active()
            if sink is not None:
                sink.told = True
        self.say(msg)
        if self.foreground and self.pump is not None:
            self.pump.write(msg.encode("utf-8", "backslashreplace") + b"\n")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals >= 2:
            raise _Interrupted()

    def _on_line(self, line: str) -> None:
        self.lines.feed(line, self.ready)
        if self.ready:
            return
        with self.track_lock:
            changed = self.tracker.feed(line, time.monotonic())
        if changed is not None:
            self.view.phase(time.monotonic() - self.t0, changed.label)
        self.view.line(line)

    # -- steps ----------------------------------------------------------------------------

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
        self.observer = Observer(self.host, self.plan.bind, self.plan.port, self.plan.bdfs,
                                 self.lines, probe_timeout(self.opts.health_interval,
                                                           self.notify.watchdog))
        assert self.proc.stdout is not None  # stdout=PIPE
        self.pump = _Pump(self.proc.stdout, log_fd, self._on_line,
                          self.view.echo if self.foreground else None)
        self.pump.start()
        t = target_of(self.host, self.proc.pid)
        self._set(pid=self.proc.pid, start_ticks=t.start_ticks if t else None,
                  session=self.proc.pid, started_at=time.time(), state="starting")
        self.say(f"xpuctl: started {self.rec.name} (pid {self.proc.pid}, run {self.rec.run_id}), "
                 f"log {self.rec.log_path}")
        self.notify.status(f"starting vLLM (pid {self.proc.pid}): waiting for /health and "
                           f"/v1/models on {self.url}")

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
        local = http.local_host(self.plan.bind)
        phase = STARTING.label  # launch() said what it waits for
        next_beat = time.monotonic()
        while True:
            code = self.exit_code()
            if code is not None:
                return code
            if self.signals:
                return "signal"
            if http.ready(local, self.plan.port, READY_PROBE_TIMEOUT):
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
        self._start_watch()
        url = self.url
        took = f"after {now - self.t0:.1f}s"
        if self.foreground:  # the wording scripts and units already look for, per mode
            self.view.ready(f"xpuctl: ready on {url} {took} ({self.rec.name}: {summary})")
        else:
            self.view.ready(f"xpuctl: {self.rec.name} is ready on port {self.plan.port} ({url}) "
                            f"{took}: {summary}")

    def _start_watch(self) -> None:
        """The liveness watch, from now on (its first verdict, healthy, is recorded)."""
        config = WatchConfig(self.opts.health_interval, self.opts.unhealthy_after,
                             self.opts.stall_after)
        assert self.observer is not None
        self.watcher = Watcher(config, self.observer, self.notify, self._record_health,
                               f"ready on {self.url}")

    def _record_health(self, health: Health) -> None:
        try:
            self._set(health=health)
        except OSError as exc:  # a check that cannot be recorded: `xpuctl health` says stale
            self.say(f"xpuctl: could not record the run's health: {safe(str(exc))}")

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

    def end(self, status: str) -> None:
        """Tell a waiting `serve --detach` how the start ended (nothing in the foreground)."""
        if isinstance(self.view, progress.PipeSink):
            self.view.end(status)

    # -- helpers --------------------------------------------------------------------------

    def exit_code(self) -> int | None:
        assert self.proc is not None
        reap_children()
        code = EXITED.get(self.proc.pid)
        if code is not None:
            self.proc.returncode = code  # we reaped it, not Popen
        return code

    def _tree(self) -> ServerTree:
        from xpuctl.shutdown.targets import ServerTree

        assert self.proc is not None
        top = Target(self.proc.pid, self.rec.start_ticks or 0, "api-server")
        return ServerTree(top=top, role="api-server", orphan=False, run_id=self.rec.run_id,
                    session=self.rec.session, devices=tuple(self.plan.bdfs), port=self.plan.port,
                    bind=self.plan.bind, shutdown_timeout=self.plan.shutdown_timeout,
                    log_path=self.rec.log_path, record=self.rec, known=[top],
                    never_ready=not self.ready)

    def _show(self, ev: Event) -> None:
        """One step of a stop's timeline. vLLM's own lines (`vllm` steps, read from its log)
        are left out in the foreground: its output is echoed there already."""
        if self.foreground and ev.phase == "vllm":
            return
        self.say(f"xpuctl: {event_line(ev)}")

    def _next(self, verdict: str) -> None:
        """After a failure: the one command to run next (output.lines.next_line)."""
        self.say(next_line(self.plan.bdfs, self.plan.port, verdict))

    def stop_tree(self, why: str) -> StopResult:
        """The ladder on our own tree. A server that never became ready has nothing to
        drain: the tree gets the teardown budget only (ServerTree.never_ready)."""
        from xpuctl.shutdown.ladder import stop

        self.notify.stopping(why, self.stop_budget)
        self._set(state="stopping", stopping_by=own_identity())
        try:
            return stop(self.host, [self._tree()], kill_after=self.opts.kill_after,
                        release_timeout=self.opts.teardown_timeout, on_event=self._show,
                        on_wait=self.view.wait)
        except _Interrupted:
            self.view.wait(None)
            self.say("xpuctl: second interrupt: killing the tree now")
            return stop(self.host, [self._tree()], kill_after=0,
                        release_timeout=self.opts.teardown_timeout, on_event=self._show,
                        skip_drain=True, on_wait=self.view.wait)
        finally:
            if self.foreground and self.pump is not None:
                # the tree is gone: vLLM's last lines reach the terminal (they are left out
                # of the timeline there) before anything else is said
                self.pump.join(timeout=1.0)

    def _stop_on_signal(self) -> int:
        self.say("xpuctl: stopping (signal received; press Ctrl-C again to kill)")
        result = self.stop_tree("stopping: signal received")
        code = self._after_stop(result)
        self.end("stopped" if code == ExitCode.OK else f"exit {int(code)}")
        return code

    def not_ready(self) -> int:
        """Readiness timeout: diagnose (on the terminal and in the log), stop with the
        teardown budget, and say what to try before the next launch."""
        from xpuctl.core import advice

        assert self.pump is not None
        lines = list(self.pump.tail)
        with self.track_lock:
            phase = self.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        sigs, keys, said = _start_diagnosis(lines, where, phase.hint)
        self.say(f"xpuctl: {self.rec.name}: not ready after {self.opts.ready_timeout:g}s; {said}")
        if not self.foreground:  # in the foreground vLLM's lines are on the terminal already
            for line in lines[-10:]:
                self.say(f"xpuctl:   | {safe(line, 300)}")
        try:
            from xpuctl.doctor import diagnose
            from xpuctl.probes.versions import known_rows

            report = diagnose(self.host, self.plan.bdfs or None, None)
            for f in report.findings:
                if f.severity != "info":
                    self.say(f"xpuctl:   doctor {f.severity} {f.check}: {safe(f.message)}")
            for line in known_rows(self.host, self.plan.env, 5.0):  # its versions: core/known
                self.say(f"xpuctl:   {safe(line)}")
        except XpuctlError:
            pass
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

    def _after_stop(self, result: StopResult) -> int:
        """A stop that was asked for: 0 once the release is proven (also after a SIGKILL,
        and during start-up), 1 when something was left."""
        code = self.exit_code()
        leftovers = result.verdict == "leftovers"
        self._set(state="stopped" if not leftovers else "failed", exit_code=code, stopped_at=time.time())
        self.say(f"xpuctl: stopped: {result.verdict}")
        return ExitCode.PROBLEMS if leftovers else ExitCode.OK

    def _alive(self, pid: int, ticks: int) -> bool:
        return Target(pid, ticks).alive(self.host)

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

    def _stopper(self) -> RunRecord | None:
        """The record, when another xpuctl (a shutdown) marked the run "stopping" (read from
        the run's own state directory only: one made since holds no word of it)."""
        from xpuctl.state.runs import read_record

        if self.pinned is None or self.pinned.changed():
            return None
        disk = read_record(self.state_dir, self.rec.name, self.pinned)
        if disk and disk.run_id == self.rec.run_id and disk.state == "stopping" \
                and disk.stopping_by != own_identity():
            return disk
        return None

    def _stopped_by_other(self) -> bool:
        """A live `xpuctl shutdown` is stopping the run (it owns the ladder)."""
        disk = self._stopper()
        return disk is not None and not stop_abandoned(disk, self._alive)

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
