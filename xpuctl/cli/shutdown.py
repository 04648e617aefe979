"""`xpuctl shutdown`: drain and stop a vLLM server, escalate, verify the GPU is released."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from xpuctl.cli.context import app_context, own_age_seconds
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import confirm, guard
from xpuctl.cli.options import (
    DeviceOpt,
    JsonOpt,
    KillAfterOpt,
    StateDirOpt,
    complete_run,
    port_option,
)
from xpuctl.cli.paramtypes import Seconds
from xpuctl.errors import ExitCode
from xpuctl.output.safetext import emit, safe

if TYPE_CHECKING:  # types only: the command's modules load when it runs
    from xpuctl.output.progress import View
    from xpuctl.shutdown.flow import Found, Outcome, Planned
    from xpuctl.shutdown.ladder import Event

app = command_app()

# shutdown's own options, declared once here so the command's signature stays short
NameArg = Annotated[str | None, typer.Argument(help="Run name (see `xpuctl ps`).",
                                               show_default=False, autocompletion=complete_run)]
PidOpt = Annotated[int | None, typer.Option(
    "--pid", help="Any process of the vLLM server (or of its orphans).", show_default=False)]
AllOpt = Annotated[bool, typer.Option("--all", help="Every vLLM server and orphan on this host.")]
TimeoutOpt = Annotated[float | None, typer.Option(
    "--timeout", click_type=Seconds(0), help="Seconds to wait after SIGTERM.",
    show_default="the run's shutdown timeout + 10")]
ReleaseTimeoutOpt = Annotated[float, typer.Option(
    "--release-timeout", click_type=Seconds(0),
    help="Seconds to wait for the devices and port to be free.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run",
                                         help="Show what would be stopped; send nothing.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="--all: do not ask (for scripts).")]


@app.command()
@guard
def shutdown(
    ctx: typer.Context,
    name: NameArg = None,
    pid: PidOpt = None,
    port: Annotated[int | None, port_option("The server's HTTP port.")] = None,
    device: DeviceOpt = None,
    all_: AllOpt = False,
    timeout: TimeoutOpt = None,
    kill_after: KillAfterOpt = 10.0,
    release_timeout: ReleaseTimeoutOpt = 30.0,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Drain and stop a vLLM server, escalate step by step, verify the GPU is released.

    --all shows its plan and asks first, unless --yes.

    Exit 0: stopped and released (escalation is reported, not an error). 1: leftovers
    remain (or --all's question answered no). 2: usage (or --all without --yes and no
    terminal). 3: NAME, --pid or --port matches nothing. --all with nothing running exits 0.
    """
    from xpuctl.output import progress
    from xpuctl.shutdown import flow
    from xpuctl.state.statedir import resolve_state_dir

    a = app_context(ctx)
    age = own_age_seconds()
    request = flow.Request(name, pid, port, tuple(device or []), all_, timeout, kill_after,
                           release_timeout, dry_run,
                           since=time.monotonic() - age if age is not None else None,
                           environ=a.environ)
    flow.check(request, a.host)  # before the state directory is resolved (run checks it too)

    view = progress.countdown(sys.stderr)  # what the stop waits for, on stderr
    try:
        out = flow.run(a.host, request, resolve_state_dir(a.host, state_dir, a.environ),
                       None if as_json else _shower(view),
                       approve=None if yes else _asker(as_json), on_wait=view.wait)
    finally:
        view.finish()
    if out.declined:
        raise typer.Exit(ExitCode.PROBLEMS)  # a "no" at the prompt: nothing was sent
    if out.result is None:
        _print_plan(out, dry_run, as_json)
        raise typer.Exit(ExitCode.OK)
    raise typer.Exit(_report(out, as_json))


def _shower(view: View) -> Callable[[Found | Event], None]:
    """What the stop found and each step of its timeline, above the countdown, on stdout."""
    from xpuctl.output import lines
    from xpuctl.shutdown import flow

    def show(ev: Found | Event) -> None:
        if isinstance(ev, flow.Found):
            if ev.resolve_s is not None:
                view.above(sys.stdout, lines.found_line(ev.trees, ev.resolve_s))
        else:
            view.above(sys.stdout, lines.event_line(ev))

    return show


def _asker(as_json: bool) -> Callable[[Planned], bool]:
    """--all without --yes: the plan, then the one question (guard.confirm)."""
    from xpuctl.output import lines

    def ask(planned: Planned) -> bool:
        stream = sys.stderr if as_json else sys.stdout
        for line in lines.shutdown_plan_lines(planned.trees, planned.members):
            emit(stream, line)
        for line in planned.skipped:
            emit(stream, f"skipped: {safe(line)}")
        return confirm("refusing to stop every server without confirmation: pass --yes "
                       "(no terminal to ask)")

    return ask


def _print_plan(out: Outcome, dry_run: bool, as_json: bool) -> None:
    """Nothing was sent (a dry run, or nothing to stop): the plan."""
    from xpuctl.output import documents, lines

    if as_json:
        targets = documents.shutdown_target_dicts(out.trees, out.members)
        sys.stdout.write(documents.to_json(
            documents.shutdown_plan_document(targets, dry_run, out.skipped)) + "\n")
        return
    for line in lines.shutdown_plan_lines(out.trees, out.members):
        emit(sys.stdout, line)
    for line in out.skipped:
        emit(sys.stdout, f"skipped: {safe(line)}")


def _report(out: Outcome, as_json: bool) -> ExitCode:
    """The ladder ran: the audit log's warning, the JSON document, the one command to run
    next when something was left; the exit code."""
    from xpuctl.output import documents, lines

    assert out.audit is not None and out.result is not None  # the ladder ran: its audit log
    warning = lines.audit_warning(out.audit)
    if warning:
        emit(sys.stderr, warning)
    if as_json:
        targets = documents.shutdown_target_dicts(out.trees, out.members)
        summary = out.audit.summary()
        sys.stdout.write(documents.to_json(documents.shutdown_document(
            targets, out.result, out.resolve_s, summary)) + "\n")
    if out.leftovers:  # the one command to run next
        devices = dict.fromkeys(d for t in out.trees for d in t.devices)
        ports = [t.port for t in out.trees if t.port]
        emit(sys.stderr, lines.next_line(devices, ports[0] if len(ports) == 1 else None,
                                         out.result.verdict))
    return ExitCode.PROBLEMS if out.leftovers else ExitCode.OK
