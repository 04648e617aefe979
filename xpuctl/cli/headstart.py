"""A head start for `xpuctl doctor`: its pass over /proc begins before the command line is
parsed, on speculation.

Most of doctor's time is one pass over every process's open files, and most of the rest is
start-up: importing typer and the command, parsing. On a machine with a second core they
need not wait for each other. This module knows no option: the command line is parsed once,
by click, from the command definitions.

- `begin`, before typer is imported: when the command line may be doctor's (the word
  `doctor` is in it), start a reader and post it the pass for the root and read bound of the
  environment (XPUCTL_ROOT and XPUCTL_READ_TIMEOUT, else / and the default bound).
- After click has parsed, the command that runs decides from its parsed parameters: doctor
  `claim`s the pass for the Host it scans when a scan of that host is its first act, and
  `end`s it otherwise (--from, --ray, --collective, --deep); any other command ends it as it
  starts (`for_command`, from the group's callback).
- A pass that cannot serve the Host the command scans (another bound, another /proc, or a
  root whose files the pass did not keep: `processes.pass_serves`) is ended at claim.

Ending kills the reader at once (`Reader.close` of a reader with posted work), and its split
helper stops at its next chunk (host/split.py): what was spent is what ran until then. A
head start nobody decided on (help, a usage error) is killed at exit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from xpuctl.host.reads.caller import Reader
    from xpuctl.host.seam import Host

#: The command that gets a head start: the only word of the command line read here.
COMMAND = "doctor"

#: (the root the pass was posted for, as a Host's root: "" for /; its reader). A plain
#: tuple: this runs before the fork that starts the reader, where every millisecond counts.
_early: tuple[str, Reader] | None = None


def plan(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[str, float] | None:
    """(root, read bound) of the head start for this command line: when it may be doctor's,
    the environment's (the group's own defaults when it says nothing); else None."""
    if COMMAND not in argv or environ.get("_XPUCTL_COMPLETE"):
        return None
    from xpuctl.host.reads.protocol import DEFAULT_BOUND  # the group's too
    from xpuctl.parse.seconds import READ_BOUND_SPAN, parse_seconds

    root = environ.get("XPUCTL_ROOT") or "/"
    bound = environ.get("XPUCTL_READ_TIMEOUT")
    try:
        seconds = DEFAULT_BOUND if bound is None else parse_seconds(bound, READ_BOUND_SPAN)
    except ValueError:
        return None  # the group refuses it
    if not os.path.isdir(root):
        return None  # the group refuses it
    return root, seconds


def begin(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Start the pass when `plan` says this command line may be one to start it for."""
    global _early  # noqa: PLW0603 (the one head start of this process)
    planned = plan(argv, environ)
    if planned is None:
        return
    from xpuctl.host.ahead import start_pass
    from xpuctl.host.reads.caller import Reader

    root, bound = planned
    reader = Reader(bound)
    try:
        start_pass(reader, root)
    except OSError:
        return  # no reader now (fork refused): the scan starts one when it reads
    absolute = os.path.abspath(root)
    _early = ("" if absolute == "/" else absolute.rstrip("/"), reader)


def end() -> None:
    """End the head start, if any: its reader is killed now."""
    global _early
    early, _early = _early, None
    if early is not None:
        early[1].close()


def for_command(name: str | None) -> None:
    """The group runs command `name`: a head start is kept only for doctor, which decides."""
    if name != COMMAND:
        end()


def claim(host: Host) -> Host:
    """The Host to scan `host` with: one that reads through the head start's reader, whose
    pass its first scan takes, when that pass can serve it (same read bound, same /proc, its
    root's fds kept); else `host`, and the head start is ended."""
    global _early
    early, _early = _early, None
    if early is None:
        return host
    from xpuctl.host.processes import pass_serves
    from xpuctl.host.seam import Host

    made_for, early_reader = early
    reader = host.reader
    if (type(host) is Host and reader is not None and reader.pid is None
            and reader.bound == early_reader.bound and pass_serves(made_for, host)):
        return Host(host.origin, reads=early_reader)
    early_reader.close()
    return host
