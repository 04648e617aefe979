"""Only vLLM's own lines are evidence, against real vLLM (CPU build; issue 36 §2 and §10):
with `--enable-log-requests`, vLLM 0.32 logs each request's sampling parameters at INFO
(vllm/entrypoints/serve/utils/request_logger.py:66, `Received request %s: params: %s,
lora_request: %s.`), the client's stop strings inside. A client whose stop strings read like
vLLM's engine-death lines must leave the run ready and untouched under `xpuctl serve`'s watch
(short intervals: `--health-interval 1 --unhealthy-after 3 --stall-after 4`), and the stop
that follows is the one asked for (exit 0).
"""

from __future__ import annotations

import time

import pytest

from . import realvllm

pytestmark = pytest.mark.vllm

WATCH = ("--health-interval", "1", "--unhealthy-after", "3", "--stall-after", "4", "--force")
READY_S = 600
#: vLLM's own death lines (parse/enginedeath.py), as a client's stop strings
STOPS = ["EngineDeadError",
         "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
         "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup"]


def test_a_hostile_stop_string_with_request_logging_keeps_the_server(xpuctl_foreground):
    run = xpuctl_foreground(opts=WATCH, vllm_args=("--enable-log-requests",))
    run.wait_fg_ready(READY_S)
    body = {"model": str(run.model), "prompt": "Hello", "max_tokens": 8, "stop": STOPS}
    status, answer = realvllm.http_json(run.base_url + "/v1/completions", body, timeout=120)
    assert status == 200, answer
    # vLLM logged the client's stop strings (so the test can fail)
    end = time.monotonic() + 30
    while time.monotonic() < end and "EngineDeadError" not in run.log_text():
        time.sleep(0.2)
    logged = [line for line in run.log_text().splitlines() if "EngineDeadError" in line]
    assert logged and all("request_logger.py" in line for line in logged), logged
    time.sleep(6)  # past --unhealthy-after and --stall-after, a check every second
    assert run.fg.poll() is None, f"{run.fg_stderr()[-3000:]}\n--- log\n{run.log_tail()}"
    rec = run.record()
    assert rec["state"] == "ready" and rec["health"]["state"] == "healthy", rec
    health = run.xpuctl("health", run.name, "--json", "--state-dir", run.state_dir)
    assert health.rc == 0, health.describe()
    assert realvllm.http_json(run.base_url + "/health")[0] == 200
    stop = run.xpuctl("shutdown", run.name, "--state-dir", run.state_dir, timeout=120)
    assert stop.rc == 0, stop.describe()
    assert run.fg.wait(120) == 0, run.fg_stderr()[-3000:]
    assert "EngineDeadError" not in (run.record().get("reason") or "")
