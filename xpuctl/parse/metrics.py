"""Prometheus text (vLLM's `/metrics`) in, samples and the counters serve's watch needs out.

The format is Prometheus' text exposition 0.0.4 (prometheus.io, "Exposition formats"), what
prometheus_client writes for vLLM: `# HELP` and `# TYPE` lines, then one sample per line,
`name{label="value",...} value [timestamp]`. A label value escapes `\\`, `"` and a newline as
`\\\\`, `\\"` and `\\n`; a value is a float, `NaN`, `+Inf` or `-Inf`. A line that is not a
sample is skipped: the parser never raises.

What the watch reads (vLLM's `v1/metrics/loggers.py`, labels `model_name` and `engine`, one
series per engine; docs/vllm.md, "Metrics"):

- `vllm:num_requests_running` (gauge): requests in the engine's batches;
- `vllm:generation_tokens_total` and `vllm:prompt_tokens_total`: the counters
  `vllm:generation_tokens` and `vllm:prompt_tokens` (prometheus_client adds `_total` to a
  counter's sample, and writes a `_created` sample beside it, which is not the count).

- `vllm:num_requests_waiting` (gauge): requests queued (also those waiting for a sleeping
  engine to wake);
- `vllm:engine_sleep_state` (gauge, labels `engine` and `sleep_state`: `awake`,
  `weights_offloaded`, `discard_all`; vLLM's `v1/metrics/loggers.py`, docs/vllm.md): the
  `awake` sample is 1 while the engine is awake and 0 while it sleeps (issue 37 §4).

The watch reads them per engine (`engines`: one `EngineCounters` per `engine` label; with
`--data-parallel-size N` vLLM serves N series), so one hung engine is not hidden by another's
progress. A shutdown's drain reads the running and waiting requests summed over every series
(`in_flight`). This is xpuctl's one reader of vLLM's `/metrics` (issue 38 §4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
SLEEP_STATE = "vllm:engine_sleep_state"
WATCHED = frozenset({RUNNING, WAITING, GENERATION_TOKENS, PROMPT_TOKENS, SLEEP_STATE})


class Sample(NamedTuple):
    """One sample line: its metric name, its labels in order, and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


class Counters(NamedTuple):
    """What the watch reads of one engine in one `/metrics` answer; None: it did not say."""

    running: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    engine: str = ""  # its `engine` label ("" when the server labels no engine)
    waiting: float | None = None
    asleep: bool | None = None  # None: no vllm:engine_sleep_state (sleep mode is off)
    sleep_state: str | None = None  # asleep: weights_offloaded | discard_all (the 1 sample)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _name_end(line: str) -> int:
    """Where the metric name of a sample line ends (at `{`, a blank, or the end)."""
    for i, ch in enumerate(line):
        if ch in "{ \t":
            return i
    return len(line)


def _labels(text: str, start: int) -> tuple[tuple[tuple[str, str], ...], int] | None:
    """The label set that opens at `text[start] == "{"`, and the index after its `}`."""
    out: list[tuple[str, str]] = []
    i = start + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t,":
            i += 1
        if i >= n:
            return None
        if text[i] == "}":
            return tuple(out), i + 1
        eq = text.find("=", i)
        if eq < 0:
            return None
        key = text[i:eq].strip()
        i = eq + 1
        while i < n and text[i] in " \t":
            i += 1
        if i >= n or text[i] != '"' or not key:
            return None
        i += 1
        value: list[str] = []
        while True:
            if i >= n:
                return None
            ch = text[i]
            if ch == "\\" and i + 1 < n:
                value.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
                i += 2
                continue
            if ch == '"':
                i += 1
                break
            value.append(ch)
            i += 1
        out.append((key, "".join(value)))


def _value(text: str) -> float | None:
    """The sample's value: the first word after the name and labels (a timestamp may follow)."""
    words = text.split()
    if not words or len(words) > 2:
        return None
    try:
        return float(words[0])  # also "NaN", "+Inf", "-Inf"
    except ValueError:
        return None


def parse_sample(line: str) -> Sample | None:
    """One sample line, or None (a comment, a blank line, or a line that is not a sample)."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    end = _name_end(line)
    name = line[:end]
    if not name:
        return None
    labels: tuple[tuple[str, str], ...] = ()
    rest = line[end:]
    if rest.lstrip(" \t").startswith("{"):
        got = _labels(rest, rest.index("{"))
        if got is None:
            return None
        labels, after = got
        rest = rest[after:]
    value = _value(rest)
    return None if value is None else Sample(name, labels, value)


def samples(text: str, names: Iterable[str] | None = None) -> list[Sample]:
    """Every sample of the exposition `text`, in order; with `names`, only those metrics (a
    line of another metric is passed over without parsing its labels)."""
    wanted = frozenset(names) if names is not None else None
    prefixes = tuple(wanted) if wanted is not None else ()
    out: list[Sample] = []
    for line in text.splitlines():
        # vLLM's answer holds thousands of histogram lines: most are passed over by one
        # startswith, without a character loop (about 20x cheaper on a 100 kB answer)
        if wanted is not None and not line.lstrip(" \t").startswith(prefixes):
            continue
        s = parse_sample(line)
        if s is not None and (wanted is None or s.name in wanted):
            out.append(s)
    return out


def _label(labels: tuple[tuple[str, str], ...], key: str) -> str:
    return next((v for k, v in labels if k == key), "")


def _sleep(got: dict[str, float]) -> tuple[bool | None, str | None]:
    """(asleep, the state it sleeps in) from one engine's vllm:engine_sleep_state samples."""
    awake = got.get("awake")
    if awake is None:
        return None, None
    if awake > 0:
        return False, None
    state = max((v, k) for k, v in got.items() if k != "awake")[1] if len(got) > 1 else None
    return True, state


def engines(text: str) -> tuple[Counters, ...]:
    """One `Counters` per `engine` label, in the order of the labels (a number sorts as
    one); each metric summed over that engine's series (several models); NaN and infinite
    samples are left out. Empty when the text holds none of the metrics."""
    sums: dict[str, dict[str, float]] = {}
    sleep: dict[str, dict[str, float]] = {}
    for s in samples(text, WATCHED):
        if not math.isfinite(s.value):
            continue
        engine = _label(s.labels, "engine")
        if s.name == SLEEP_STATE:
            sleep.setdefault(engine, {})[_label(s.labels, "sleep_state")] = s.value
            continue
        got = sums.setdefault(engine, {})
        got[s.name] = got.get(s.name, 0.0) + s.value
    out = []
    for engine in sorted(set(sums) | set(sleep), key=lambda e: (not e.isdigit(), e.zfill(9))):
        got = sums.get(engine, {})
        asleep, state = _sleep(sleep.get(engine, {}))
        out.append(Counters(got.get(RUNNING), got.get(GENERATION_TOKENS), got.get(PROMPT_TOKENS),
                            engine, got.get(WAITING), asleep, state))
    return tuple(out)


def counters(text: str) -> Counters:
    """The running requests and the two token counters summed over every series (every
    engine); None for a metric the text does not hold."""
    sums: dict[str, float] = {}
    for s in samples(text, (RUNNING, WAITING, GENERATION_TOKENS, PROMPT_TOKENS)):
        if math.isfinite(s.value):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return Counters(sums.get(RUNNING), sums.get(GENERATION_TOKENS), sums.get(PROMPT_TOKENS),
                    waiting=sums.get(WAITING))


def in_flight(text: str) -> int | None:
    """Running plus waiting requests over every series (what a drain waits for); None when
    the text holds neither gauge."""
    c = counters(text)
    if c.running is None and c.waiting is None:
        return None
    return int((c.running or 0.0) + (c.waiting or 0.0))
