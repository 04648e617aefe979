"""The I/O around serve's liveness watch (the machine itself is core/watch.py, pure).

`LineWatch` reads vLLM's lines as the supervisor's log pump copies them: the first that says
the engine died once the run is ready (it wakes the watch at once), and the first where a
signal asked vLLM's API server to stop. `Observer` makes one `Observation`: /health, /metrics,
those lines, and the kernel's new records of the run's devices. `Watcher` runs a check when
one is due, keeps the run record's `health` field and the service manager (host/notify.py)
told, and sends the systemd watchdog's keep-alive only while the run is healthy: the
keep-alive comes from the loop that checks, so a stuck check, a stuck supervisor or an
unhealthy run (even with `--on-unhealthy report`) all stop it, and `WatchdogSec=` acts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from xpuctl.core.runrecords import Health
from xpuctl.core.watch import (
    HEALTHY,
    STARTING,
    Observation,
    Verdict,
    Watch,
    WatchConfig,
)
from xpuctl.host import http
from xpuctl.host.kernel import KernelFollower
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.parse import metrics
from xpuctl.parse.enginedeath import EngineDeath, engine_death, stop_triggered

if TYPE_CHECKING:  # types only
    from xpuctl.serve.reach import Prober

#: the longest the supervisor's loop sleeps: how soon it sees vLLM's exit or a signal
LOOP_SLEEP = 0.2
#: /health's answer is small; /metrics' is read up to this many bytes
METRICS_LIMIT = 4 << 20
#: the longest /health is asked again after an engine-death line, while it still says 200
DEATH_GRACE = 2.0


def probe_timeout(interval: float, watchdog: float | None) -> float:
    """How long one request of a check may take: about an interval (0.5 to 5 s), and under a
    quarter of the watchdog's timeout, so a slow answer never delays the keep-alive past it."""
    t = min(max(interval, 0.5), 5.0)
    if watchdog is not None:
        t = min(t, max(0.1, watchdog / 4))
    return t


class LineWatch:
    """What vLLM's own lines say about the run (fed by the log pump's thread)."""

    def __init__(self) -> None:
        self.death: EngineDeath | None = None  # the first engine-death line once ready
        self.stop_line: str | None = None  # the first "[shutdown] API server: shutdown triggered"
        self.woken = threading.Event()  # an engine-death line: check now

    def feed(self, line: str, ready: bool) -> None:
        if self.stop_line is None and stop_triggered(line):
            self.stop_line = line
        if ready and self.death is None:
            death = engine_death([line])
            if death is not None:
                self.death = death
                self.woken.set()


class Observer:
    """One check of a ready run, in an `Observation`."""

    def __init__(self, host: Host, prober: Prober, devices: list[str], lines: LineWatch,
                 timeout: float) -> None:
        self.prober = prober  # the server reached as it is configured (serve/reach.py)
        self.devices = set(devices)  # none named: vLLM sees every device
        self.lines = lines
        self.timeout = timeout
        self.kernel = KernelFollower(host)
        self.wedged: str | None = None
        self.reset: str | None = None
        self.death_seen = False
        self.grace = timeout

    def observe(self, at: float) -> Observation:
        from xpuctl.parse.kmsg import HANG, WEDGED

        health = self._health(at)
        counters = None
        if health.status is not None:  # nothing answered /health: /metrics would not either
            got = self.prober.metrics(self.timeout, METRICS_LIMIT)
            if got is not None and got.status == 200:
                counters = metrics.engines(got.body)
        for event in self.kernel.read():
            if self.devices and event.bdf not in self.devices:
                continue
            if event.kind == WEDGED and self.wedged is None:
                self.wedged = event.record.line()
            elif event.kind == HANG:
                self.reset = event.record.line()
        return Observation(at, health.status, health.error, counters, self.lines.death,
                           self.wedged, self.reset)

    def _health(self, at: float) -> http.Reply:
        """/health's answer. Right after vLLM logged its engine's death, /health may still
        answer 200 for a moment (EngineCore's own line comes before the API server's monitor
        notices): it is asked again for up to DEATH_GRACE, so the reason says what it says
        once it knows."""
        reply = self.prober.health(self.timeout, 4096)
        if self.lines.death is None or self.death_seen:
            return reply
        self.death_seen = True
        end = at + min(self.grace, DEATH_GRACE)
        while reply.status == 200 and time.monotonic() < end:
            time.sleep(0.1)
            reply = self.prober.health(self.timeout, 4096)
        return reply

    def close(self) -> None:
        self.kernel.close()


class Watcher:
    """Checks when due, records the verdict, tells the service manager, keeps the watchdog
    fed while healthy. `tick` is called by the supervisor's loop between its other duties."""

    def __init__(self, config: WatchConfig, observer: Observer, notifier: Notifier,
                 record: Callable[[Health], None], ready_text: str,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.observer = observer
        self.notifier = notifier
        self.record = record
        self.ready_text = ready_text
        self.clock = clock
        self.wall = wall
        now = clock()
        self.machine = Watch(config, now)
        self.since_wall = wall()
        self.next_check = now + config.interval
        half = notifier.watchdog / 2 if notifier.watchdog is not None else None
        self.ping_every = half
        self.next_ping = now
        self._write(self.machine.verdict, self.since_wall)
        self._ping(now)

    @property
    def verdict(self) -> Verdict:
        return self.machine.verdict

    def tick(self) -> Verdict | None:
        """A check when one is due (or vLLM's lines said its engine died): the new verdict;
        None when no check ran. Then the watchdog's keep-alive when due and healthy."""
        now = self.clock()
        checked = None
        if self.observer.lines.woken.is_set() or now >= self.next_check:
            self.observer.lines.woken.clear()
            before = self.machine.verdict
            checked = self.machine.feed(self.observer.observe(now))
            self.next_check = max(self.next_check + self.config.interval, now)
            if checked.state != before.state:
                self.since_wall = self.wall()
                self.notifier.status(checked.reason or f"{self.ready_text}: healthy again")
            self._write(checked, self.since_wall)
            now = self.clock()
        self._ping(now)
        return checked

    def sleep(self) -> None:
        """Until the next duty (a check, a keep-alive) or LOOP_SLEEP, whichever is first;
        an engine-death line wakes it."""
        now = self.clock()
        due = self.next_check
        if self.ping_every is not None and self.machine.verdict.healthy:
            due = min(due, self.next_ping)
        self.observer.lines.woken.wait(min(LOOP_SLEEP, max(0.0, due - now)))

    def _ping(self, now: float) -> None:
        if self.ping_every is None or now < self.next_ping or not self.machine.verdict.healthy:
            return
        self.notifier.ping()
        self.next_ping += self.ping_every  # on a fixed grid: the loop's delays do not add up
        if self.next_ping <= now:
            self.next_ping = now + self.ping_every

    def _write(self, verdict: Verdict, since: float) -> None:
        self.record(Health(verdict.state, since, verdict.reason, self.wall(), self.config.interval))


def starting_health(since: float, now: float, interval: float) -> Health:
    """The record's `health` while vLLM starts: the supervisor is alive and waiting."""
    return Health(STARTING, since, None, now, interval)


__all__ = ["HEALTHY", "LineWatch", "Observer", "Watcher", "probe_timeout", "starting_health"]
