"""serve's liveness watch against real vLLM (CPU build), serve in the foreground:

- EngineCore SIGKILLed under a ready server (what an engine reset does to it, vLLM #54553):
  vLLM 0.32's engine monitor logs `[shutdown] MPClient: engine core exited unexpectedly;
  starting cleanup` (v1/engine/core_client.py) and /health answers 503; serve stops the run
  as unhealthy and exits 7;
- EngineCore SIGSTOPped with a request running (a spinning engine, vLLM #54698): /health stays
  200 (AsyncLLM.check_health asks the engine nothing), the running gauge and the token
  counters freeze; serve finds the run stalled, stops it (vLLM's own deadline SIGKILLs the
  stopped EngineCore) and exits 7.

Short intervals (`--health-interval 1 --unhealthy-after 3 --stall-after 4`). `--force`: the
preflight doctor is other tests' business, and another engineer's vLLM on this shared host
must not refuse these. Everything the runs start carries their token and is SIGCONTed, then
SIGKILLed, at teardown, even on failure.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from . import realvllm, workload
from .xpuctl_run import XpuctlRun, in_flight

pytestmark = pytest.mark.vllm

WATCH = ("--health-interval", "1", "--unhealthy-after", "3", "--stall-after", "4", "--force")
READY_S = 600


def _engine(run: XpuctlRun) -> realvllm.ProcInfo:
    parts = run.parts()
    assert len(parts["engine"]) == 1, run.describe_tree()
    return parts["engine"][0]


def test_a_killed_engine_core_is_stopped_as_unhealthy(xpuctl_foreground, vllm_timings, request):
    run = xpuctl_foreground(opts=WATCH)
    run.wait_fg_ready(READY_S)
    engine = _engine(run)
    killed_at = time.time()
    run.note_artifacts()  # what it holds, noted by inode before it is killed (leftovers.py)
    assert realvllm.signal_if_token(engine.pid, run.token, signal.SIGKILL)
    rc = run.fg.wait(300)
    err = run.fg_stderr()
    assert rc == 7, f"rc {rc}\n{err[-3000:]}\n--- log\n{run.log_tail()}"
    rec = run.record()
    assert rec["state"] == "failed", rec
    reason = rec["reason"]
    assert reason.startswith("unhealthy: "), reason
    assert "exited unexpectedly" in reason or "died unexpectedly" in reason, reason
    assert rec["health"]["state"] == "unhealthy"
    gone, _ = run.wait_gone(60)
    assert gone, run.describe_tree()
    vllm_timings[request.node.name] = {
        "kill_to_unhealthy": round(rec["health"]["since"] - killed_at, 2)}


def test_a_stopped_engine_core_with_a_request_running_is_stalled(xpuctl_foreground,
                                                                vllm_timings, request):
    run = xpuctl_foreground(opts=WATCH, drain=5, teardown=5)
    run.wait_fg_ready(READY_S)
    engine = _engine(run)
    model = str(run.model)
    # requests run on any machine until the engine is stopped: two feeders send one request
    # after another (workload.Feeder), and the stop is made again until it lands on one
    # (_stop_while_busy). One long request sized for 12,000 tok/s (1024 x 200) ends in
    # seconds on a faster machine, and an idle server is rightly healthy: serve then waited
    # out the test's 300 s (CI run 3)
    stopping = threading.Event()
    feeder = workload.Feeder(run.base_url, model, 256, 200, 2, stopping.is_set, 300).start()
    time.sleep(1.0)  # a check or two with tokens counted
    run.note_artifacts()  # vLLM's deadline SIGKILLs the stopped engine: noted before
    try:
        stopped_at, misses = _stop_while_busy(run, engine)
        stopping.set()  # send nothing more; the requests in flight die with the server
        rc = run.fg.wait(300)
    finally:
        stopping.set()
        realvllm.signal_if_token(engine.pid, run.token, signal.SIGCONT)
    feeder.stop(5)  # their connections died with the server (daemon threads either way)
    err = run.fg_stderr()
    assert rc == 7, f"rc {rc}\n{err[-3000:]}\n--- log\n{run.log_tail()}"
    rec = run.record()
    assert rec["state"] == "failed" and rec["reason"].startswith("stalled: "), rec["reason"]
    assert "vllm:generation_tokens_total" in rec["reason"]
    gone, _ = run.wait_gone(60)
    assert gone, run.describe_tree()
    vllm_timings[request.node.name] = {
        "stop_to_stalled": round(rec["health"]["since"] - stopped_at, 2),
        "stops_in_a_gap": misses}


def _stop_while_busy(run: XpuctlRun, engine: realvllm.ProcInfo,
                     tries: int = 8) -> tuple[float, int]:
    """SIGSTOP the EngineCore while vLLM's own gauges say a request is in it: when it was
    stopped, and the count of stops that landed between two requests (each SIGCONTed at once,
    then tried again).

    The gauges are the engine's: the API server shows what the engine last published, so
    after the stop they hold still at what the watch will read. Two feeders send request after
    request, but theirs run in one batch and end together: a stop in the gap between them
    froze the gauges at 0 (CI, 2026-12-06: "no request was running at the SIGSTOP"), an idle
    server the watch rightly calls healthy. Read twice after the stop, so that stats the
    engine sent just before it (still in the pipe) have landed."""
    for misses in range(tries):
        end = time.monotonic() + 120
        while time.monotonic() < end and not (in_flight(run.base_url) or 0) > 0:
            time.sleep(0.05)
        assert (in_flight(run.base_url) or 0) > 0, "the request never ran"
        stopped_at = time.time()
        assert realvllm.signal_if_token(engine.pid, run.token, signal.SIGSTOP)
        time.sleep(0.3)
        if (in_flight(run.base_url) or 0) > 0:
            time.sleep(0.3)
            if (in_flight(run.base_url) or 0) > 0:
                return stopped_at, misses
        assert realvllm.signal_if_token(engine.pid, run.token, signal.SIGCONT)
    raise AssertionError(f"every one of {tries} stops landed between two requests")


def test_api_key_becomes_ready_and_stays_untouched(xpuctl_foreground):
    """`--api-key` (issue 36 item 1): vLLM 0.32's entrypoints/serve/middleware/authenticate.py answers 401
    on /v1 without the key and leaves /health and /metrics open; serve probes /v1/models with
    the key as a bearer token: the run becomes ready and its watch leaves it alone. The key
    is in neither serve's own lines nor the record nor the audit log."""
    import json
    import urllib.request

    key = "xpuctl-real-key-" + str(time.monotonic_ns())
    run = xpuctl_foreground(opts=WATCH, vllm_args=("--api-key", key))
    run.wait_fg_ready(READY_S)
    status, _ = realvllm.http_json(run.base_url + "/v1/models")
    assert status == 401, status  # the key guards /v1: the probe needed it
    req = urllib.request.Request(run.base_url + "/v1/models",
                                 headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    first = run.record()["health"]["checked_at"]
    end = time.monotonic() + 120
    while time.monotonic() < end and run.record()["health"]["checked_at"] < first + 5:
        time.sleep(0.2)
    rec = run.record()
    assert rec["health"]["checked_at"] >= first + 5, rec  # five checks (--health-interval 1)
    assert rec["state"] == "ready" and rec["health"]["state"] == "healthy", rec
    assert run.fg.poll() is None, run.fg_stderr()[-3000:]
    run.fg.send_signal(signal.SIGTERM)  # serve is this test's child: a stop asked for
    rc = run.fg.wait(300)
    assert rc == 0, f"rc {rc}\n{run.fg_stderr()[-3000:]}"
    mine = "\n".join(line for line in run.fg_stderr().splitlines() if line.startswith("xpuctl:"))
    audit = run.state_dir / "audit.jsonl"
    for text in (mine, json.dumps(run.record()), audit.read_text() if audit.exists() else ""):
        assert key not in text
    gone, _ = run.wait_gone(60)
    assert gone, run.describe_tree()
