"""`xpuctl ps`: xpuctl's runs and the vLLM process trees on this host."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from xpuctl.cli.context import app_context, open_source
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import DeviceOpt, Format, FromOpt, JsonOpt, RayOpt, StateDirOpt, on_cluster
from xpuctl.errors import UsageError

app = command_app()


@app.command()
@guard
def ps(
    ctx: typer.Context,
    device: DeviceOpt = None,
    show_all: Annotated[bool, typer.Option("--all", "-a", help="Also list non-vLLM processes holding a device.")] = False,
    as_json: JsonOpt = False,
    from_: FromOpt = None,
    state_dir: StateDirOpt = None,
    ray: RayOpt = None,
) -> None:
    """xpuctl's runs and the vLLM process trees on this host.

    Runs: name, state (starting, ready, stopping; stale: the record says one of those but
    the run is gone), age, pid, port, devices, health (serve's watch, as `xpuctl health`
    judges it); a record that could not be read is named on stderr. Processes: role, state,
    devices, memory, orphan, run.
    """
    from xpuctl.listing import list_processes
    from xpuctl.state.statedir import resolve_state_dir

    a = app_context(ctx)
    if ray is not None:
        if from_ is not None or device:
            raise UsageError("--ray lists every node of a cluster: drop --from and --device")
        on_cluster(a, "ps", ray, {"all": show_all}, Format.json if as_json else Format.table)
    host, _, _ = open_source(ctx, from_)
    listing = list_processes(host, list(device or []), show_all, resolve_state_dir(host, state_dir, a.environ),
                             a.environ)
    if as_json:
        from xpuctl.output.documents import ps_document, to_json

        sys.stdout.write(to_json(ps_document(listing.runs, listing.processes, listing.scan,
                                             listing.unread)) + "\n")
        return
    from xpuctl.output.lines import blocked_lines
    from xpuctl.output.safetext import emit, safe

    for line in blocked_lines(listing.scan):  # stderr: the table stays what it was
        emit(sys.stderr, f"xpuctl: warning: {line}")
    for u in listing.unread:
        emit(sys.stderr, f"xpuctl: warning: {safe(u.line())}")

    if listing.runs:
        from xpuctl.output.tables import runs_table

        a.out.print(runs_table(listing.runs), no_wrap=True, crop=True)
    if not listing.processes:
        emit(sys.stdout, "no vLLM processes")
        return
    from xpuctl.output.tables import processes_table

    a.out.print(processes_table(listing.scan, "vLLM processes", a.out.width), no_wrap=True, crop=True)
