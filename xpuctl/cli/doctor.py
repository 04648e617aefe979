"""`xpuctl doctor`: read-only health check of this host (or a snapshot of one)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import typer

from xpuctl.cli.context import AppContext, app_context, open_source
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import (
    CollectiveOpt,
    CollectiveTimeoutOpt,
    DeepOpt,
    DeviceOpt,
    DoctorFormatOpt,
    DoctorPortOpt,
    ExpectIdleOpt,
    Format,
    FormatJsonOpt,
    FromOpt,
    ProbeTimeoutOpt,
    RayOpt,
    StateDirOpt,
    StrictOpt,
    TextfileOpt,
    UnattributedThresholdOpt,
    WaitCleanOpt,
    deep_options,
    on_cluster,
    output_format,
    parse_size,
)
from xpuctl.errors import ExitCode, UsageError, XpuctlError
from xpuctl.host.reads.caller import let_go
from xpuctl.output.safetext import emit

if TYPE_CHECKING:  # types only: the countdown's module loads with --collective
    from xpuctl.output.progress import View

app = command_app()


class _Asked(NamedTuple):
    """What the command line asks of the check itself (the host is opened apart)."""

    devices: list[str]
    port: int | None
    expect_idle: bool
    strict: bool
    wait_clean: float | None
    fmt: Format
    textfile: str | None
    collective: float | None  # --collective's timeout (None: no collective check)
    state_dir: str | None


@app.command()
@guard
def doctor(
    ctx: typer.Context,
    device: DeviceOpt = None,
    port: DoctorPortOpt = None,
    expect_idle: ExpectIdleOpt = False,
    strict: StrictOpt = False,
    wait_clean: WaitCleanOpt = None,
    fmt: DoctorFormatOpt = None,
    as_json: FormatJsonOpt = False,
    textfile: TextfileOpt = None,
    deep: DeepOpt = False,
    probe_timeout: ProbeTimeoutOpt = 10.0,
    unattributed_threshold: UnattributedThresholdOpt = "1GiB",
    collective: CollectiveOpt = False,
    collective_timeout: CollectiveTimeoutOpt = 30.0,
    state_dir: StateDirOpt = None,
    from_: FromOpt = None,
    ray: RayOpt = None,
) -> None:
    """Read-only health check: who holds the GPU, orphans, memory, stale IPC/shm, ports.

    With --deep the devices are asked too (unattributed memory, lost devices, hung runtimes);
    the probes briefly open the devices. The state directory gives the last run's advice and,
    with --deep, the idle baseline of `devices --deep --record-baseline`.

    With --collective, one rank per device (default: every Intel GPU; --device selects)
    runs what vLLM's XPU workers do first: init_process_group (xccl; ccl before torch 2.8),
    an all_reduce, destroy_process_group; on one device, an allocation and a computation
    (vLLM runs no collective at world size 1). A hang or failure fails (exit 1); no torch
    with XPU or no backend is a warning. The files its ranks leave are removed after them.

    With --ray [ADDRESS], doctor runs on every alive node of that Ray cluster (one section per
    node, the worst node's exit code).

    Exit 0: nothing fails. 1: failing findings (warnings too with --strict; also when
    --wait-clean runs out; also when --textfile cannot be written). 2: usage error (also an
    unsafe or unreadable --from archive). --format npd: 8 when it could not tell.
    """
    from xpuctl.state.statedir import resolve_state_dir

    a = app_context(ctx)
    asked = _Asked(list(device or []), port, expect_idle, strict, wait_clean,
                   _format(fmt, as_json, textfile), textfile,
                   collective_timeout if collective else None, state_dir)
    _check_sources(ray, from_, deep, asked)
    if ray is not None:
        on_cluster(a, "doctor", ray, {"devices": asked.devices, "port": port, "strict": strict,
                                      "expect_idle": expect_idle}, asked.fmt, textfile)
    host, environ, replayed = open_source(ctx, from_)
    sdir = resolve_state_dir(host, state_dir, environ)
    _check(a, asked, host, environ, sdir, _deep(deep, replayed, probe_timeout,
                                                 unattributed_threshold, sdir))


def _check(a: AppContext, asked: _Asked, host: Any, environ: dict[str, str], sdir: str | None,
           deep_opts: Any) -> NoReturn:
    """Diagnose, re-check with --wait-clean, render, exit."""
    from xpuctl import diagnosis

    # --collective runs once: a --wait-clean re-check carries its first result; while it
    # runs, stderr shows what its ranks are doing and the time left
    view = _countdown() if asked.collective is not None else None
    coll: list[Any] = [diagnosis.CollectiveOptions(asked.collective, on_wait=view.wait)
                       if view is not None and asked.collective is not None else None, deep_opts]

    def run() -> Any:
        report = diagnosis.diagnose(host, asked.devices, asked.port, asked.expect_idle, environ,
                                      deep=coll[1], state_dir=sdir, collective=coll[0])
        coll[0] = report.scan.collective
        coll[1] = diagnosis.again(coll[1], report)  # a re-check: xpu-smi once only
        return report

    if asked.fmt is Format.npd:
        _npd(run, asked.strict)
    try:
        report = run()
    finally:
        if view is not None:
            view.finish()
    clean = not diagnosis.blocking(report, asked.strict)
    if asked.wait_clean is not None and not clean:
        report, clean = _wait(a, report, run, asked.wait_clean, asked.strict,
                              asked.fmt is Format.table)
    let_go()  # nothing more to read: the reader's exit overlaps the rendering
    _render(a, report, asked.fmt, asked.textfile, asked.state_dir)
    if asked.fmt is Format.table and asked.wait_clean is not None and not clean:
        a.err.print(f"still not clean after {asked.wait_clean:g}s", style="red")
    raise typer.Exit(ExitCode.OK if clean else ExitCode.PROBLEMS)


def _npd(run: Callable[[], Any], strict: bool) -> NoReturn:
    """--format npd: node-problem-detector's custom plugin (output/npd.py): one line on
    stdout; exit 0 nothing fails, 1 a failing finding, else Unknown: 8 (UNKNOWN) when a read
    did not answer or an error that would exit 1 ended the check, an error's own code (2, 70)
    otherwise, its one line also on stdout."""
    from xpuctl.output import npd

    try:
        report = run()
    except XpuctlError as exc:
        emit(sys.stdout, npd.unknown_line(str(exc)))
        code = exc.exit_code if exc.exit_code not in (ExitCode.OK, ExitCode.PROBLEMS) else None
        raise XpuctlError(str(exc), code or ExitCode.UNKNOWN) from None
    except Exception as exc:
        emit(sys.stdout, npd.unknown_line(f"internal error: {type(exc).__name__}"))
        raise
    emit(sys.stdout, npd.npd_line(report, strict))
    if npd.failing(report, strict):
        raise typer.Exit(ExitCode.PROBLEMS)
    raise typer.Exit(ExitCode.UNKNOWN if report.status == "unknown" else ExitCode.OK)


def _countdown() -> View:
    """The collective check's countdown on stderr (output/progress.py)."""
    from xpuctl.output import progress

    return progress.countdown(sys.stderr)


def _check_sources(ray: str | None, from_: str | None, deep: bool, asked: _Asked) -> None:
    """What the host to read (this one, a snapshot, a cluster) and the format rule out."""
    wait_clean = asked.wait_clean
    if asked.fmt is Format.npd and (deep or asked.collective is not None or ray is not None
                                    or wait_clean is not None):
        raise UsageError("--format npd is node-problem-detector's quick check of this host: "
                         "drop --deep, --collective, --ray and --wait-clean")
    if asked.collective is not None and (ray is not None or from_ is not None):
        raise UsageError("--collective runs on this host's devices: drop --ray and --from")
    if ray is not None and (from_ is not None or deep or wait_clean is not None):
        raise UsageError("--ray checks the live nodes of a cluster: drop --from, --deep and --wait-clean")
    if from_ is not None and wait_clean is not None:
        raise UsageError("--wait-clean needs a live host; a snapshot does not change")
    if from_ is not None and deep:
        raise UsageError("--deep asks this host's devices; a snapshot taken with --deep replays "
                         "its probes by itself")


def _deep(deep: bool, replayed: Any, timeout: float, threshold: str, state_dir: str | None) -> Any:
    """DeepOptions for --deep, or for a --deep snapshot's recorded probes (judged as doctor
    --deep would judge them); None for a plain doctor."""
    from xpuctl.diagnosis import DeepOptions

    if replayed is not None:
        return DeepOptions(unattributed_threshold=parse_size(threshold), recorded=replayed)
    return deep_options(timeout, threshold, state_dir) if deep else None


def _format(fmt: Format | None, as_json: bool, textfile: str | None) -> Format:
    out_fmt = output_format(fmt, as_json, Format.prometheus if textfile is not None else Format.table)
    if textfile is not None:
        from xpuctl.state.textfile import check_target

        if out_fmt is not Format.prometheus:
            raise UsageError("--textfile writes Prometheus text: drop --json/--format or use --format prometheus")
        check_target(textfile)  # a bad PATH is a usage error before any work
    return out_fmt


def _wait(a: AppContext, report: Any, run: Any, seconds: float, strict: bool, table: bool) -> tuple[Any, bool]:
    """--wait-clean: re-check until clean; on a terminal a status line counts down."""
    from xpuctl.diagnosis import wait_clean

    if not (a.stderr_tty and table):
        return wait_clean(report, run, seconds, strict)
    with a.err.status("waiting for the host to be clean…") as status:

        def tick(r: Any, left: float) -> None:
            n = sum(1 for f in r.findings if f.severity == "fail")
            status.update(f"waiting for the host to be clean: {n} failing, {left:.0f}s left")

        return wait_clean(report, run, seconds, strict, tick=tick)


def _render(a: AppContext, report: Any, out_fmt: Format, textfile: str | None,
            state_dir: str | None) -> None:
    if out_fmt is Format.json:
        from xpuctl.output.documents import doctor_dict, to_json

        sys.stdout.write(to_json(doctor_dict(report)) + "\n")
    elif out_fmt is Format.prometheus:
        from xpuctl.output.prometheus import prometheus

        if textfile is None:
            sys.stdout.write(prometheus(report))
        else:
            from xpuctl.diagnosis import write_textfile
            from xpuctl.state.statedir import default_state_dir

            # our own stale temporary files beside it (the textfile is on this machine, never
            # under --root) are removed first, in this machine's audit log
            write_textfile(textfile, prometheus(report), state_dir or default_state_dir(a.environ))
    else:
        from xpuctl.output.tables import print_doctor

        print_doctor(a.out, report)
