"""Readiness: vLLM's start shown as it happens, /health and /v1/models probed until they
answer (a deadline vLLM itself lacks), then ready. A start that does not get there is
serve/failedstart.py's."""

from __future__ import annotations

import time

from xpuctl.parse.vllmlog import STARTING
from xpuctl.serve.launch import ray_python
from xpuctl.serve.reach import READY, startup_complete
from xpuctl.serve.record import RecordKeeper
from xpuctl.serve.stopping import Stopper
from xpuctl.serve.watch import starting_health

READY_POLL = 0.1  # seconds between readiness probes
READY_PROBE_TIMEOUT = 0.3  # one probe of /health (and /v1/models)
EXTEND_EVERY = 10.0  # seconds between EXTEND_TIMEOUT_USEC messages while vLLM starts


class Readiness:
    """From launch to ready, a timeout, a signal, or vLLM's exit."""

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
