"""The options several commands share, declared once, and what turns their values into the
core's options. A command module imports what it needs from here; its own options stay in
its module.

Defaults that are not plain values are shown through `show_default="..."` (click prints
`[default: ...]` itself): text in brackets inside a help string would be markup to rich.
"""

from __future__ import annotations

import os
import sys
import time
from enum import StrEnum
from typing import Annotated, Any

import typer

from xpuctl.cli.paramtypes import DeviceList, Seconds, SnapshotFile
from xpuctl.errors import UsageError
from xpuctl.host.seam import Host
from xpuctl.output.safetext import safe
from xpuctl.parse.seconds import HOUR


class Format(StrEnum):
    table = "table"
    json = "json"
    prometheus = "prometheus"
    npd = "npd"  # doctor only: node-problem-detector's custom plugin (output/npd.py)


def output_format(fmt: Format | None, as_json: bool, default: Format = Format.table) -> Format:
    if as_json and fmt not in (None, Format.json):
        raise UsageError("--json and --format disagree; use one of them")
    return Format.json if as_json else (fmt or default)


def complete_device(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Device indices, BDFs and node names, read from sysfs only (this runs on every TAB)."""
    from xpuctl.host.devices import scan_devices

    root = ctx.parent.params.get("root") if ctx.parent else None
    try:
        devices, _ = scan_devices(Host(root or os.environ.get("XPUCTL_ROOT") or "/"))
    except Exception:
        return []
    out = []
    for d in devices:
        help_ = safe(f"{d.bdf} {d.driver or '?'} {d.device_id or ''}".strip(), 200)  # shown by the shell
        for value in (str(d.index) if d.index is not None else None, d.bdf, d.render_node):
            if value and value.startswith(incomplete) and safe(value) == value:
                out.append((value, help_))
    return out


def complete_run(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Run names from the state directory (this runs on every TAB)."""
    from xpuctl.host.seam import Host
    from xpuctl.state import runs
    from xpuctl.state.statedir import resolve_state_dir

    try:
        root = ctx.find_root().params.get("root")
        sdir = resolve_state_dir(Host(root or "/"), ctx.params.get("state_dir"), os.environ)
        if sdir is None:
            return []
        sdir = runs.ensure_state_dir(sdir, create=False)
        return [(r.name, f"{r.state}, port {r.port or '-'}") for r in runs.list_records(sdir)
                if r.name.startswith(incomplete)]
    except Exception:
        return []


def port_option(help: str, default: str | None = None, short: bool = True) -> Any:
    """`--port`: what it means differs by command (the port to check, the server to stop,
    vLLM's own), its parsing and range do not. serve has no -p (vLLM's options follow MODEL)."""
    names = ("--port", "-p") if short else ("--port",)
    return typer.Option(*names, min=1, max=65535, metavar="PORT", help=help, show_default=default or False)


RayOpt = Annotated[
    str | None,
    typer.Option("--ray", metavar="[ADDRESS]", show_default=False,
                 help="Every alive node of a Ray cluster, as a Ray task on each (ADDRESS, else "
                 "RAY_ADDRESS, else auto); Ray runs in XPUCTL_RAY_PYTHON or this Python."),
]


def on_cluster(a: Any, command: str, address: str, options: dict[str, Any], out_fmt: Format,
               textfile: str | None = None) -> None:
    """`--ray`: the command on every node of the cluster (xpuctl.ray.cluster), rendered by
    output.cluster; the exit code is the worst node's."""
    from xpuctl.output import cluster as cluster_output
    from xpuctl.ray.cluster import gather

    result = gather(command, options, address, a.environ)
    if out_fmt is Format.json:
        from xpuctl.output.documents import to_json

        sys.stdout.write(to_json(cluster_output.cluster_dict(result)) + "\n")
    elif out_fmt is Format.prometheus and textfile is not None:
        from xpuctl.state.textfile import write_atomic

        write_atomic(textfile, cluster_output.prometheus(result))
    elif out_fmt is Format.prometheus:
        sys.stdout.write(cluster_output.prometheus(result))
    else:
        cluster_output.print_cluster(a.out, result)
    raise typer.Exit(result.exit_code)


# doctor's own options, declared here so that its command stays one screen
DoctorPortOpt = Annotated[int | None, port_option("Serving port to check.", "8000")]
ExpectIdleOpt = Annotated[
    bool, typer.Option("--expect-idle", help="Any holder, memory or served port is a failure.")
]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Warnings fail too (exit 1).")]
WaitCleanOpt = Annotated[
    float | None,
    typer.Option("--wait-clean", click_type=Seconds(0), show_default=False,
                 help="Re-check until nothing fails, for up to SECONDS (right after a shutdown)."),
]
DoctorFormatOpt = Annotated[
    Format | None,
    typer.Option("--format", "-f", show_default="table",
                 help="table, json, prometheus (json: as --json) or npd: one line of at most 80 "
                 "bytes for node-problem-detector's custom plugin (exit 0 OK, 1 a failing "
                 "finding, 8 could not tell; never --collective or --deep)."),
]
TextfileOpt = Annotated[
    str | None,
    typer.Option("--textfile", metavar="PATH", show_default=False,
                 help="Write the Prometheus text atomically to PATH (*.prom, for node_exporter's "
                 "textfile collector) instead of stdout; implies --format prometheus."),
]
UnattributedThresholdOpt = Annotated[
    str,
    typer.Option("--unattributed-threshold", metavar="SIZE",
                 help="With --deep: device memory no visible process explains above this fails."),
]
DeviceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--device",
        "-d",
        click_type=DeviceList(),
        help="Device: Level Zero index, PCI BDF or node name (repeatable, or a comma list).",
        autocompletion=complete_device,
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON on stdout, for scripts (one document; "
                                        "messages go to stderr).")]
#: --json of a command that also has --format (doctor): the same thing, said how they meet
FormatJsonOpt = Annotated[
    bool,
    typer.Option("--json", help="The same as --format json. Both may be given when they agree; "
                 "--json with another --format is a usage error (exit 2)."),
]
DeepOpt = Annotated[
    bool,
    typer.Option("--deep", help="Also ask the devices themselves (Sysman, torch.xpu, xpu-smi, the "
                 "kernel's memory query), each probe in a child process."),
]
ProbeTimeoutOpt = Annotated[
    float,
    typer.Option("--probe-timeout", click_type=Seconds(0.1, HOUR),
                 help="With --deep: kill a probe (and its process group) that has not answered."),
]
StateDirOpt = Annotated[
    str | None,
    typer.Option(
        "--state-dir",
        metavar="DIR",
        envvar="XPUCTL_STATE_DIR",
        help="Run records, logs, locks, the audit log and the idle baseline.",
        show_default="/run/xpuctl as root, else $XDG_RUNTIME_DIR/xpuctl, else /tmp/xpuctl-UID",
    ),
]
CollectiveOpt = Annotated[
    bool,
    typer.Option("--collective", help="Also run oneCCL/XCCL init, one all_reduce and destroy "
                 "across the devices (one rank per device, child processes on the Python "
                 "running xpuctl, as --deep's torch probe), bounded; a hang names its phase "
                 "and, rerun alone, its card. One device: an allocation and a computation on "
                 "it, no collective (vLLM runs none at world size 1)."),
]
CollectiveTimeoutOpt = Annotated[
    float,
    typer.Option("--collective-timeout", click_type=Seconds(0.5, HOUR),
                 help="With --collective: kill the ranks (as one session) after SECONDS; the "
                 "runs alone after a failure get as long again."),
]
KillAfterOpt = Annotated[
    float, typer.Option("--kill-after", click_type=Seconds(0, HOUR), help="Seconds between SIGTERM and SIGKILL for survivors.")
]
FromOpt = Annotated[
    str | None,
    typer.Option(
        "--from",
        click_type=SnapshotFile(),
        help="Read a snapshot archive (xpuctl snapshot) instead of this host.",
        show_default=False,
    ),
]


def parse_size(value: str, option: str = "--unattributed-threshold") -> int:
    from xpuctl.parse.fdinfo import parse_size as parse

    n = parse(value)
    if n is None:
        raise UsageError(f"{option} {value!r} is not a size (e.g. 1GiB, 512MiB, 1073741824)")
    return n


def deep_options(timeout: float, threshold: str, state_dir: str | None) -> Any:
    """doctor --deep's options: the probes get what is left of `timeout` since this process
    started (a command that took T to get here gives its probes timeout - T). `state_dir`
    (resolved: statedir.resolve_state_dir) holds the idle baseline."""
    from xpuctl.cli.context import own_age_seconds
    from xpuctl.diagnosis import DeepOptions

    age = own_age_seconds()
    since = time.monotonic() - age if age is not None else None
    return DeepOptions(timeout=timeout, unattributed_threshold=parse_size(threshold), state_dir=state_dir,
                       since=since)
