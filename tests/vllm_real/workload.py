"""Sizing a completion workload from the server under test, never from a constant.

The drain test needs requests that are still running when xpuctl's SIGTERM lands and
that finish well inside vLLM's drain deadline. How long n sequences take depends on the
machine (one 2-core machine decoded the same workload in 21 s, another in 40 s), so the
test measures two figures in its own run and sizes the work from them:

- the server's decode rate (tokens/s), from a calibration completion that fills a whole
  batch (`--max-num-seqs` sequences, `max_tokens` each, EOS ignored) so that the rate is
  the one of the saturated batch the in-flight work will run at;
- how long xpuctl takes from its start to a decision (`shutdown --dry-run`), since the
  real shutdown needs about that long before its SIGTERM. It is measured while the
  calibration batch runs: with the server decoding on every core, xpuctl's own start-up
  is several times slower than on an idle host (0.5 s idle, 4.9 s under load, same run).

plan() turns them into a number of sequences per request: the in-flight work lasts
`target_s` at the measured rate, where target_s is at least MIN_WORK_S and at least
LEAD_FACTOR times the dry run, and at most the drain budget divided by BUDGET_FACTOR.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from . import realvllm

MIN_WORK_S = 40.0  # the in-flight work lasts at least this long at the measured rate (a busy
# 2-core machine has taken 12 s from `xpuctl shutdown` to its first SIGTERM: see the notes)
LEAD_FACTOR = 4.0  # ... and at least this many times xpuctl's own time to a decision
BUDGET_FACTOR = 4.0  # the drain budget is at least this many times the planned work
MAX_SEQS = 8192  # a sanity cap on n (the response of one request holds n texts)


class Rate(NamedTuple):
    tokens: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-3)


class Plan(NamedTuple):
    rate: float  # measured tokens/s
    lead_s: float  # measured xpuctl time to a decision (dry run)
    target_s: float  # planned duration of the in-flight work
    n_seqs: int  # sequences per request
    requests: int
    max_tokens: int

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.requests * self.max_tokens


def completion_body(model: str, n: int, max_tokens: int) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "n": n,
            "temperature": 1.0, "ignore_eos": True}


def measure_rate(base_url: str, model: str, n: int, max_tokens: int,
                 timeout: float = 600.0) -> Rate:
    """Decode rate of one completion of n x max_tokens (EOS ignored). Raises AssertionError
    when the server does not answer 200 with every token."""
    t0 = time.monotonic()
    status, body = realvllm.http_json(base_url + "/v1/completions",
                               completion_body(model, n, max_tokens), timeout=timeout)
    seconds = time.monotonic() - t0
    assert status == 200, f"calibration request failed: {status} {str(body)[:300]}"
    tokens = body["usage"]["completion_tokens"]
    assert tokens == n * max_tokens, body["usage"]
    return Rate(tokens, seconds)


def plan(rate: Rate, lead_s: float, drain_budget_s: float, requests: int, max_tokens: int,
         min_seqs: int) -> Plan:
    """Sequences per request so that `requests` requests of max_tokens last target_s at
    `rate`: target_s = max(MIN_WORK_S, LEAD_FACTOR x lead_s), capped at
    drain_budget_s / BUDGET_FACTOR; n is at least min_seqs (a full batch)."""
    target = max(MIN_WORK_S, LEAD_FACTOR * lead_s)
    target = min(target, drain_budget_s / BUDGET_FACTOR)
    n = math.ceil(rate.per_s * target / (requests * max_tokens))
    n = max(min_seqs, min(MAX_SEQS, n))
    return Plan(rate.per_s, lead_s, target, n, requests, max_tokens)


class Loaded(NamedTuple):
    rate: Rate
    lead_s: float  # how long action() took while the calibration batch was running
    covered: bool  # the calibration was still running when action() returned


def measure_under_load(base_url: str, model: str, n: int, max_tokens: int,
                       running: Callable[[], bool], action: Callable[[], object],
                       timeout: float = 600.0) -> Loaded:
    """Run a calibration completion of n x max_tokens; once running() says it is in
    flight, time action() (e.g. an xpuctl dry run) under that load. Raises AssertionError
    when the calibration fails or never shows as running."""
    out: list[Rate | BaseException] = []

    def calibrate() -> None:
        try:
            out.append(measure_rate(base_url, model, n, max_tokens, timeout))
        except BaseException as e:
            out.append(e)

    th = threading.Thread(target=calibrate, daemon=True)
    th.start()
    end = time.monotonic() + timeout
    while not running() and th.is_alive() and time.monotonic() < end:
        time.sleep(0.05)
    t0 = time.monotonic()
    action()
    lead = time.monotonic() - t0
    covered = th.is_alive()
    th.join(max(1.0, end - time.monotonic()))
    assert out, "calibration request did not finish"
    if isinstance(out[0], BaseException):
        raise out[0]
    return Loaded(out[0], lead, covered)
