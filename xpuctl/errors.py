"""Exit codes and the errors that carry them: the one place where failures become numbers.

Exit codes (stable, documented in the README):
  0  OK: nothing wrong (doctor clean or busy, shutdown stopped and released)
  1  PROBLEMS: doctor found failing findings, leftovers remain, or a wait timed out
  2  USAGE: bad arguments, unknown device, unusable state directory
  3  NOT_FOUND: a named server, pid or port matches nothing
  4  NOT_READY: serve gave up waiting for readiness (the tree was stopped)
  5  LOCKED: a device is already claimed by another xpuctl run
  6  RAY: Ray could not be asked (no Python with ray, an unreachable address, a missing or
     rejected token, or a Ray call past its deadline)
  130 INTERRUPTED: Ctrl-C
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    PROBLEMS = 1
    USAGE = 2
    NOT_FOUND = 3
    NOT_READY = 4
    LOCKED = 5
    RAY = 6
    INTERRUPTED = 130


class XpuctlError(Exception):
    """An error with a one-line message for the user and an exit code."""

    exit_code: ExitCode = ExitCode.PROBLEMS

    def __init__(self, message: str, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(XpuctlError):
    exit_code = ExitCode.USAGE


class NotFoundError(XpuctlError):
    exit_code = ExitCode.NOT_FOUND


class LockedError(XpuctlError):
    exit_code = ExitCode.LOCKED


class RayError(XpuctlError):
    """Ray could not be asked; the message carries the fix."""

    exit_code = ExitCode.RAY
