"""Exit codes and the errors that carry them: the one place where failures become numbers.

Every exit code is a member of `ExitCode`, with its one-line meaning in `MEANINGS`: the
README's table, docs/serve-exits.md and the `xpuctl --help` epilog are that table (tests
hold the README's and docs/serve-exits.md's equal to it; the epilog is made from it).
`exit_code` is the one mapping from what ends a command to its exit status: the command
guard (cli/guard.py) and the process's exit (`xpuctl.cli.leave`) both ask it.
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
    UNKNOWN = 8
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
    ExitCode.UNKNOWN: "doctor --format npd: could not tell (a read did not answer, or an error "
                      "ended the check); node-problem-detector reads it as Unknown",
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


class OutputLost(Exception):
    """What a command wrote can no longer be written: its reader went away (`xpuctl ps |
    head`) or the stream is closed. Not worth a message."""


def exit_code(end: BaseException) -> int:
    """The exit status of a command that ended with `end` (raised, or the SystemExit it
    left with):

    - SystemExit: its code; none is 0, and a text (`sys.exit("text")`, which the
      interpreter prints) is 1, as the interpreter does;
    - an XpuctlError: the code it carries; Ctrl-C: 130;
    - output that cannot be written (a broken pipe, `OutputLost`) and no answer at a
      prompt (end of input): 1;
    - an exit that carries its code (typer.Exit, click's usage errors: 2): that code;
    - anything else is an internal error: 70.
    """
    if isinstance(end, SystemExit):
        if end.code is None:
            return ExitCode.OK
        return end.code if isinstance(end.code, int) else ExitCode.PROBLEMS
    if isinstance(end, XpuctlError):
        return end.exit_code
    if isinstance(end, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(end, (BrokenPipeError, OutputLost, EOFError)):
        return ExitCode.PROBLEMS
    carried = getattr(end, "exit_code", None)
    if isinstance(carried, int) and not isinstance(carried, bool):
        return carried
    return ExitCode.INTERNAL
