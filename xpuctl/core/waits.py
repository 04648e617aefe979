"""What a flow is waiting for, and until when: the record a live countdown is drawn from.

A flow that waits (the stop ladder's drain, teardown, escalation and release; the collective
check) tells its caller through a callback each time what it waits for changes: a `Wait`
when a wait begins or its count moves, None when nothing is awaited any more. The caller
draws it (output/progress.py: a countdown redrawn in place on a terminal, one plain line per
phase elsewhere); the time left is the deadline against the same monotonic clock.
"""

from __future__ import annotations

from typing import NamedTuple

#: the phases, in the order a stop goes through them; `collective` and `collective-alone`
#: (every device run alone after a group that hung or failed) are the collective check's
DRAIN, TEARDOWN, ESCALATION, KILL, SUPERVISORS, RELEASE = (
    "drain", "teardown", "escalation", "kill", "supervisors", "release")
COLLECTIVE, COLLECTIVE_ALONE = "collective", "collective-alone"


class Wait(NamedTuple):
    """One wait: its phase, what it is about, and what is still awaited."""

    phase: str
    subject: str  # the servers' names (a stop), the devices (the collective check)
    deadline: float  # time.monotonic() when the wait gives up
    processes: int | None = None  # processes still to exit (a stop)
    requests: int | None = None  # requests running or waiting (a drain, from /metrics)
    step: str | None = None  # the collective check's slowest rank's phase (init, all_reduce)

    def left(self, now: float) -> float:
        """Seconds left until the deadline (never below 0)."""
        return max(0.0, self.deadline - now)
