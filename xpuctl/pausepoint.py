"""Pause points for the fault tests (tests/test_fault_kills.py), and for nothing else.

`reached(step)` returns at once unless the environment variable XPUCTL_TEST_PAUSE_AT names
`step` (or `step:N`, its N-th time in this process). Then it appends `STEP PID` to the file
XPUCTL_TEST_PAUSE_FILE and sleeps until it is killed: the test SIGKILLs xpuctl exactly there,
a step it chose, without racing it. Never set outside the tests; the cost when unset is one
environment lookup per step. No other module reads these variables.

The steps: `reset-execute` (plan shown and confirmed, nothing done), `signal-sent` (just
after a signal), `reset-removing` (signals done, no file deleted yet), `file-removed` (just
after a deletion), `shutdown-found` (the trees found, nothing signalled), `record-rename` (a
file of the state directory written and fsynced, not yet renamed over the old one),
`audit-locked` (an audit line about to be written, its lock held).
"""

from __future__ import annotations

import os
import time

_counts: dict[str, int] = {}


def reached(step: str) -> None:
    want = os.environ.get("XPUCTL_TEST_PAUSE_AT")
    if not want:
        return
    name, _, nth = want.partition(":")
    if name != step:
        return
    _counts[step] = _counts.get(step, 0) + 1
    if _counts[step] != (int(nth) if nth.isdigit() else 1):
        return
    marker = os.environ.get("XPUCTL_TEST_PAUSE_FILE")
    if marker:
        _say(marker, f"{want} {os.getpid()}\n")
    while True:
        time.sleep(3600)


def _say(marker: str, line: str) -> None:
    """Append `line` to the marker; a new marker appears with its line in it (the test reads
    it as soon as it exists: an empty file there once failed a test on a loaded machine)."""
    whole = f"{marker}.{os.getpid()}"
    with open(whole, "w") as fh:
        fh.write(line)
    try:
        os.link(whole, marker)
    except FileExistsError:
        with open(marker, "a") as fh:
            fh.write(line)
    finally:
        os.unlink(whole)
