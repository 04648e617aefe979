"""The stop budget: the shutdown timeout serve gives vLLM, and the longest a stop can take."""

from __future__ import annotations

import math

MIN_SHUTDOWN_TIMEOUT = 5
#: vLLM's executor, once its wait for the workers (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) is
#: over, SIGTERMs them and waits this long before its SIGKILL (vLLM 0.32
#: v1/executor/multiproc_executor.py)
VLLM_SIGTERM_GRACE = 4
#: seconds of the teardown budget left to EngineCore after its workers are gone
WORKER_MARGIN = 1
WORKER_TIMEOUT_VAR = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
#: seconds serve may take to notice a signal (its loop polls; a readiness probe waits 0.3 s)
NOTICE_SECONDS = 2.0


def vllm_shutdown_timeout(drain_timeout: float, teardown_timeout: float) -> int:
    """The `--shutdown-timeout` serve passes: drain plus teardown in whole seconds, rounded
    up (never less than what was asked), at least MIN_SHUTDOWN_TIMEOUT."""
    return max(MIN_SHUTDOWN_TIMEOUT, math.ceil(drain_timeout + teardown_timeout))


def worker_shutdown_timeout(teardown_timeout: float) -> int:
    """VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for a teardown budget: how long vLLM's executor
    (and its core client, for EngineCore) waits for the workers to exit by themselves.

    After that wait vLLM SIGTERMs them, waits VLLM_SIGTERM_GRACE (4 s) and SIGKILLs: the wait,
    those 4 s and a second for EngineCore itself fit in the teardown budget, so vLLM's own
    ladder ends inside it: max(1, floor(teardown - 4 - 1)); whole seconds (vLLM reads an
    int). The default 20 s budget gives 15 (vLLM's own default is 5)."""
    return max(1, math.floor(teardown_timeout - VLLM_SIGTERM_GRACE - WORKER_MARGIN))


def worst_stop_seconds(drain_timeout: float, teardown_timeout: float, kill_after: float) -> float:
    """The longest a foreground serve can take from a SIGTERM to its own exit.

    What a supervisor's stop timeout (systemd `TimeoutStopSec`, Kubernetes
    `terminationGracePeriodSeconds`) must exceed, or it SIGKILLs vLLM in the middle of the
    Level Zero/oneCCL teardown this whole tool exists to protect. The steps of
    `RunSupervisor.stop_tree` -> `ladder.stop`: notice the signal; wait for the tree up to
    vLLM's shutdown timeout + the drain margin; SIGTERM survivors and wait `kill_after`;
    SIGKILL and wait; wait up to the teardown timeout for the devices and port to be released.
    """
    from xpuctl.shutdown.ladder import DRAIN_MARGIN, KILL_WAIT

    vllm_deadline = vllm_shutdown_timeout(drain_timeout, teardown_timeout)
    return NOTICE_SECONDS + vllm_deadline + DRAIN_MARGIN + kill_after + KILL_WAIT + teardown_timeout
