"""In-flight work for the drain test, sized from the drain budget, never from a throughput.

The drain test needs requests that are in flight when xpuctl's SIGTERM lands and that vLLM
finishes well inside its drain deadline. Sizing one long request from a measured decode rate
failed both ways: a rate measured on 1.1 s of one batch (15,007 tok/s) planned 300,240
tokens in n=1251 sequences, far outside the measured regime, and on a loaded machine vLLM
had done 37,200 of them at its deadline (issue 38 §7).

So the work is a `Feeder`: a few threads, each sending one request of `n` sequences after
another, until vLLM's own log says its shutdown began. Whenever the SIGTERM lands, requests are
in flight, however long xpuctl takes to send it and however fast the machine is; and what
vLLM must drain is at most one request per thread. `n` comes from the drain budget: one
request of exactly that shape is timed on the server under test (no extrapolation to another
shape), and n is halved until `threads x that time x margin` fits the budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from . import realvllm


def completion_body(model: str, n: int, max_tokens: int) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "n": n,
            "temperature": 1.0, "ignore_eos": True}


class Rate(NamedTuple):
    tokens: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-3)


def measure_rate(base_url: str, model: str, n: int, max_tokens: int,
                 timeout: float = 600.0) -> Rate:
    """Time one completion of n x max_tokens (EOS ignored). Raises AssertionError when the
    server does not answer 200 with every token."""
    t0 = time.monotonic()
    status, body = realvllm.http_json(base_url + "/v1/completions",
                                      completion_body(model, n, max_tokens), timeout=timeout)
    seconds = time.monotonic() - t0
    assert status == 200, f"calibration request failed: {status} {str(body)[:300]}"
    tokens = body["usage"]["completion_tokens"]
    assert tokens == n * max_tokens, body["usage"]
    return Rate(tokens, seconds)


class Sizing(NamedTuple):
    n_seqs: int  # sequences per request
    request_s: float  # one request of that shape, timed on this server
    tries: list[tuple[int, float]]  # (n, seconds) of every timing


def size_for_budget(base_url: str, model: str, budget_s: float, threads: int, margin: float,
                    max_tokens: int, n_start: int, n_min: int) -> Sizing:
    """The largest n (from n_start, halving, at least n_min) whose request, timed here, fits
    `threads x seconds x margin <= budget_s`. AssertionError when even n_min does not: the
    machine is too slow for this budget (say so, never cut the margin)."""
    tries: list[tuple[int, float]] = []
    n = n_start
    while True:
        seconds = measure_rate(base_url, model, n, max_tokens).seconds
        tries.append((n, seconds))
        if threads * seconds * margin <= budget_s:
            return Sizing(n, seconds, tries)
        assert n > n_min, (f"one request of {n} x {max_tokens} tokens took {seconds:.1f} s: "
                           f"{threads} of them do not fit {budget_s:g} s of drain with a "
                           f"margin of {margin:g} (timings {tries})")
        n = max(n_min, n // 2)


class Sent(NamedTuple):
    t_submit: float
    t_end: float
    status: int  # -1: no HTTP answer
    body: object


class Feeder:
    """`threads` threads sending one request of n x max_tokens after another until `done()`
    (checked before each request) says to stop, or stop() is called."""

    def __init__(self, base_url: str, model: str, n: int, max_tokens: int, threads: int,
                 done: Callable[[], bool], timeout: float) -> None:
        self.url = base_url + "/v1/completions"
        self.body = completion_body(model, n, max_tokens)
        self.done = done
        self.timeout = timeout
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._feed, daemon=True)
                         for _ in range(threads)]

    def start(self) -> Feeder:
        for t in self._threads:
            t.start()
        return self

    def _feed(self) -> None:
        while not self._stop.is_set() and not self.done():
            t0 = time.monotonic()
            try:
                status, data = realvllm.http_json(self.url, self.body, timeout=self.timeout)
            except Exception as e:  # refused once the server is gone: recorded, then stop
                status, data = -1, repr(e)
            with self._lock:
                self.sent.append(Sent(t0, time.monotonic(), status, data))
            if status != 200:
                return

    def hold(self) -> None:
        """Send no more from now on; the requests in flight go on (stop() waits for them)."""
        self._stop.set()

    def stop(self, timeout: float) -> bool:
        """Send no more; wait for the requests in flight. False if some still run."""
        self.hold()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def tokens_of(body: object) -> int:
    """completion tokens of a completion's answer (0: none, or not a completion)."""
    if isinstance(body, dict) and isinstance(body.get("usage"), dict):
        return int(body["usage"].get("completion_tokens") or 0)
    return 0


def finish_reasons(body: object) -> list[str | None]:
    """Each choice's finish_reason, as vLLM reported it ("length": all max_tokens generated)."""
    if isinstance(body, dict) and isinstance(body.get("choices"), list):
        return [c.get("finish_reason") for c in body["choices"] if isinstance(c, dict)]
    return []
