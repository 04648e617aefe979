"""A head start for `xpuctl doctor`: its pass over /proc begins before the command line is
parsed.

Most of doctor's time is one pass over every process's open files, and most of the rest is
start-up: importing typer and the command, parsing. On a machine with a second core they
need not wait for each other. `begin` reads just enough of the arguments to know that this
run is a doctor that scans this host before anything else (no `--from`, `--deep`,
`--collective`, no help), starts the reader that run's Host will read through, and posts
the pass to it (`host.ahead`). The group's callback builds its Host on that reader
(`claim`), and the scan takes the pass. Anything this reading does not understand means no
head start: the command then runs exactly as it would without one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xpuctl.host.reads.caller import Reader

#: The group's options this reading knows (with a value, or a flag); any other means no head
#: start (`--version`, `--help`, a typo: click will say).
_VALUED = ("--root", "--read-timeout")
_FLAGS = ("--debug",)
#: doctor's options after which its first scan is not the run's first action on the host
#: (probes or ranks start first: `--deep`, `--collective`) or not of this host (`--from`),
#: or that print help: no head start. A test keeps every doctor option named here or in
#: SCANS_FIRST.
NOT_FIRST = ("--from", "--deep", "--collective", "--help", "-h")
#: doctor's options that leave its first scan the first thing it does.
SCANS_FIRST = (
    "--device", "-d", "--port", "-p", "--expect-idle", "--strict", "--wait-clean", "--format", "-f",
    "--json", "--textfile", "--unattributed-threshold", "--probe-timeout", "--state-dir",
    "--collective-timeout", "--ray",
)
#: The command that gets a head start.
COMMAND = "doctor"

_early: tuple[str, Reader] | None = None


def plan(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[str, float] | None:
    """(root, read bound) of the Host the group's callback will build, when this command
    line is a doctor that scans this host first; else None."""
    if environ.get("_XPUCTL_COMPLETE"):
        return None
    root = environ.get("XPUCTL_ROOT") or None
    bound = environ.get("XPUCTL_READ_TIMEOUT")
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in _VALUED:
            if not eq:
                i += 1
                if i == len(argv):
                    return None
                value = argv[i]
            if name == "--root":
                root = value
            else:
                bound = value
        elif name not in _FLAGS or eq:
            return None
        i += 1
    if i == len(argv) or argv[i] != COMMAND:
        return None
    for arg in argv[i + 1:]:
        if arg == "--":
            break
        if arg.partition("=")[0] in NOT_FIRST:
            return None
    from xpuctl.host.reads.protocol import DEFAULT_BOUND  # the group's too
    from xpuctl.parse.seconds import READ_BOUND_SPAN, parse_seconds

    try:
        seconds = DEFAULT_BOUND if bound is None else parse_seconds(bound, READ_BOUND_SPAN)
    except ValueError:
        return None  # the group refuses it
    if root is not None and not os.path.isdir(root):
        return None  # the callback refuses it
    return root or "/", seconds


def begin(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Start the pass when `plan` says this run is one to start it for."""
    global _early  # noqa: PLW0603 (the one head start of this process)
    planned = plan(argv, environ)
    if planned is None:
        return
    from xpuctl.host.ahead import start_pass
    from xpuctl.host.reads.caller import Reader

    reader = Reader(planned[1])
    try:
        start_pass(reader, planned[0])
    except OSError:
        return  # no reader now (fork refused): the scan starts one when it reads
    _early = (os.path.abspath(planned[0]), reader)


def claim(root: str, read_timeout: float) -> Reader | None:
    """The reader `begin` started, once, when it is the one a Host for this root and bound
    would have; else None (and a head start that does not match is ended)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    at, reader = early
    if at == os.path.abspath(root) and reader.bound == float(read_timeout):
        return reader
    reader.close()
    return None
