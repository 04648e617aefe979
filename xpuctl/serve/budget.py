"""The stop budget: the shutdown timeout serve gives vLLM, and the longest a stop can take."""

from __future__ import annotations

import math

MIN_SHUTDOWN_TIMEOUT = 5
#: seconds serve may take to notice a signal (its loop polls; a readiness probe waits 0.3 s)
NOTICE_SECONDS = 2.0


def vllm_shutdown_timeout(drain_timeout: float, teardown_timeout: float) -> int:
    """The `--shutdown-timeout` serve passes: drain plus teardown in whole seconds, rounded
    up (never less than what was asked), at least MIN_SHUTDOWN_TIMEOUT."""
    return max(MIN_SHUTDOWN_TIMEOUT, math.ceil(drain_timeout + teardown_timeout))


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
