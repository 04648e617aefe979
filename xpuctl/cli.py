"""The typer app. Commands parse arguments, call one function, render, and map to an exit code.

Errors become exit codes in one place (`_guard`): an `XpuctlError` prints one line on
stderr and exits with its code; anything unexpected prints one line and exits 70, unless
`--debug` asks for the traceback.
"""

import functools
import os
import sys
import time
from enum import Enum
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from typer.core import TyperGroup

from xpuctl import __version__
from xpuctl.context import AppContext
from xpuctl.errors import ExitCode, UsageError, XpuctlError
from xpuctl.host.seam import Host
from xpuctl.output.safetext import emit, passthrough, safe


class _Group(TyperGroup):
    """The top-level command: every usage error (unknown option or command, bad value,
    missing argument) is one line on stderr and exit 2, never typer's boxed panel.

    click's own handling runs with standalone_mode=False so its errors come back here as
    exceptions; CliRunner and the console script both go through this `main`."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        from typer._click import exceptions as cx

        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except cx.NoArgsIsHelpError:
            rv = int(ExitCode.USAGE)  # bare `xpuctl`: the help was printed already
        except cx.UsageError as exc:
            emit(sys.stderr, usage_line(exc))
            rv = int(ExitCode.USAGE)
        except typer.Abort:
            sys.stderr.write("xpuctl: aborted\n")
            rv = int(ExitCode.PROBLEMS)
        except cx.ClickException as exc:
            emit(sys.stderr, f"xpuctl: error: {_one_line(exc.format_message())}")
            rv = exc.exit_code
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(text: str) -> str:
    return safe(" ".join(text.split()))


def usage_line(exc: Any) -> str:
    """`xpuctl: error: no such option: --bogus (see 'xpuctl doctor -h')`."""
    msg = _one_line(exc.format_message()).rstrip(".")
    if msg[:1].isupper() and msg[1:2].islower():
        msg = msg[0].lower() + msg[1:]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{_one_line(ctx.command_path)} -h')" if ctx is not None else ""
    return f"xpuctl: error: {msg}{hint}"


app = typer.Typer(
    name="xpuctl",
    cls=_Group,
    help="Intel XPU serving hygiene around vLLM: serve, shutdown, doctor, reset.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])
INTERNAL_ERROR = 70


def _debug_requested() -> bool:
    return "--debug" in sys.argv or os.environ.get("XPUCTL_DEBUG") == "1"


def fail(message: str, code: int) -> typer.Exit:
    # one line: a path or device spec in the message is the user's or the host's text
    emit(sys.stderr, f"xpuctl: error: {safe(message)}")
    return typer.Exit(int(code))


def _guard(fn: F) -> F:
    """Map errors to exit codes: the only place that does."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get("ctx") or (args[0] if args else None)
        obj = getattr(ctx, "obj", None)
        debug = bool(isinstance(obj, AppContext) and obj.debug) or _debug_requested()
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except XpuctlError as exc:
            if debug:
                raise
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            if debug:
                raise
            sys.stderr.write("xpuctl: interrupted\n")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except BrokenPipeError:
            # `xpuctl ps | head`: the reader went away; not an error worth a message
            try:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            except OSError:
                pass
            raise typer.Exit(ExitCode.PROBLEMS) from None
        except Exception as exc:  # noqa: BLE001
            if debug:
                raise
            raise fail(
                f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)",
                INTERNAL_ERROR,
            ) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        emit(sys.stdout, f"xpuctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    root: Annotated[
        Optional[str],
        typer.Option(
            "--root",
            envvar="XPUCTL_ROOT",
            help="Read /proc, /sys, /dev, /tmp under this directory (a fake host or a snapshot).",
            show_default=False,
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    if isinstance(ctx.obj, AppContext):
        return
    if root is not None and not os.path.isdir(root):
        raise fail(f"--root {root}: not a directory", ExitCode.USAGE)
    ctx.obj = AppContext(host=Host(root or "/"), debug=debug)


def _age_seconds() -> float | None:
    """Wall seconds since this process started (its /proc start time against CLOCK_BOOTTIME)."""
    from xpuctl.host.processes import stat_of
    from xpuctl.host.scan import CLK_TCK

    st = stat_of(Host("/"), os.getpid())
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if st is None or boottime is None:
        return None
    return max(0.0, time.clock_gettime(boottime) - st.start_ticks / CLK_TCK)


def _app(ctx: typer.Context) -> AppContext:
    obj = ctx.obj
    assert isinstance(obj, AppContext)
    return obj


class Preflight(str, Enum):
    fast = "fast"
    deep = "deep"


class Format(str, Enum):
    table = "table"
    json = "json"
    prometheus = "prometheus"


def _format(fmt: Format | None, as_json: bool, default: Format = Format.table) -> Format:
    if as_json and fmt not in (None, Format.json):
        raise UsageError("--json and --format disagree; use one of them")
    return Format.json if as_json else (fmt or default)


def complete_device(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Device indices, BDFs and node names, read from sysfs only (this runs on every TAB)."""
    from xpuctl.host.devices import scan_devices

    root = ctx.parent.params.get("root") if ctx.parent else None
    try:
        devices, _ = scan_devices(Host(root or os.environ.get("XPUCTL_ROOT") or "/"))
    except Exception:  # noqa: BLE001
        return []
    out = []
    for d in devices:
        help_ = safe(f"{d.bdf} {d.driver or '?'} {d.device_id or ''}".strip(), 200)  # shown by the shell
        for value in (str(d.index) if d.index is not None else None, d.bdf, d.render_node):
            if value and value.startswith(incomplete) and safe(value) == value:
                out.append((value, help_))
    return out


DeviceOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--device",
        "-d",
        help="Device: Level Zero index, PCI BDF or node name (repeatable).",
        autocompletion=complete_device,
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON for scripts (same as --format json).")]
DeepOpt = Annotated[
    bool,
    typer.Option("--deep", help="Also ask the devices themselves (Sysman, torch.xpu, xpu-smi, the "
                 "kernel's memory query), each probe in a child process."),
]
ProbeTimeoutOpt = Annotated[
    float,
    typer.Option("--probe-timeout", min=0.1, metavar="SECONDS",
                 help="With --deep: kill a probe (and its process group) that has not answered."),
]


def _size(value: str) -> int:
    from xpuctl.parse.fdinfo import parse_size

    n = parse_size(value)
    if n is None:
        raise UsageError(f"--unattributed-threshold {value!r} is not a size (e.g. 1GiB, 512MiB, 1073741824)")
    return n


def _deep_options(a: AppContext, timeout: float, threshold: str, state_dir: str | None) -> Any:
    from xpuctl.state import runs
    from xpuctl.doctor import DeepOptions

    sdir = state_dir or runs.default_state_dir(a.environ)
    age = _age_seconds()
    since = time.monotonic() - age if age is not None else None
    return DeepOptions(timeout=timeout, unattributed_threshold=_size(threshold), state_dir=sdir, since=since)
StateDirOpt = Annotated[
    Optional[str],
    typer.Option(
        "--state-dir",
        envvar="XPUCTL_STATE_DIR",
        help="Run records, logs and locks [default: /run/xpuctl as root, else "
        "$XDG_RUNTIME_DIR/xpuctl, else /tmp/xpuctl-UID].",
        show_default=False,
    ),
]



FromOpt = Annotated[
    Optional[str],
    typer.Option(
        "--from",
        metavar="FILE",
        help="Read a snapshot archive (xpuctl snapshot) instead of this host.",
        show_default=False,
    ),
]


def _source(ctx: typer.Context, from_: str | None) -> tuple[Host, dict[str, str], Any]:
    """The host to read, the caller environment doctor judges, and recorded probe results:
    this host's (no recorded probes), or a snapshot's (unpacked until the command ends; it
    replaces --root and XPUCTL_ROOT)."""
    a = _app(ctx)
    if from_ is None:
        return a.host, a.environ, None
    from xpuctl.archive.replay import open_snapshot

    opened = open_snapshot(from_)
    snap = opened.__enter__()
    ctx.call_on_close(lambda: opened.__exit__(None, None, None))
    m = snap.manifest
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(m.time))
    emit(sys.stderr, f"xpuctl: snapshot of {safe(m.host or '?')} taken {when} "
                     f"(xpuctl {safe(m.version)}, uid {m.uid}, {len(m.unreadable)} unreadable)")
    return snap.host, dict(m.caller_env), snap.probes  # probes: a --deep capture's results


@app.command()
@_guard
def doctor(
    ctx: typer.Context,
    device: DeviceOpt = None,
    port: Annotated[
        Optional[int],
        typer.Option("--port", "-p", min=1, max=65535, help="Serving port to check [default: 8000].", show_default=False),
    ] = None,
    expect_idle: Annotated[
        bool, typer.Option("--expect-idle", help="Any holder, memory or served port is a failure.")
    ] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too (exit 1).")] = False,
    wait_clean: Annotated[
        Optional[float],
        typer.Option(
            "--wait-clean",
            min=0,
            metavar="SECONDS",
            help="Re-check until nothing fails, for up to SECONDS (right after a shutdown).",
            show_default=False,
        ),
    ] = None,
    fmt: Annotated[Optional[Format], typer.Option("--format", "-f", help="table, json or prometheus.", show_default=False)] = None,
    as_json: JsonOpt = False,
    textfile: Annotated[
        Optional[str],
        typer.Option(
            "--textfile",
            metavar="PATH",
            help="Write the Prometheus text atomically to PATH (*.prom, for node_exporter's "
            "textfile collector) instead of stdout; implies --format prometheus.",
            show_default=False,
        ),
    ] = None,
    deep: DeepOpt = False,
    probe_timeout: ProbeTimeoutOpt = 10.0,
    unattributed_threshold: Annotated[
        str,
        typer.Option("--unattributed-threshold", metavar="SIZE",
                     help="With --deep: device memory no visible process explains above this fails."),
    ] = "1GiB",
    state_dir: Annotated[
        Optional[str],
        typer.Option("--state-dir", envvar="XPUCTL_STATE_DIR",
                     help="Run records and logs (the last-run advice; found as serve finds it) and, with "
                     "--deep, the idle baseline of `devices --deep --record-baseline`.",
                     show_default=False),
    ] = None,
    from_: FromOpt = None,
) -> None:
    """Read-only health check: who holds the GPU, orphans, memory, stale IPC/shm, ports.

    With --deep the devices are asked too (unattributed memory, lost devices, hung runtimes);
    the probes briefly open the devices. Exit 0: nothing fails. 1: failing findings (warnings
    too with --strict; also when --wait-clean runs out; also when --textfile cannot be
    written). 2: usage error (also an unsafe or unreadable --from archive).
    """
    from xpuctl import doctor as D

    a = _app(ctx)
    out_fmt = _format(fmt, as_json, Format.prometheus if textfile is not None else Format.table)
    if textfile is not None:
        from xpuctl.state.textfile import check_target

        if out_fmt is not Format.prometheus:
            raise UsageError("--textfile writes Prometheus text: drop --json/--format or use --format prometheus")
        check_target(textfile)  # a bad PATH is a usage error before any work
    devices = list(device or [])
    if from_ is not None and wait_clean is not None:
        raise UsageError("--wait-clean needs a live host; a snapshot does not change")
    if from_ is not None and deep:
        raise UsageError("--deep asks this host's devices; a snapshot taken with --deep replays "
                         "its probes by itself")
    host, environ, replayed = _source(ctx, from_)
    deep_opts = _deep_options(a, probe_timeout, unattributed_threshold, state_dir) if deep else None
    if replayed is not None:  # a --deep snapshot: its probes, judged as doctor --deep would
        from xpuctl.doctor import DeepOptions

        deep_opts = DeepOptions(unattributed_threshold=_size(unattributed_threshold),
                                recorded=replayed)

    sdir = D.state_dir_for(host, state_dir, environ)

    def run() -> Any:
        return D.diagnose(host, devices, port, expect_idle, environ, deep=deep_opts,
                          state_dir=sdir)

    report = run()
    clean = not D.blocking(report, strict)
    if wait_clean is not None and not clean:
        if a.stderr_tty and out_fmt is Format.table:
            with a.err.status("waiting for the host to be clean…") as status:

                def tick(r: Any, left: float) -> None:
                    n = sum(1 for f in r.findings if f.severity == "fail")
                    status.update(f"waiting for the host to be clean: {n} failing, {left:.0f}s left")

                report, clean = D.wait_clean(report, run, wait_clean, strict, tick=tick)
        else:
            report, clean = D.wait_clean(report, run, wait_clean, strict)
    from xpuctl.output import render

    if out_fmt is Format.json:
        sys.stdout.write(render.to_json(render.doctor_dict(report)) + "\n")
    elif out_fmt is Format.prometheus and textfile is not None:
        from xpuctl.state.textfile import write_atomic

        write_atomic(textfile, render.prometheus(report))
    elif out_fmt is Format.prometheus:
        sys.stdout.write(render.prometheus(report))
    else:
        render.print_doctor(a.out, report)
        if wait_clean is not None and not clean:
            a.err.print(f"still not clean after {wait_clean:g}s", style="red")
    raise typer.Exit(ExitCode.OK if clean else ExitCode.PROBLEMS)


@app.command()
@_guard
def ps(
    ctx: typer.Context,
    device: DeviceOpt = None,
    show_all: Annotated[bool, typer.Option("--all", "-a", help="Also list non-vLLM processes holding a device.")] = False,
    as_json: JsonOpt = False,
    from_: FromOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """xpuctl's runs (state: starting, ready, stopping; age) and the vLLM process trees on
    this host: role, state, devices, memory, orphan, run."""

    from xpuctl.output import render
    from xpuctl.doctor import resolve_device_specs
    from xpuctl.host.scan import take_snapshot

    a = _app(ctx)
    host, _, _ = _source(ctx, from_)
    bdfs = set(resolve_device_specs(host, list(device or [])))
    snap = take_snapshot(host, port=None, artifacts=False)
    procs = [
        p
        for p in snap.processes
        if (p.role is not None or show_all) and (not bdfs or bdfs & set(p.devices) or (p.role and not p.devices))
    ]
    if bdfs:
        tops = {p.top for p in procs if bdfs & set(p.devices)}
        procs = [p for p in procs if p.devices or p.top in tops]
    from xpuctl.doctor import state_dir_for
    from xpuctl.serve.supervise import live_runs

    sdir = state_dir_for(host, state_dir, a.environ)
    runs = live_runs(host, sdir) if sdir and host.proc_is_live else []
    if as_json:
        data = {"schema": "xpuctl.ps/1", "runs": [render.run_dict(r) for r in runs],
                "processes": [render.process_dict(p) for p in procs]}
        sys.stdout.write(render.to_json(data) + "\n")
        return
    if runs:
        a.out.print(render.runs_table(runs), no_wrap=True, crop=True)
    if not procs:
        a.out.print("no vLLM processes")
        return
    table = render.processes_table(snap._replace(processes=tuple(procs)), "vLLM processes", a.out.width)
    a.out.print(table, no_wrap=True, crop=True)


@app.command()
@_guard
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
    state_dir: Annotated[
        Optional[str],
        typer.Option("--state-dir", envvar="XPUCTL_STATE_DIR", help="Where the baseline is kept.",
                     show_default=False),
    ] = None,
    from_: FromOpt = None,
) -> None:
    """Intel GPUs (Level Zero order) and other DRM devices, with holders and memory."""
    from xpuctl.output import render
    from xpuctl.host.scan import take_snapshot

    a = _app(ctx)
    if from_ is not None and (deep or record_baseline):
        raise UsageError("--deep and --record-baseline ask this host's devices, not a snapshot")
    host, _, replayed = _source(ctx, from_)
    if record_baseline and not deep:
        raise UsageError("--record-baseline needs --deep (the baseline is what the devices report)")
    recorded: list[Any] = []
    if deep:
        from xpuctl.probes import deep as X
        from xpuctl.doctor import deep_snapshot

        opts = _deep_options(a, probe_timeout, "1GiB", state_dir)
        if record_baseline:
            snap = deep_snapshot(host, a.environ, opts._replace(state_dir=None), port=None,
                                 want_env=False, artifacts=False)
            recorded = X.record_baseline(opts.state_dir, snap)
            # show the figures against the baseline just recorded
            baseline, _ = X.load_baseline(opts.state_dir)
            assert snap.deep is not None
            snap = X.attach(host, snap, snap.deep.probes, baseline, snap.deep.probe_pids)
        else:
            snap = deep_snapshot(host, a.environ, opts, port=None, want_env=False, artifacts=False)
    elif replayed is not None:  # a --deep snapshot: show its probes as devices --deep did
        from xpuctl.doctor import DeepOptions, deep_snapshot

        snap = deep_snapshot(host, {}, DeepOptions(recorded=replayed), port=None, want_env=False,
                             artifacts=False)
    else:
        snap = take_snapshot(host, port=None, want_env=False, artifacts=False)
    if as_json:
        data: dict[str, Any] = {"schema": "xpuctl.devices/1",
                                "devices": [render.device_dict(d, snap) for d in snap.devices]}
        if snap.deep is not None:
            data["probes"] = [render.probe_dict(r) for r in snap.deep.probes]
        if record_baseline:
            data["baseline"] = [{"bdf": b, "memory_used_bytes": n, "note": note} for b, n, note in recorded]
        sys.stdout.write(render.to_json(data) + "\n")
        return
    render.print_devices(a.out, snap)
    line = render.probes_line(snap)
    if line:
        a.out.print(line, highlight=False)
    for bdf, n, note in recorded:
        a.out.print(f"baseline {bdf}: {render.human_bytes(n) if n is not None else '-'} ({note})",
                    highlight=False)


def _relaunch_advice(a: AppContext, state_dir: str | None) -> list[Any]:
    """doctor's `last-run` finding for the state directory's newest run."""
    from xpuctl.core.checks import last_run_findings
    from xpuctl.doctor import state_dir_for
    from xpuctl.state.lastrun import last_run

    return last_run_findings(last_run(state_dir_for(a.host, state_dir, a.environ)))


def _print_advice(say: Callable[[str], None], findings: list[Any]) -> None:
    for f in findings:
        say(f"{f.severity} {f.check}: {safe(f.message)}")
        if f.remedy:
            say(f"  {safe(f.remedy)}")


@app.command()
@_guard
def snapshot(
    ctx: typer.Context,
    output: Annotated[
        Optional[str],
        typer.Option("--output", "-o", metavar="FILE",
                     help="Archive to write ('-': stdout); default ./xpuctl-snapshot-HOST-TIME.tar.gz.",
                     show_default=False),
    ] = None,
    state_dir: StateDirOpt = None,
    deep: Annotated[bool, typer.Option("--deep", help="Run doctor --deep and keep the probes' "
                                       "results (probes.json); --from replays them.")] = False,
    probe_timeout: ProbeTimeoutOpt = 10.0,
) -> None:
    """Capture what doctor reads into a .tar.gz for support; read it anywhere with
    `xpuctl doctor --from FILE` (also ps and devices).

    Process environments keep only XPUCTL_*, ZE_*, ONEAPI_*, SYCL_*, CCL_*, VLLM_* and
    SPT_NOENV; /dev/shm and /tmp are listed, never copied. Exit 0: written. 2: cannot write.
    """
    from xpuctl.state import runs
    from xpuctl.archive import capture as S

    a = _app(ctx)
    if output == "-" and a.stdout_tty:  # as gzip does: binary bytes would garble a terminal
        raise UsageError("refusing to write the archive to a terminal: redirect stdout or use -o FILE")
    sdir = state_dir or runs.default_state_dir(a.environ)
    deep_opts = _deep_options(a, probe_timeout, "1GiB", sdir) if deep else None
    taken = S.take(a.host, output, a.environ, sdir, deep_opts)
    shown = "stdout" if taken.path == "-" else taken.path
    emit(sys.stderr,
         f"xpuctl: wrote {safe(shown)} ({taken.size_bytes / 1024:.0f} KiB, {taken.processes} "
         f"processes, {taken.unreadable} unreadable) in {taken.seconds:.2f}s")
    if taken.path != "-":
        emit(sys.stderr, f"xpuctl: read it with: xpuctl doctor --from {safe(taken.path)}")


def complete_run(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Run names from the state directory (this runs on every TAB)."""
    from xpuctl.state import runs

    try:
        sdir = ctx.params.get("state_dir") or runs.default_state_dir()
        sdir = runs.ensure_state_dir(sdir, create=False)
        return [(r.name, f"{r.state}, port {r.port}") for r in runs.list_records(sdir)
                if r.name.startswith(incomplete)]
    except Exception:  # noqa: BLE001
        return []


def _find_record(state_dir: str | None, environ: dict[str, str], name: str) -> tuple[str, Any]:
    """(state dir, the run record named `name`); NotFoundError (exit 3) when there is none."""
    from xpuctl.state import runs
    from xpuctl.errors import NotFoundError
    sdir = state_dir or runs.default_state_dir(environ)
    sdir = runs.ensure_state_dir(sdir, create=False)
    rec = runs.read_record(sdir, name) if os.path.isdir(os.path.join(sdir, "runs")) else None
    if rec is None or rec.name != name:
        known = [r.name for r in runs.list_records(sdir)]
        raise NotFoundError(f"no run named {safe(name)!r} in {safe(sdir)}"
                            + (f"; known runs: {', '.join(map(safe, known))}" if known else ""))
    return sdir, rec


def _audit_warning(log: Any) -> None:
    """The audit log could not be written: say so (the action itself went ahead)."""
    if log.lost:
        emit(sys.stderr, f"xpuctl: warning: audit log {log.path}: {log.lost} line(s) not written ({log.error})")


def _print_findings(a: AppContext, report: Any) -> None:
    for f in report.findings:
        if f.severity == "info":
            continue
        emit(sys.stderr, f"xpuctl: preflight {f.severity} {f.check}: {safe(f.message)}")
        if f.remedy:
            emit(sys.stderr, f"xpuctl:   fix: {safe(f.remedy)}")


# Options both xpuctl and vLLM have: accepted on either side of MODEL (xpuctl reads them).
SHARED_SERVE_OPTIONS = frozenset({"--port", "--host"})


def _check_serve_args(ctx: typer.Context, model: str, passed: list[str]) -> None:
    """MODEL must not be an option, and no xpuctl-only option may follow MODEL.

    click stops parsing at MODEL (everything after it is vLLM's) and keeps unknown options
    before it as arguments, so a vLLM option before MODEL shows up here as the "model"."""
    if model.startswith("-") and model != "-":
        raise UsageError(
            f"{safe(model)} is not an xpuctl serve option: vLLM's options go after MODEL "
            "(xpuctl serve [OPTIONS] MODEL [VLLM ARGS])"
        )
    mine = {
        name
        for p in ctx.command.params
        if p.param_type_name == "option"
        for name in (*p.opts, *p.secondary_opts)
        if name.startswith("--")  # short ones clash with vLLM's own (-q is --quantization)
    } - SHARED_SERVE_OPTIONS - set(ctx.help_option_names)
    for arg in passed:
        key = arg.split("=", 1)[0]
        if key in mine:
            raise UsageError(
                f"{safe(key)} comes after MODEL, where everything goes to vLLM; it is an xpuctl "
                "option: put it before MODEL (xpuctl serve [OPTIONS] MODEL [VLLM ARGS])"
            )


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}
)
@_guard
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Model to serve (passed to vLLM).")],
    vllm_args: Annotated[Optional[list[str]], typer.Argument(help="Arguments passed to vLLM.", show_default=False)] = None,
    vllm: Annotated[
        str, typer.Option("--vllm", envvar="XPUCTL_VLLM", help="Command that starts vLLM (shell-split).")
    ] = "vllm serve",
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0, help="Seconds to let in-flight requests finish.")] = 30.0,
    teardown_timeout: Annotated[float, typer.Option("--teardown-timeout", min=0, help="Seconds for Level Zero/oneCCL teardown after the drain.")] = 20.0,
    allow_abort: Annotated[bool, typer.Option("--allow-abort", help="Keep an explicit --shutdown-timeout 0.")] = False,
    devices: Annotated[
        Optional[list[str]],
        typer.Option("--devices", help="Devices for vLLM (index, BDF or node; comma list): sets ZE_AFFINITY_MASK.",
                     autocompletion=complete_device, show_default=False),
    ] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE for vLLM (repeatable).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Start even when the preflight doctor fails.")] = False,
    name: Annotated[Optional[str], typer.Option("--name", help="Run name (default: vllm-PORT).", show_default=False)] = None,
    state_dir: StateDirOpt = None,
    ready_timeout: Annotated[float, typer.Option("--ready-timeout", min=1, help="Seconds to wait for /health and /v1/models.")] = 900.0,
    kill_after: Annotated[float, typer.Option("--kill-after", min=0, help="Seconds between SIGTERM and SIGKILL for survivors.")] = 10.0,
    detach: Annotated[bool, typer.Option("--detach", help="Return once ready (exit 0) or failed; keep supervising in the background.")] = False,
    preflight: Annotated[
        Preflight,
        typer.Option("--preflight", help="fast: doctor from /proc and sysfs; deep: doctor --deep "
                     "(also asks the devices: unattributed memory, lost devices, hung runtimes)."),
    ] = Preflight.fast,
    probe_timeout: ProbeTimeoutOpt = 10.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live status line or phase lines while vLLM starts.")] = False,
    port: Annotated[
        Optional[int],
        typer.Option("--port", min=1, max=65535, show_default=False,
                     help="vLLM's port, passed on to vLLM (before or after MODEL) [default: 8000]."),
    ] = None,
    bind: Annotated[
        Optional[str],
        typer.Option("--host", show_default=False, help="vLLM's bind address, passed on to vLLM (before or after MODEL)."),
    ] = None,
) -> None:
    """Launch vLLM with a forced drain timeout and supervise it.

    Exit: vLLM's code when it exits by itself; 0 after a clean requested stop; 1 when
    leftovers remain or the preflight fails; 4 when not ready in time; 5 when a device or
    the port is claimed by another run.
    """
    from xpuctl.state import runs
    from xpuctl.serve import supervise as S

    a = _app(ctx)
    passed = list(vllm_args or []) + list(ctx.args)
    _check_serve_args(ctx, model, passed)
    opts = S.ServeOptions(
        model=model,
        vllm_args=passed,
        vllm_cmd=vllm,
        drain_timeout=drain_timeout,
        teardown_timeout=teardown_timeout,
        allow_abort=allow_abort,
        devices=list(devices or []),
        env=list(env or []),
        force=force,
        name=name,
        state_dir=state_dir or runs.default_state_dir(a.environ),
        ready_timeout=ready_timeout,
        detach=detach,
        kill_after=kill_after,
        deep_preflight=_deep_options(a, probe_timeout, "1GiB", state_dir) if preflight is Preflight.deep else None,
        quiet=quiet,
        port=port,
        host=bind,
    )

    def say(msg: str) -> None:
        emit(sys.stderr, msg)

    code = S.serve(a.host, opts, a.environ, say, lambda r: _print_findings(a, r))
    raise typer.Exit(int(code))


@app.command()
@_guard
def shutdown(
    ctx: typer.Context,
    name: Annotated[Optional[str], typer.Argument(help="Run name (see `xpuctl ps`).", show_default=False, autocompletion=complete_run)] = None,
    pid: Annotated[Optional[int], typer.Option("--pid", help="Any process of the vLLM server (or of its orphans).", show_default=False)] = None,
    port: Annotated[Optional[int], typer.Option("--port", "-p", min=1, max=65535, help="The server's HTTP port.", show_default=False)] = None,
    device: DeviceOpt = None,
    all_: Annotated[bool, typer.Option("--all", help="Every vLLM server and orphan on this host.")] = False,
    timeout: Annotated[
        Optional[float],
        typer.Option("--timeout", min=0, help="Seconds to wait after SIGTERM [default: the run's shutdown timeout + 10].", show_default=False),
    ] = None,
    kill_after: Annotated[float, typer.Option("--kill-after", min=0, help="Seconds between SIGTERM and SIGKILL for survivors.")] = 10.0,
    release_timeout: Annotated[float, typer.Option("--release-timeout", min=0, help="Seconds to wait for the devices and port to be free.")] = 30.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be stopped; send nothing.")] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Drain and stop a vLLM server, escalate step by step, verify the GPU is released.

    Exit 0: stopped and released (escalation is reported, not an error). 1: leftovers
    remain. 3: NAME, --pid or --port matches nothing. --all with nothing running exits 0.
    """
    from xpuctl.output import render
    from xpuctl.state import runs
    from xpuctl.shutdown import ladder as S
    from xpuctl.doctor import resolve_device_specs
    from xpuctl.host.scan import take_snapshot
    from xpuctl.actions.signals import can_signal

    a = _app(ctx)
    if name is None and pid is None and port is None and not device and not all_:
        raise UsageError("say which server to stop: NAME, --pid, --port, --device or --all")
    if not can_signal(a.host) and not dry_run:
        raise UsageError("shutdown needs the live /proc (a root whose proc is the real /proc)")
    sdir = state_dir or runs.default_state_dir(a.environ)
    records = runs.list_records(runs.ensure_state_dir(sdir, create=False)) if os.path.isdir(sdir) else []
    bdfs = resolve_device_specs(a.host, list(device or []))
    snap = take_snapshot(a.host, port=port, artifacts=False)  # finding trees needs no files
    trees = S.find_trees(a.host, snap, records, name, pid, port, bdfs, all_)

    def plan(processes: dict[int, list[int]]) -> list[dict[str, Any]]:
        return [
            {
                "name": t.name,
                "top": t.top.pid,
                "role": t.role,
                "orphan": t.orphan,
                "run_id": t.run_id,
                "devices": list(t.devices),
                "port": t.port,
                "shutdown_timeout": t.shutdown_timeout,
                "processes": processes[t.top.pid],
            }
            for t in trees
        ]

    if dry_run or not trees:
        planned = plan({t.top.pid: [m.pid for m in S.members(a.host, t)] for t in trees})
        if as_json:
            sys.stdout.write(render.to_json({"schema": "xpuctl.shutdown/1", "dry_run": dry_run, "targets": planned,
                                             "events": [], "verdict": "nothing" if not trees else "planned"}) + "\n")
        else:
            if not trees:
                emit(sys.stdout, "nothing to stop")
            for t in planned:
                emit(
                    sys.stdout,
                    f"would stop {safe(t['name'])}: SIGTERM {t['role']} {t['top']}"
                    f"{' (orphaned)' if t['orphan'] else ''}, then wait for {len(t['processes'])} process(es) "
                    f"{t['processes']}, devices {safe(', '.join(t['devices'])) or '-'}, port {t['port'] or '-'}",
                )
        raise typer.Exit(ExitCode.OK)
    for t in trees:
        if t.record is not None:
            try:
                runs.update_record(sdir, t.record, state="stopping")
            except OSError:
                pass

    def show(ev: Any) -> None:
        if not as_json:
            emit(sys.stdout, f"{ev.t:7.2f}s  {ev.phase:<18} {safe(ev.detail)}")

    # From our own start to the first signal: start-up plus finding the trees. On the
    # critical path of every restart, and the first thing to look at when a drain began late.
    resolve_s = _age_seconds()
    if not as_json and resolve_s is not None:
        emit(sys.stdout, f"found {len(trees)} server tree(s) {resolve_s:.2f}s after start")

    from xpuctl.state import audit

    with audit.recording(sdir, "shutdown") as log:
        result = S.stop(a.host, trees, timeout=timeout, kill_after=kill_after, release_timeout=release_timeout, on_event=show)
    _audit_warning(log)
    for t in trees:
        if t.record is not None:
            try:
                runs.update_record(
                    sdir, t.record, state="stopped" if result.verdict != "leftovers" else "failed",
                    stopped_at=time.time(),
                )
            except OSError:
                pass
    if as_json:
        data = {
            "schema": "xpuctl.shutdown/1",
            "dry_run": False,
            "targets": plan(result.members),  # the processes the ladder waited for
            "events": [{"t": e.t, "phase": e.phase, "detail": e.detail} for e in result.events],
            "resolve_seconds": round(resolve_s, 3) if resolve_s is not None else None,
            "verdict": result.verdict,
            "survivors": result.survivors,
            "holders": result.holders,
            "stuck": [{"pid": p, "wchan": w} for p, w in result.stuck],
            "ports_busy": result.port_busy,
            "audit": log.summary(),
        }
        sys.stdout.write(render.to_json(data) + "\n")
    raise typer.Exit(ExitCode.PROBLEMS if result.verdict == "leftovers" else ExitCode.OK)


@app.command()
@_guard
def logs(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Run name (see `xpuctl ps`).", autocompletion=complete_run)],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run is over (Ctrl-C stops).")] = False,
    lines: Annotated[
        Optional[int],
        typer.Option("--lines", "-n", min=0, metavar="N", help="Only the last N lines (default: all).", show_default=False),
    ] = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Print a run's log (vLLM's output and, for --detach, the supervisor's lines).

    On a terminal every line is escaped (control characters shown as \\x1b...).

    Into a pipe or a file the log's bytes are copied unchanged.

    Exit 0; 3: no run of that name.
    """
    from xpuctl import logs as L
    from xpuctl.state import runs
    a = _app(ctx)
    sdir, rec = _find_record(state_dir, a.environ, name)

    def alive() -> bool:
        fresh = runs.read_record(sdir, name)
        return L.run_alive(a.host, fresh if fresh is not None and fresh.run_id == rec.run_id else rec)

    def note(msg: str) -> None:
        emit(sys.stderr, f"xpuctl: {msg}")

    tty = a.stdout_tty
    if tty:
        out: Any = L.LineWriter(lambda text: emit(sys.stdout, text), safe)
    else:
        def out(data: bytes) -> None:
            passthrough(sys.stdout.buffer, data)

    try:
        L.copy(rec.log_path, lines, follow, alive, out, note)
    except FileNotFoundError:
        raise XpuctlError(f"run {safe(name)!r} has no log at {safe(rec.log_path)}") from None
    finally:
        if tty:
            out.close()


@app.command()
@_guard
def reset(
    ctx: typer.Context,
    device: DeviceOpt = None,
    port: Annotated[Optional[int], typer.Option("--port", "-p", min=1, max=65535, help="Serving port to check.", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan only.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (for scripts).")] = False,
    timeout: Annotated[Optional[float], typer.Option("--timeout", min=0, help="Seconds to wait for orphans after SIGTERM.", show_default=False)] = None,
    kill_after: Annotated[float, typer.Option("--kill-after", min=0, help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
    device_reset: Annotated[bool, typer.Option("--device-reset", help="Last resort, root only: PCI reset of the one --device once nothing holds it.")] = False,
    kill_holders: Annotated[
        bool,
        typer.Option("--kill-holders", help="Also stop processes that hold the devices and are not vLLM (never a live server's)."),
    ] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Clean stuck oneCCL/vLLM state before a relaunch: stop orphans, remove stale files.

    Shows the plan first; asks unless --yes. Live servers are left alone (use shutdown).
    Non-vLLM processes holding the devices are listed; --kill-holders stops them too.
    Every signal and deletion is a line in STATE_DIR/audit.jsonl.

    Exit 0: clean afterwards. 1: problems remain. 2: usage (or no --yes without a terminal).
    """
    from xpuctl.output import render
    from xpuctl import reset as R
    from xpuctl.doctor import resolve_device_specs
    a = _app(ctx)
    bdfs = resolve_device_specs(a.host, list(device or []))
    plan = R.make_plan(a.host, bdfs, port, device_reset, kill_holders)
    advice = _relaunch_advice(a, state_dir)

    def plan_dict() -> dict[str, Any]:
        return {
            "orphans": [{"top": t.top.pid, "devices": list(t.devices)} for t in plan.orphan_trees],
            "orphan_pids": plan.orphan_pids,
            "files": [render.artifact_dict(f) for f in plan.files],
            "files_after_orphans": [render.artifact_dict(f) for f in plan.pending_files],
            "skipped": [{"path": f.path, "why": why} for f, why in plan.skipped_files],
            "device_reset": plan.device_reset,
            "holders": [{"pid": h.pid, "command": h.command, "devices": list(h.devices),
                         "stop": kill_holders and h.why_not is None, "why_not": h.why_not}
                        for h in plan.holders],
            "notes": plan.notes,
            "advice": [render.finding_dict(f) for f in advice],
        }

    stream = sys.stderr if as_json else sys.stdout

    def say(line: str) -> None:
        emit(stream, line)

    if not as_json:
        if plan.empty:
            say("nothing to clean")
        for t in plan.orphan_trees:
            say(f"stop orphaned vLLM tree {t.top.pid} ({t.role}) holding {safe(', '.join(t.devices)) or 'no device'}")
        for h in plan.holders:
            head = f"pid {h.pid} ({safe(h.command, 200)}) holds {safe(', '.join(h.devices))}, not part of a live server"
            if h.why_not is not None:
                say(f"holder {head}: not stopped: {safe(h.why_not)}")
            elif kill_holders:
                say(f"stop holder {head}")
            else:
                say(f"holder {head}: --kill-holders stops it")
        for f in plan.files:
            say(f"remove {safe(f.path)} ({f.kind}, uid {f.owner_uid}, {f.size_bytes} bytes): {safe(f.reason)}")
        for f in plan.pending_files:
            say(f"remove {safe(f.path)} ({f.kind}) once the orphans holding it are gone")
        for f, why in plan.skipped_files:
            say(f"skip {safe(f.path)}: {safe(why)}")
        for b in plan.device_reset:
            say(f"reset device {safe(b)} (PCI function reset) once nothing holds it")
        for n in plan.notes:
            say(f"note: {safe(n)}")
        _print_advice(say, advice)
    if dry_run or plan.empty:
        if as_json:
            sys.stdout.write(render.to_json({"schema": "xpuctl.reset/1", "dry_run": dry_run, "plan": plan_dict()}) + "\n")
        raise typer.Exit(ExitCode.OK)
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError("refusing to clean without confirmation: pass --yes (no terminal to ask)")
        if not typer.confirm("Proceed?", default=False):
            raise typer.Exit(ExitCode.PROBLEMS)
    from xpuctl.state import audit, runs

    with audit.recording(state_dir or runs.default_state_dir(a.environ), "reset") as log:
        outcome = R.execute(a.host, plan, bdfs, port, kill_after, timeout, say)
    _audit_warning(log)
    remaining = [f for f in outcome.after.findings if f.severity == "fail"]
    if as_json:
        data = {
            "schema": "xpuctl.reset/1",
            "dry_run": False,
            "plan": plan_dict(),
            "stopped": outcome.stopped.verdict if outcome.stopped else None,
            "removed": [r.path for r in outcome.removed if r.removed],
            "kept": [{"path": r.path, "why": r.reason} for r in outcome.removed if not r.removed],
            "device_reset": [{"bdf": b, "done": ok, "detail": why} for b, ok, why in outcome.device_reset],
            "status": outcome.after.status,
            "findings": [render.finding_dict(f) for f in outcome.after.findings],
            "audit": log.summary(),
        }
        sys.stdout.write(render.to_json(data) + "\n")
    else:
        for f in remaining:
            say(f"still failing: {f.check}: {safe(f.message)}")
        say(f"status: {outcome.after.status}")
    raise typer.Exit(ExitCode.PROBLEMS if remaining else ExitCode.OK)


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


@app.command()
@_guard
def completion(shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.")]) -> None:
    """Print the completion script for a shell (e.g. `xpuctl completion bash > /etc/bash_completion.d/xpuctl`).

    The script is a shim: every TAB asks xpuctl itself, so candidates (devices, commands)
    are always current. Same text as completions/ in the source tree.
    """
    from typer._completion_shared import get_completion_script

    sys.stdout.write(get_completion_script(prog_name="xpuctl", complete_var="_XPUCTL_COMPLETE", shell=shell.value))
    sys.stdout.write("\n")


def main() -> None:
    # Last net under the sinks (safetext): a character the stream cannot encode (a stray
    # surrogate, or non-ASCII on an ASCII locale) is written as a backslash escape, never as
    # a raw byte (what surrogateescape, the default in a C/UTF-8-mode locale, would do) and
    # never as an exit-70 UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    app(prog_name="xpuctl")


if __name__ == "__main__":
    main()
