"""`xpuctl health NAME`: whether a run is healthy, from its record alone (for liveness probes)."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from xpuctl.cli.context import app_context
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import JsonOpt, StateDirOpt, complete_run
from xpuctl.errors import ExitCode, NotFoundError

app = command_app()


@app.command()
@guard
def health(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Run name (see `xpuctl ps`).",
                                        autocompletion=complete_run)],
    as_json: JsonOpt = False,
    state_dir: StateDirOpt = None,
) -> None:
    """Whether a run is healthy, as its supervisor's watch last found it (for liveness probes).

    Reads the run's record only (no scan of /proc: cheap enough for a Kubernetes exec probe
    every few seconds). Healthy: the watch said healthy or sleeping (vLLM's sleep mode: alive
    and as asked), or the run is still starting (its readiness deadline bounds that), no more
    than three --health-interval ago.

    Exit 0 healthy, sleeping or starting; 1 unhealthy, stalled, stopping, stopped or failed, or not
    checked for more than three intervals (a hung supervisor proves nothing); 3 no run of
    that name.
    """
    from xpuctl.core.watch import judge
    from xpuctl.output.safetext import emit, safe
    from xpuctl.state import runs
    from xpuctl.state.statedir import resolve_state_dir

    a = app_context(ctx)
    sdir = resolve_state_dir(a.host, state_dir, a.environ)
    if sdir is None:
        raise NotFoundError(f"no run named {name!r}: under --root only the runs of a named "
                            "state directory (--state-dir) are read")
    _, rec = runs.find_record(sdir, name)
    now = time.time()
    seen = judge(rec.state, rec.health, now, rec.reason)
    if as_json:
        from xpuctl.output.documents import health_document, to_json

        sys.stdout.write(to_json(health_document(rec.name, rec.state, rec.health, seen, now)) + "\n")
    else:
        emit(sys.stdout, f"{safe(rec.name)}: {safe(seen.detail, 600)}")
    raise typer.Exit(int(ExitCode.OK if seen.healthy else ExitCode.PROBLEMS))
