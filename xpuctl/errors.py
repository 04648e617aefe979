"""Exit codes and the errors that carry them: the one place where failures become numbers.

Every exit code is a member of `ExitCode`, with its one-line meaning in `MEANINGS`: the
README's table, docs/serve-exits.md and the `xpuctl --help` epilog are that table (a test
holds the README's equal to it; the epilog is made from it).
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
    UNHEALTHY = 7
    INTERNAL = 70
    INTERRUPTED = 130


#: What each code means, in one line (the README's exit-code table and `xpuctl --help`).
MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "OK: doctor found nothing failing; a stop that was asked for (shutdown, a "
                 "signal to serve) released the GPU, even after a SIGKILL or during start-up; "
                 "health: the run is healthy",
    ExitCode.PROBLEMS: "problems: failing findings, leftovers after a stop, a refused "
                       "preflight, vLLM exiting when nobody asked (its own exit, or a signal "
                       "from outside the run); health: unhealthy, stalled, ended or not checked",
    ExitCode.USAGE: "usage error: a bad option or value, an unknown device, an unsafe state "
                    "directory",
    ExitCode.NOT_FOUND: "not found: no run, pid or port of that name",
    ExitCode.NOT_READY: "serve: not ready before --ready-timeout (diagnosed, then stopped)",
    ExitCode.LOCKED: "serve: a device, the port or the run name is claimed by another run",
    ExitCode.RAY: "Ray could not be asked (no Python with ray, an unreachable address, a "
                  "rejected token, no answer in time)",
    ExitCode.UNHEALTHY: "serve: the run was unhealthy or stalled (its watch), so it was "
                        "stopped and the GPU's release proven",
    ExitCode.INTERNAL: "internal error (one line; --debug for the traceback)",
    ExitCode.INTERRUPTED: "interrupted: Ctrl-C",
}


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
