"""`xpuctl serve MODEL [VLLM ARGS]`: launch vLLM with a forced drain timeout and supervise it."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import Annotated, Any

import typer

from xpuctl.cli.context import app_context
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import (
    KillAfterOpt,
    ProbeTimeoutOpt,
    StateDirOpt,
    complete_device,
    deep_options,
    port_option,
)
from xpuctl.cli.paramtypes import DeviceList, Seconds
from xpuctl.errors import UsageError
from xpuctl.output.safetext import emit, safe
from xpuctl.parse.seconds import DAY, HOUR

app = command_app()

# Options both xpuctl and vLLM have: accepted on either side of MODEL (xpuctl reads them).
SHARED_SERVE_OPTIONS = frozenset({"--port", "--host"})


PREFLIGHTS = ("fast", "deep", "collective")


class OnUnhealthy(StrEnum):
    stop = "stop"
    report = "report"


# -- the liveness watch's options (issue 36 §3: the windows' ranges: _check_watch_options)

HealthIntervalOpt = Annotated[
    float,
    typer.Option("--health-interval", click_type=Seconds(0.1, HOUR),
                 help="Once ready, check /health, /metrics, vLLM's log and the kernel log "
                 "this often."),
]

UnhealthyAfterOpt = Annotated[
    float,
    typer.Option("--unhealthy-after", click_type=Seconds(0, DAY),
                 help="Unhealthy when /health fails at every check for this long (at once "
                 "when vLLM logs that its engine died, or a device is declared wedged); "
                 "at least one --health-interval (one failed check is a blip)."),
]

StallAfterOpt = Annotated[
    float,
    typer.Option("--stall-after", click_type=Seconds(0, DAY),
                 help="Stalled when requests are running on an engine and none of its "
                 "tokens was counted (vllm:generation_tokens_total, "
                 "vllm:prompt_tokens_total) for this long; each data-parallel engine is "
                 "judged on its own, a sleeping one never. At least two --health-interval; "
                 "0 turns the stall check off."),
]

OnUnhealthyOpt = Annotated[
    OnUnhealthy,
    typer.Option("--on-unhealthy", help="stop: stop the run (drain, escalate, prove the "
                 "release) and exit 7; report: keep it running and say it is unhealthy "
                 "(record, ps, health, doctor, systemd)."),
]


def parse_preflight(value: str | None) -> set[str]:
    """`--preflight` is one value or a comma list (`deep,collective`); UsageError otherwise."""
    if value is None:
        return set()
    chosen = {v.strip() for v in value.split(",") if v.strip()}
    bad = sorted(chosen - set(PREFLIGHTS))
    if bad or not chosen:
        raise UsageError(f"--preflight {safe(value)}: use {', '.join(PREFLIGHTS)} or a comma "
                         "list of them (deep,collective)")
    return chosen


# -- the options, one alias each (the command's signature stays one line an option) --------

ModelArg = Annotated[str, typer.Argument(metavar="MODEL", help="Model to serve (passed to vLLM).")]
VllmArgs = Annotated[list[str] | None, typer.Argument(help="Arguments passed to vLLM.",
                                                      show_default=False)]
VllmOpt = Annotated[str, typer.Option("--vllm", envvar="XPUCTL_VLLM",
                                      help="Command that starts vLLM (shell-split).")]
DrainOpt = Annotated[float, typer.Option("--drain-timeout", click_type=Seconds(0),
                                         help="Seconds to let in-flight requests finish.")]
TeardownOpt = Annotated[float, typer.Option(
    "--teardown-timeout", click_type=Seconds(0),
    help="Seconds for Level Zero/oneCCL teardown after the drain.")]
AbortOpt = Annotated[bool, typer.Option("--allow-abort",
                                        help="Keep an explicit --shutdown-timeout 0.")]
DevicesOpt = Annotated[list[str] | None, typer.Option(
    "--devices", click_type=DeviceList(), autocompletion=complete_device, show_default=False,
    help="Devices for vLLM (index, BDF or node; comma list): sets ZE_AFFINITY_MASK. Without "
    "it, the run's devices are those ZE_AFFINITY_MASK of vLLM's environment names (the "
    "caller's, --env, Ray's), else every card.")]
EnvOpt = Annotated[list[str] | None, typer.Option("--env", "-e", show_default=False,
                                                  help="KEY=VALUE for vLLM (repeatable).")]
ForceOpt = Annotated[bool, typer.Option("--force",
                                        help="Start even when the preflight doctor fails.")]
NameOpt = Annotated[str | None, typer.Option("--name", help="Run name.", show_default="vllm-PORT; with --uds vllm-uds-ID, from the socket's path")]
ReadyTimeoutOpt = Annotated[float, typer.Option(
    "--ready-timeout", click_type=Seconds(1),
    help="Seconds to wait for /health and /v1/models (asked the way vLLM is configured: its "
    "--host/--port or --uds, HTTPS, its API key).")]
DetachOpt = Annotated[bool, typer.Option(
    "--detach", help="Return once ready (exit 0) or failed; keep supervising in the background.")]
PreflightOpt = Annotated[str | None, typer.Option(
    "--preflight", metavar="KIND[,KIND]", show_default="fast",
    help="fast: doctor from /proc and sysfs; deep: doctor --deep (also asks the devices: "
    "unattributed memory, lost devices, hung runtimes); collective: doctor --collective on the "
    "run's devices in the run's environment (ranks on the Python running xpuctl). Comma list: "
    "deep,collective. Without it, the collective check runs when the last run on these "
    "devices did not end cleanly; an explicit fast skips it. --force skips every preflight.")]
CollectiveTimeoutOpt = Annotated[float, typer.Option(
    "--collective-timeout", click_type=Seconds(0.5, HOUR),
    help="The collective preflight's bound (and again for its runs alone).")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No live status line or phase lines while vLLM starts, no countdown "
    "while it stops.")]
PortOpt = Annotated[int | None, port_option(
    "vLLM's port, passed on to vLLM (before or after MODEL).", "8000", short=False)]
BindOpt = Annotated[str | None, typer.Option(
    "--host", show_default=False,
    help="vLLM's bind address, passed on to vLLM (before or after MODEL).")]
# -- reaching the server (issue 36 item 1): serve's own client certificate for mutual TLS --
ProbeCertOpt = Annotated[str | None, typer.Option(
    "--probe-cert", metavar="FILE", show_default=False,
    help="A client certificate (PEM) for serve's probes, when vLLM asks for one (mutual TLS, "
    "--ssl-cert-reqs 2). Without it serve judges readiness from vLLM's log and processes.")]
ProbeKeyOpt = Annotated[str | None, typer.Option(
    "--probe-key", metavar="FILE", show_default=False,
    help="The private key of --probe-cert (when the certificate file does not hold it).")]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
@guard
def serve(
    ctx: typer.Context, model: ModelArg, vllm_args: VllmArgs = None, vllm: VllmOpt = "vllm serve",
    drain_timeout: DrainOpt = 30.0, teardown_timeout: TeardownOpt = 20.0,
    allow_abort: AbortOpt = False, devices: DevicesOpt = None, env: EnvOpt = None,
    force: ForceOpt = False, name: NameOpt = None, state_dir: StateDirOpt = None,
    ready_timeout: ReadyTimeoutOpt = 900.0, kill_after: KillAfterOpt = 10.0,
    detach: DetachOpt = False, preflight: PreflightOpt = None,
    collective_timeout: CollectiveTimeoutOpt = 30.0, probe_timeout: ProbeTimeoutOpt = 10.0,
    quiet: QuietOpt = False, port: PortOpt = None, bind: BindOpt = None,
    health_interval: HealthIntervalOpt = 5.0, unhealthy_after: UnhealthyAfterOpt = 30.0,
    stall_after: StallAfterOpt = 300.0, on_unhealthy: OnUnhealthyOpt = OnUnhealthy.stop,
    probe_cert: ProbeCertOpt = None, probe_key: ProbeKeyOpt = None,
) -> None:
    """Launch vLLM with a forced drain timeout and supervise it.

    Exit: 0 after a stop that was asked for (xpuctl shutdown, a signal to serve) once the GPU
    is released, even after a SIGKILL or during start-up; 7 when the watch found the run
    unhealthy or stalled and stopped it; 1 when vLLM exits by itself, whatever its own code
    (its code is in the record, `ps --json` and serve's last line), when a signal from outside
    the run stopped it, when leftovers remain or the preflight fails; 4 when not ready in
    time; 5 when a device or the port is claimed by another run.
    """
    from xpuctl.serve import start

    a = app_context(ctx)
    passed = list(vllm_args or []) + list(ctx.args)
    _check_serve_args(ctx, model, passed)
    _check_watch_options(health_interval, unhealthy_after, stall_after)
    opts = _serve_options(a.host, a.environ, model, passed, dict(ctx.params))
    code = start.serve(a.host, opts, a.environ, _say, _print_preflight)
    raise typer.Exit(int(code))


def _serve_options(host: Any, environ: dict[str, str], model: str, passed: list[str],
                   p: dict[str, Any]) -> Any:
    """serve's options (serve/launch.ServeOptions) from the command's parameters."""
    from xpuctl.serve import launch
    from xpuctl.state.statedir import resolve_state_dir

    kinds = parse_preflight(p["preflight"])
    sdir = resolve_state_dir(host, p["state_dir"], environ)  # None: serve refuses this host
    return launch.ServeOptions(
        model=model, vllm_args=passed, vllm_cmd=p["vllm"], drain_timeout=p["drain_timeout"],
        teardown_timeout=p["teardown_timeout"], allow_abort=p["allow_abort"],
        devices=list(p["devices"] or []), env=list(p["env"] or []), force=p["force"],
        name=p["name"], state_dir=sdir, ready_timeout=p["ready_timeout"], detach=p["detach"],
        kill_after=p["kill_after"],
        deep_preflight=(deep_options(p["probe_timeout"], "1GiB", sdir)
                        if "deep" in kinds else None),
        collective_preflight="collective" in kinds, collective_auto=p["preflight"] is None,
        collective_timeout=p["collective_timeout"], quiet=p["quiet"], port=p["port"],
        bind=p["bind"], health_interval=p["health_interval"],
        unhealthy_after=p["unhealthy_after"], stall_after=p["stall_after"],
        on_unhealthy=OnUnhealthy(p["on_unhealthy"]).value,
        probe_cert=p["probe_cert"], probe_key=p["probe_key"],
    )


def _say(msg: str) -> None:
    emit(sys.stderr, msg)


def _print_preflight(report: Any) -> None:
    from xpuctl.output.lines import finding_lines

    for line in finding_lines(report.findings, lead="xpuctl: preflight ", fix="xpuctl:   fix: ",
                              skip_info=True):
        emit(sys.stderr, line)


def _check_watch_options(interval: float, unhealthy_after: float, stall_after: float) -> None:
    """The watch's windows against its interval: a window shorter than the checks that can
    fill it would judge a server on one look (a blip, one busy moment)."""
    if unhealthy_after < interval:
        raise UsageError(f"--unhealthy-after {unhealthy_after:g}s is shorter than one "
                         f"--health-interval ({interval:g}s): one failed check is a blip, not "
                         "a failure; give at least the interval")
    if 0 < stall_after < 2 * interval:
        raise UsageError(f"--stall-after {stall_after:g}s is shorter than two --health-interval "
                         f"({2 * interval:g}s): a stall is judged between checks; give at least "
                         "two intervals, or 0 to turn the stall check off")


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
