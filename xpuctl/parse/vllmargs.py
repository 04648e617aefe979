"""vLLM's command-line arguments, read and edited (lists of strings in, data out).

serve edits the arguments it passes on (`strip_flag`, `merge_shared`); shutdown and serve read
the port, bind address and shutdown timeout back from a server's argv. Pure: fuzzed with
hypothesis in tests/test_parse_fuzz.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from xpuctl.errors import UsageError

_TIMEOUT_ARG = re.compile(r"^--shutdown[-_]timeout(?:=(\d+))?$")


def strip_flag(args: Sequence[str], flag: str) -> tuple[list[str], str | None, bool]:
    """Remove `flag N`/`flag=N` (also the _ spelling) from args: (rest, value, found)."""
    names = {flag, flag.replace("-", "_").replace("__", "--")}
    rest: list[str] = []
    value = None
    found = False
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, val = arg.partition("=")
        if key in names:
            found = True
            if eq:
                value = val
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            i += 1
            continue
        rest.append(arg)
        i += 1
    return rest, value, found


def merge_shared(args: list[str], flag: str, before: str | None) -> list[str]:
    """vLLM's args with `flag` given before MODEL passed on exactly once.

    Given after MODEL only: kept as it is. Before only: put first after MODEL. Both: one
    value (the caller's spelling after MODEL stays), or a usage error when they differ."""
    if before is None:
        return args
    _, after, found = strip_flag(args, flag)
    if not found:
        return [flag, before, *args]
    same = after == before or (_digits(after or "") and _digits(before) and int(after or 0) == int(before))
    if not same:
        raise UsageError(f"{flag} {before} before MODEL and {flag} {after} after it disagree: give it once")
    return args


def shutdown_timeout_from_argv(argv: Sequence[str]) -> int | None:
    """The first whole-seconds `--shutdown-timeout` (or `--shutdown_timeout`) in argv."""
    for i, arg in enumerate(argv):
        m = _TIMEOUT_ARG.match(arg)
        if not m:
            continue
        value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
        if _digits(value):
            return int(value)
    return None


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²", which int() refuses."""
    return text.isascii() and text.isdigit()


def port_from_argv(argv: Sequence[str]) -> tuple[int | None, str | None]:
    """(port, bind address) from `--port`/`--host` in argv; the last of each wins."""
    port = bind = None
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if arg == "--port" and _digits(nxt):
            port = int(nxt)
        elif arg.startswith("--port=") and _digits(arg[7:]):
            port = int(arg[7:])
        elif arg == "--host" and nxt:
            bind = nxt
        elif arg.startswith("--host="):
            bind = arg[7:]
    return port, bind


_SIZE_FLAGS = {"--tensor-parallel-size": 0, "--tensor_parallel_size": 0, "-tp": 0,
               "--pipeline-parallel-size": 1, "--pipeline_parallel_size": 1, "-pp": 1}


def parallel_sizes(argv: Sequence[str]) -> tuple[int, int]:
    """(tensor-parallel, pipeline-parallel) sizes from vLLM's argv (`--tensor-parallel-size N`,
    `-tp N`, `=N` forms; the pipeline ones alike); 1 where not given or not whole numbers. The
    last of each wins, as with argparse."""
    sizes = [1, 1]
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        which = _SIZE_FLAGS.get(key)
        if which is None:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if _digits(value) and 0 < int(value) <= 4096:
            sizes[which] = int(value)
    return sizes[0], sizes[1]
