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

Each is summed over its series (every engine of the server).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

RUNNING = "vllm:num_requests_running"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
WATCHED = frozenset({RUNNING, GENERATION_TOKENS, PROMPT_TOKENS})


class Sample(NamedTuple):
    """One sample line: its metric name, its labels in order, and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


class Counters(NamedTuple):
    """What the watch reads of one `/metrics` answer; None: the server did not say."""

    running: float | None
    generation_tokens: float | None
    prompt_tokens: float | None


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


def counters(text: str) -> Counters:
    """The running requests and the two token counters, each summed over its series (NaN
    and infinite samples are left out); None for a metric the text does not hold."""
    sums: dict[str, float] = {}
    for s in samples(text, WATCHED):
        if math.isfinite(s.value):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return Counters(sums.get(RUNNING), sums.get(GENERATION_TOKENS), sums.get(PROMPT_TOKENS))
