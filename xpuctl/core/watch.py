"""serve's liveness watch, as a pure state machine, and the one rule for a recorded health.

vLLM's engine can die or spin while its API server lives on (vLLM #54553: /health 503 and
every request 500; vLLM #54698: /health 200 and no token ever produced). Supervising the
processes sees none of it. Once a run is ready, serve feeds this machine an `Observation`
every `--health-interval` seconds (serve/watch.py makes them: /health, /metrics, vLLM's log
and the kernel log) with a monotonic clock, and acts on the `Verdict`:

- **unhealthy** when /health fails (an answer other than 200, a refused connection, no answer
  in time) at every check for `--unhealthy-after` seconds without a break; at once when vLLM
  logged that its engine died (parse/enginedeath.py) or the kernel declared one of the run's
  devices wedged (parse/kmsg.py). An engine death or a wedge is for good.
- **stalled** when requests are running on an engine and neither of its
  `vllm:generation_tokens_total` nor `vllm:prompt_tokens_total` moved for `--stall-after`
  seconds. Each engine is judged on its own (the `engine` label: one per data-parallel rank),
  and the reason names it. `--stall-after 0` turns the stall check off.
- **sleeping** when every engine that reports `vllm:engine_sleep_state` is asleep (vLLM's
  sleep mode, `POST /sleep`): alive and as asked. A sleeping engine is never stalled: the
  requests that wait for it to wake are not judged (issue 37 §4).
- **healthy** otherwise: one failed check (a blip), an idle server, and a slow request whose
  counters move are all healthy. A failing /health or a stall that clears is healthy again.
  An engine that hangs on its first step after an idle spell looks idle here (its gauges
  stay at 0): docs/serve-exits.md says why no signal a client cannot fake shows it.

`judge` reads a run record's state and `health` field (what `xpuctl health`, `ps`, doctor and
its Prometheus text all say) without looking at any process: a check older than three
intervals proves nothing, so it is not healthy.
"""

from __future__ import annotations

from typing import NamedTuple

from xpuctl.core.runrecords import Health
from xpuctl.output.safetext import safe
from xpuctl.parse.enginedeath import QUOTE, EngineDeath
from xpuctl.parse.metrics import Counters

STARTING, HEALTHY, UNHEALTHY, STALLED = "starting", "healthy", "unhealthy", "stalled"
SLEEPING = "sleeping"
#: the states of a run that is alive and as asked (`xpuctl health` exits 0)
ALIVE = frozenset({STARTING, HEALTHY, SLEEPING})
#: a check older than this many intervals proves nothing (a hung or dead supervisor)
STALE_INTERVALS = 3
#: a check runs a little after its due time, so N intervals between two checks measure a hair
#: under N intervals: a window is reached this share of an interval early (else a 3 s window
#: checked every second would often be decided at the 5th failed check, not the 4th)
SLACK = 0.1


class WatchConfig(NamedTuple):
    interval: float  # seconds between checks
    unhealthy_after: float  # seconds of /health failing without a break
    stall_after: float  # seconds of running requests with no token counted; 0: never judged


class Observation(NamedTuple):
    """One check of a ready run."""

    at: float  # monotonic seconds
    status: int | None  # /health's HTTP status; None: no answer
    error: str | None  # why there was none, in words ("connection refused", "timed out ...")
    counters: tuple[Counters, ...] | None  # /metrics, one per engine; None: no 200 answer
    death: EngineDeath | None = None  # the first line where vLLM said its engine died
    wedged: str | None = None  # a kernel record: a device of the run was declared wedged
    reset: str | None = None  # the last kernel record of a hang or reset of one of them


class Verdict(NamedTuple):
    state: str  # healthy | sleeping | unhealthy | stalled
    since: float  # monotonic seconds: when the run entered `state`
    reason: str | None  # "unhealthy: ...", "stalled: ..." or "sleeping: ..."

    @property
    def healthy(self) -> bool:
        """Alive and as asked: healthy, or sleeping (nothing to act on)."""
        return self.state in (HEALTHY, SLEEPING)


def _quote(line: str) -> str:
    """A line of the kernel's, escaped and capped (output/safetext.py)."""
    return f'"{safe(line.strip(), QUOTE)}"'


def health_said(status: int | None, error: str | None) -> str:
    """What /health did, in words: `answered 503`, `failed (connection refused)`."""
    if status is not None:
        return f"answered {status}"
    return f"failed ({error or 'no answer'})"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


class Watch:
    """The watch of one ready run: `feed` it each observation, in time order."""

    def __init__(self, config: WatchConfig, now: float) -> None:
        self.config = config
        self.failing_since: float | None = None  # first /health failure of the current run of them
        self.start = now
        self.progress_at: dict[str, float] = {}  # per engine: a token counted, or nothing ran
        self.tokens: dict[str, tuple[float | None, float | None]] = {}
        self.verdict = Verdict(HEALTHY, now, None)

    def feed(self, obs: Observation) -> Verdict:
        reason = self._reason(obs)
        state = HEALTHY if reason is None else reason.split(":", 1)[0]
        since = self.verdict.since if state == self.verdict.state else obs.at
        self.verdict = Verdict(state, since, reason)
        return self.verdict

    def _reason(self, obs: Observation) -> str | None:
        failing = obs.status != 200
        if not failing:
            self.failing_since = None
        elif self.failing_since is None:
            self.failing_since = obs.at
        stalled = self._stalled(obs)
        said = health_said(obs.status, obs.error)
        if obs.death is not None:  # its line comes escaped and capped (parse/enginedeath.py)
            return (f'unhealthy: {obs.death.what}: vLLM logged "{obs.death.line}"; '
                    f"/health {said}")
        if obs.wedged is not None:
            return (f"unhealthy: the kernel declared a device of the run wedged: "
                    f"{_quote(obs.wedged)}; /health {said}")
        slack = SLACK * self.config.interval
        if (self.failing_since is not None
                and obs.at - self.failing_since + slack >= self.config.unhealthy_after):
            kernel = f"; the kernel logged {_quote(obs.reset)}" if obs.reset else ""
            return (f"unhealthy: /health {said} at every check for "
                    f"{obs.at - self.failing_since:.1f}s{kernel}")
        if stalled is not None and self.config.stall_after > 0:
            c, stalled_for = stalled
            if stalled_for + slack >= self.config.stall_after:
                return _stall_reason(c, stalled_for)
        return _sleep_reason(obs.counters)

    def _stalled(self, obs: Observation) -> tuple[Counters, float] | None:
        """The engine that has gone longest without a token counted while its requests run,
        and for how long; None when none runs anything or /metrics cannot tell (no answer, no
        running gauge, no token counter). A sleeping engine is not judged."""
        worst: tuple[Counters, float] | None = None
        for c in obs.counters or ():  # no answer: no news, the last progress stays
            stalled_for = self._engine_stalled_for(c, obs.at)
            if stalled_for is not None and (worst is None or stalled_for > worst[1]):
                worst = (c, stalled_for)
        return worst

    def _engine_stalled_for(self, c: Counters, at: float) -> float | None:
        if c.running is None:
            return None
        tokens = (c.generation_tokens, c.prompt_tokens)
        idle = c.running <= 0 or tokens == (None, None) or bool(c.asleep)
        if idle or tokens != self.tokens.get(c.engine):
            self.progress_at[c.engine] = at
        self.tokens[c.engine] = tokens
        if idle:
            return None
        return at - self.progress_at.get(c.engine, self.start)


def _stall_reason(c: Counters, stalled_for: float) -> str:
    engine = f"engine {safe(c.engine, 40)}: " if c.engine else ""
    return (f"stalled: {engine}{_number(c.running)} request(s) running and neither "
            f"vllm:generation_tokens_total ({_number(c.generation_tokens)}) nor "
            f"vllm:prompt_tokens_total ({_number(c.prompt_tokens)}) moved for "
            f"{stalled_for:.1f}s")


def _sleep_reason(counters: tuple[Counters, ...] | None) -> str | None:
    """`sleeping: ...` when every engine that reports its sleep state is asleep."""
    told = [c for c in counters or () if c.asleep is not None]
    if not told or not all(c.asleep for c in told):
        return None
    states = sorted({c.sleep_state or "asleep" for c in told})
    waiting = sum(c.waiting or 0.0 for c in told)
    which = "the engine" if len(told) == 1 else f"all {len(told)} engines"
    return (f"sleeping: {which} asleep ({', '.join(safe(s, 40) for s in states)}; "
            f"vllm:engine_sleep_state); {_number(waiting)} request(s) waiting for it to wake")


class Judged(NamedTuple):
    """A run as `xpuctl health` and doctor see it from its record."""

    healthy: bool
    status: str  # starting | healthy | sleeping | unhealthy | stalled | stale | unknown |
    #              stopping | stopped | failed
    detail: str  # one line for people


def judge(state: str, health: Health | None, now: float, reason: str | None = None) -> Judged:
    """The run record's `state` (and `reason`, for an ended run) and `health`, at wall time
    `now`. Healthy: the watch said healthy (or the run is still starting, which its readiness
    deadline bounds) no more than three intervals ago."""
    if state in ("stopped", "failed"):
        return Judged(False, state, f"{state}" + (f": {reason}" if reason else ""))
    if state == "stopping":
        return Judged(False, "stopping", "stopping")
    if health is None:
        return Judged(False, "unknown", "unknown: no health check recorded (a run of an xpuctl "
                                        "without the watch)")
    age = max(0.0, now - health.checked_at)
    if age > STALE_INTERVALS * health.interval:
        return Judged(False, "stale", f"stale: not checked for {age:.0f}s (every "
                                      f"{health.interval:g}s): its supervisor is stuck or gone")
    if health.state in ALIVE:
        return Judged(True, health.state, f"{health.state} (checked {age:.0f}s ago)")
    return Judged(False, health.state, health.reason or health.state)
