"""`xpuctl reset`: plan, confirm, clean leftovers (orphans, stale files), verify."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from xpuctl.cli.context import app_context
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import confirm, guard
from xpuctl.cli.options import (
    CollectiveOpt,
    CollectiveTimeoutOpt,
    DeviceOpt,
    JsonOpt,
    KillAfterOpt,
    StateDirOpt,
    port_option,
)
from xpuctl.cli.paramtypes import Seconds
from xpuctl.errors import ExitCode, UsageError
from xpuctl.output.safetext import emit
from xpuctl.parse.seconds import HOUR

if TYPE_CHECKING:  # types only: the command's modules load when it runs
    from collections.abc import Callable

    from xpuctl.host.seam import Host
    from xpuctl.rebind import Request as RebindRequest
    from xpuctl.sweep import Outcome as ResetOutcome
    from xpuctl.sweep import Told as ResetTold

app = command_app()


@app.command()
@guard
def reset(
    ctx: typer.Context,
    device: DeviceOpt = None,
    port: Annotated[int | None, port_option("Serving port to check.", "8000")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan only.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (for scripts).")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", click_type=Seconds(0), help="Seconds to wait for orphans after SIGTERM.", show_default=False)] = None,
    kill_after: KillAfterOpt = 10.0,
    device_reset: Annotated[bool, typer.Option("--device-reset", help="Last resort, root only: PCI reset of the one --device once nothing holds it.")] = False,
    kill_holders: Annotated[
        bool,
        typer.Option("--kill-holders", help="Also stop processes that hold the devices and are not vLLM (never a live server's)."),
    ] = False,
    rebind: Annotated[bool, typer.Option("--rebind", help="Root: unbind and bind the one --device's driver (the kernel's recovery of a wedged card), then check it again. Refuses while anything holds it, unless --kill-holders.")] = False,
    bind_timeout: Annotated[float, typer.Option("--bind-timeout", click_type=Seconds(0, HOUR), help="--rebind: seconds to wait for the DRM nodes to go after the unbind, and for the render node after the bind.")] = 30.0,
    collective: CollectiveOpt = False,
    collective_timeout: CollectiveTimeoutOpt = 30.0,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Clean stuck oneCCL/vLLM state before a relaunch: stop orphans, remove stale files.

    Shows the plan first; asks unless --yes. Live servers are left alone (use shutdown).
    Non-vLLM processes holding the devices are listed; --kill-holders stops them too.
    Every signal and deletion is a line in STATE_DIR/audit.jsonl.

    Exit 0: clean afterwards. 1: problems remain. 2: usage (or no --yes without a terminal).
    """
    from xpuctl import sweep as flow
    from xpuctl.state.statedir import resolve_state_dir

    a = app_context(ctx)
    if rebind:
        if device_reset:
            raise UsageError("--rebind and --device-reset are two different recoveries: pick one")
        from xpuctl import rebind as rebind_flow

        _rebind(a.host, rebind_flow.Request(
            tuple(device or []), dry_run, kill_holders, kill_after, timeout, bind_timeout,
            collective_timeout if collective else None, a.environ),
            resolve_state_dir(a.host, state_dir, a.environ), as_json, yes)
    if collective:
        raise UsageError("--collective checks a device after --rebind: use doctor --collective")
    request = flow.Request(tuple(device or []), port, dry_run, timeout, kill_after, device_reset,
                           kill_holders, a.environ)
    out = flow.run(a.host, request, resolve_state_dir(a.host, state_dir, a.environ),
                   _shower(kill_holders, as_json), approve=None if yes else _confirm)
    _finish(out, kill_holders, dry_run, as_json)


def _shower(kill_holders: bool, as_json: bool) -> Callable[[ResetTold], None]:
    """How reset's steps are told: the plan (not with --json), the device reset, each
    removal, the stop of the orphans and holders."""
    from xpuctl import sweep as flow
    from xpuctl.actions.cleanup import Removal
    from xpuctl.output import lines

    stream = sys.stderr if as_json else sys.stdout

    def show(ev: ResetTold) -> None:
        if isinstance(ev, flow.Planned):
            if not as_json:
                for line in lines.reset_plan_lines(ev.plan, kill_holders, ev.advice):
                    emit(stream, line)
        elif isinstance(ev, flow.DeviceReset):
            emit(stream, lines.device_reset_line(ev.bdf, ev.done, ev.detail))
        elif isinstance(ev, Removal):
            said = lines.removal_line(ev)
            if said is not None:
                emit(stream, said)
        else:  # the stop of the orphans and holders
            emit(stream, lines.event_line(ev))

    return show


def _finish(out: ResetOutcome, kill_holders: bool, dry_run: bool, as_json: bool) -> NoReturn:
    """reset's outcome rendered, and its exit code."""
    from xpuctl.output import documents, lines

    stream = sys.stderr if as_json else sys.stdout
    plan_doc = documents.reset_plan_dict(out.plan, kill_holders, out.advice)
    if out.executed is None:
        if not (dry_run or out.plan.empty):
            raise typer.Exit(ExitCode.PROBLEMS)  # a "no" at the prompt: nothing was changed
        if as_json:
            sys.stdout.write(documents.to_json(documents.reset_plan_document(plan_doc, dry_run)) + "\n")
        raise typer.Exit(ExitCode.OK)
    assert out.audit is not None  # it ran: its audit log exists
    warning = lines.audit_warning(out.audit)
    if warning:
        emit(sys.stderr, warning)
    if as_json:
        sys.stdout.write(documents.to_json(documents.reset_document(plan_doc, out.executed, out.audit.summary())) + "\n")
    else:
        for line in lines.reset_result_lines(out.remaining, out.executed.after.status):
            emit(stream, line)
    raise typer.Exit(ExitCode.PROBLEMS if out.remaining else ExitCode.OK)


def _confirm(_plan: object = None) -> bool:
    """Ask on the terminal; no terminal is a usage error, a "no" exits 1 and changes nothing
    (Ctrl-C at the prompt: 130, in the guard)."""
    return confirm("refusing to clean without confirmation: pass --yes (no terminal to ask)")


def _rebind(host: Host, request: RebindRequest, state_dir: str | None, as_json: bool,
            yes: bool) -> NoReturn:
    """`reset --rebind`: the flow's steps and outcome rendered, its exit code."""
    from xpuctl import rebind as flow
    from xpuctl.output import documents, lines

    stream = sys.stderr if as_json else sys.stdout

    def show(ev: flow.Told) -> None:
        if isinstance(ev, flow.Planned):
            if not as_json:
                for line in lines.rebind_plan_lines(ev.plan):
                    emit(stream, line)
        elif isinstance(ev, flow.Written):
            emit(stream, lines.driver_write_line(ev.op, ev.bdf, ev.driver, ev.write))
        elif isinstance(ev, flow.Back):
            emit(stream, lines.device_back_line(ev.bdf, ev.node))
        elif isinstance(ev, flow.Checking):
            emit(stream, lines.collective_check_line(ev.bdf))
        else:  # the holders' stop
            emit(stream, lines.event_line(ev))

    out = flow.run(host, request, state_dir, show, approve=None if yes else _confirm)
    if out.declined:
        raise typer.Exit(ExitCode.PROBLEMS)  # a "no" at the prompt: nothing was changed
    if out.executed is None:  # a dry run, or refused
        if as_json:
            doc = documents.rebind_plan_document(out.plan, request.dry_run)
            sys.stdout.write(documents.to_json(doc) + "\n")
        refused = out.plan.refused and not request.dry_run
        raise typer.Exit(ExitCode.PROBLEMS if refused else ExitCode.OK)
    assert out.audit is not None  # it ran: its audit log exists
    warning = lines.audit_warning(out.audit)
    if warning:
        emit(stream, warning)
    if as_json:
        doc = documents.rebind_document(out.plan, out.executed, out.audit.summary())
        sys.stdout.write(documents.to_json(doc) + "\n")
    else:
        for line in lines.rebind_result_lines(out.plan.device.bdf, out.executed):
            emit(stream, line)
    raise typer.Exit(ExitCode.PROBLEMS if out.missing else ExitCode.OK)
