"""`xpuctl shutdown`: drain and stop a vLLM server, escalate, verify the GPU is released."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from xpuctl.cli.context import app_context, own_age_seconds
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import (
    DeviceOpt,
    JsonOpt,
    KillAfterOpt,
    StateDirOpt,
    complete_run,
    port_option,
)
from xpuctl.errors import ExitCode, UsageError
from xpuctl.output.safetext import emit, safe

app = command_app()


@app.command()
@guard
def shutdown(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Run name (see `xpuctl ps`).", show_default=False, autocompletion=complete_run)] = None,
    pid: Annotated[int | None, typer.Option("--pid", help="Any process of the vLLM server (or of its orphans).", show_default=False)] = None,
    port: Annotated[int | None, port_option("The server's HTTP port.")] = None,
    device: DeviceOpt = None,
    all_: Annotated[bool, typer.Option("--all", help="Every vLLM server and orphan on this host.")] = False,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", min=0, help="Seconds to wait after SIGTERM.",
                     show_default="the run's shutdown timeout + 10"),
    ] = None,
    kill_after: KillAfterOpt = 10.0,
    release_timeout: Annotated[float, typer.Option("--release-timeout", min=0, help="Seconds to wait for the devices and port to be free.")] = 30.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be stopped; send nothing.")] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Drain and stop a vLLM server, escalate step by step, verify the GPU is released.

    Exit 0: stopped and released (escalation is reported, not an error). 1: leftovers
    remain. 3: NAME, --pid or --port matches nothing. --all with nothing running exits 0.
    """
    from xpuctl.actions.signals import can_signal
    from xpuctl.output import documents, lines
    from xpuctl.shutdown import ladder, plan
    from xpuctl.state import audit

    a = app_context(ctx)
    if name is None and pid is None and port is None and not device and not all_:
        raise UsageError("say which server to stop: NAME, --pid, --port, --device or --all")
    if not can_signal(a.host) and not dry_run:
        raise UsageError("shutdown needs the live /proc (a root whose proc is the real /proc)")
    from xpuctl.state.statedir import resolve_state_dir

    sdir = resolve_state_dir(a.host, state_dir, a.environ)
    trees = plan.find_targets(a.host, sdir, name, pid, port, list(device or []), all_, a.environ)
    if dry_run or not trees:
        targets = documents.shutdown_target_dicts(trees, plan.planned_members(a.host, trees))
        skipped = ladder.skipped_lines(a.host)
        if as_json:
            sys.stdout.write(documents.to_json(documents.shutdown_plan_document(targets, dry_run, skipped)) + "\n")
        else:
            for line in lines.shutdown_plan_lines(targets):
                emit(sys.stdout, line)
            for line in skipped:
                emit(sys.stdout, f"skipped: {safe(line)}")
        raise typer.Exit(ExitCode.OK)
    plan.mark_records(sdir, trees, state="stopping")
    # From our own start to the first signal: start-up plus finding the trees. On the
    # critical path of every restart, and the first thing to look at when a drain began late.
    resolve_s = own_age_seconds()
    if not as_json and resolve_s is not None:
        emit(sys.stdout, f"found {len(trees)} server tree(s) {resolve_s:.2f}s after start")
    with audit.recording(sdir, "shutdown") as log:
        result = ladder.stop(a.host, trees, timeout=timeout, kill_after=kill_after, release_timeout=release_timeout,
                             on_event=None if as_json else lambda ev: emit(sys.stdout, lines.event_line(ev)))
    warning = lines.audit_warning(log)
    if warning:
        emit(sys.stderr, warning)
    plan.mark_records(sdir, trees, state="stopped" if result.verdict != "leftovers" else "failed")
    if as_json:
        targets = documents.shutdown_target_dicts(trees, result.members)
        sys.stdout.write(documents.to_json(documents.shutdown_document(targets, result, resolve_s, log.summary())) + "\n")
    raise typer.Exit(ExitCode.PROBLEMS if result.verdict == "leftovers" else ExitCode.OK)
