"""Pause points for the fault tests (tests/test_fault_kills.py), and for nothing else.

`reached(step)` returns at once unless the environment variable XPUCTL_TEST_PAUSE_AT names
`step` (or `step:N`, its N-th time in this process) **and** the test armed it. Then it
appends `STEP PID` to the file XPUCTL_TEST_PAUSE_FILE and sleeps until it is killed: the
test SIGKILLs xpuctl exactly there, a step it chose, without racing it.

Armed means, all of: XPUCTL_TEST_PAUSE_FILE is an absolute path; beside it,
`<that path>.arm` is a regular file (not a link) owned by this process's user, mode 0600,
whose content is the value of XPUCTL_TEST_PAUSE_KEY, a secret of at least 16 characters
that the test made for this one run (`pause_env` in tests/support/proctools.py). A production
environment that carries XPUCTL_TEST_PAUSE_AT (copied from a test's shell, set by mistake in
root's profile) meets none of that by accident, so a real reset never sleeps there. The
cost when unset is one environment lookup per step; the arming is read only at a step the
variable names. No other module reads these variables.

The steps: `reset-execute` (plan shown and confirmed, nothing done), `signal-sent` (just
after a signal), `reset-removing` (signals done, no file deleted yet), `file-removed` (just
after a deletion and its audit line), `shutdown-found` (the trees found, nothing
signalled), `record-rename` (a file of the state directory written and fsynced, not yet
renamed over the old one), `audit-locked` (an audit line about to be written, its lock
held).
"""

from __future__ import annotations

import os
import stat
import time

KEY_MIN = 16  # characters of the per-run secret
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
    marker = os.environ.get("XPUCTL_TEST_PAUSE_FILE", "")
    if not armed(marker, os.environ.get("XPUCTL_TEST_PAUSE_KEY", "")):
        return
    _say(marker, f"{want} {os.getpid()}\n")
    while True:
        time.sleep(3600)


def armed(marker: str, key: str) -> bool:
    """Did a test arm the pause (see the module's docstring)?"""
    if not marker or not os.path.isabs(marker) or len(key) < KEY_MIN:
        return False
    try:
        fd = os.open(f"{marker}.arm", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) != 0o600):
            return False
        return os.read(fd, 4096).decode(errors="replace") == key
    except OSError:
        return False
    finally:
        os.close(fd)


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
