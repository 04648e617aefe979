"""`xpuctl devices`: Intel GPUs and other DRM devices, with holders and memory."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from xpuctl.cli.context import app_context, open_source
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import (
    DeepOpt,
    Format,
    FromOpt,
    JsonOpt,
    ProbeTimeoutOpt,
    RayOpt,
    StateDirOpt,
    deep_options,
    on_cluster,
)
from xpuctl.errors import UsageError

app = command_app()


@app.command()
@guard
def devices(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    deep: DeepOpt = False,
    probe_timeout: ProbeTimeoutOpt = 10.0,
    record_baseline: Annotated[
        bool,
        typer.Option("--record-baseline", help="With --deep: record the used memory of each device "
                     "nothing holds as its idle baseline (doctor --deep subtracts it)."),
    ] = False,
    state_dir: StateDirOpt = None,
    from_: FromOpt = None,
    ray: RayOpt = None,
) -> None:
    """Intel GPUs (Level Zero order) and other DRM devices, with holders and memory."""
    from xpuctl.listing import list_devices

    a = app_context(ctx)
    if ray is not None:
        if from_ is not None or deep or record_baseline:
            raise UsageError("--ray lists every node of a cluster: drop --from, --deep and "
                             "--record-baseline")
        on_cluster(a, "devices", ray, {}, Format.json if as_json else Format.table)
    if from_ is not None and (deep or record_baseline):
        raise UsageError("--deep and --record-baseline ask this host's devices, not a snapshot")
    host, _, replayed = open_source(ctx, from_)
    if record_baseline and not deep:
        raise UsageError("--record-baseline needs --deep (the baseline is what the devices report)")
    from xpuctl.state.statedir import resolve_state_dir

    sdir = resolve_state_dir(a.host, state_dir, a.environ)
    if record_baseline and sdir is None:
        raise UsageError("--record-baseline under --root keeps the baseline of this machine: "
                         "name the state directory (--state-dir)")
    opts = deep_options(probe_timeout, "1GiB", sdir) if deep else None
    scan, recorded = list_devices(host, a.environ, opts, record_baseline, replayed)
    if as_json:
        from xpuctl.output.documents import devices_document, to_json

        sys.stdout.write(to_json(devices_document(scan, recorded)) + "\n")
        return
    from xpuctl.core.units import human_bytes
    from xpuctl.output.lines import blocked_lines
    from xpuctl.output.safetext import emit
    from xpuctl.output.tables import print_devices, probes_line

    for warning in blocked_lines(scan):
        emit(sys.stderr, f"xpuctl: warning: {warning}")

    print_devices(a.out, scan)
    line = probes_line(scan)
    if line:
        a.out.print(line, highlight=False)
    for bdf, n, note in recorded or []:
        a.out.print(f"baseline {bdf}: {human_bytes(n) if n is not None else '-'} ({note})", highlight=False)
