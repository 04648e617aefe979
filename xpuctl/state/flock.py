"""flock() within a time bound: a lock held by others for microseconds is waited for; one
held by a stopped or stuck process is given up on instead of hanging the command."""

from __future__ import annotations

import errno
import fcntl
import time


def flock_within(fd: int, how: int, wait: float) -> bool:
    """flock(fd, how) without blocking for more than `wait` seconds. True when taken."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
