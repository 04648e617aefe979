"""`xpuctl snapshot`: capture what doctor reads into an archive for support."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from xpuctl.cli.context import app_context
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import ProbeTimeoutOpt, StateDirOpt, deep_options
from xpuctl.errors import UsageError
from xpuctl.output.safetext import emit, safe

app = command_app()


@app.command()
@guard
def snapshot(
    ctx: typer.Context,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="FILE", help="Archive to write ('-': stdout).",
                     show_default="./xpuctl-snapshot-HOST-TIME.tar.gz"),
    ] = None,
    state_dir: StateDirOpt = None,
    deep: Annotated[bool, typer.Option("--deep", help="Run doctor --deep and keep the probes' "
                                       "results (probes.json); --from replays them.")] = False,
    probe_timeout: ProbeTimeoutOpt = 10.0,
) -> None:
    """Capture what doctor reads into a .tar.gz for support.

    Read it anywhere with `xpuctl doctor --from FILE` (also ps and devices). Process
    environments keep only XPUCTL_*, ZE_*, ONEAPI_*, SYCL_*, CCL_*, VLLM_* and SPT_NOENV;
    /dev/shm and /tmp are listed, never copied.

    Exit 0: written. 2: cannot write.
    """
    from xpuctl.archive.capture import take

    a = app_context(ctx)
    if output == "-" and a.stdout_tty:  # as gzip does: binary bytes would garble a terminal
        raise UsageError("refusing to write the archive to a terminal: redirect stdout or use -o FILE")
    from xpuctl.state.statedir import resolve_state_dir

    sdir = resolve_state_dir(a.host, state_dir, a.environ)
    deep_opts = deep_options(probe_timeout, "1GiB", sdir) if deep else None
    taken = take(a.host, output, a.environ, sdir, deep_opts)
    shown = "stdout" if taken.path == "-" else taken.path
    emit(sys.stderr,
         f"xpuctl: wrote {safe(shown)} ({taken.size_bytes / 1024:.0f} KiB, {taken.processes} "
         f"processes, {taken.unreadable} unreadable) in {taken.seconds:.2f}s")
    from xpuctl.output.lines import blocked_lines

    for line in blocked_lines(taken.report.scan):
        emit(sys.stderr, f"xpuctl: warning: {line}")
    if taken.path != "-":
        emit(sys.stderr, f"xpuctl: read it with: xpuctl doctor --from {safe(taken.path)}")
