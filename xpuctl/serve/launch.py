"""Launch planning: the vLLM command line, environment and devices of a run (no process
is started here).

vLLM gets a forced `--shutdown-timeout` (drain plus teardown), unless it predates the flag,
and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS from the teardown budget (serve/budget.py);
`--port`/`--host` given before MODEL are passed on once; `--devices` become
ZE_AFFINITY_MASK, in PCI order (ZE_ENABLE_PCI_ID_DEVICE_ORDER=1); the run id goes into the
environment for finding the run's processes. A value the user set is kept (said when it
works against serve's budget or order).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xpuctl.core.model import Device
from xpuctl.errors import UsageError, XpuctlError
from xpuctl.host import notify
from xpuctl.host.devices import device_specs, scan_devices, select_devices
from xpuctl.host.programs import interpreter_of
from xpuctl.host.seam import Host
from xpuctl.output.safetext import safe
from xpuctl.parse.envvars import mask_indices
from xpuctl.parse.vllmargs import (
    ServerReach,
    merge_shared,
    port_from_argv,
    server_reach,
    strip_flag,
)
from xpuctl.serve.budget import (
    MIN_SHUTDOWN_TIMEOUT,
    VLLM_SIGTERM_GRACE,
    WORKER_TIMEOUT_VAR,
    vllm_shutdown_timeout,
    worker_shutdown_timeout,
)

if TYPE_CHECKING:  # types only: imported where used
    from xpuctl.diagnosis import DeepOptions

FLAG_VERSION = (0, 18)  # first vLLM with --shutdown-timeout
PCI_ORDER_VAR = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"  # Level Zero enumerates in PCI order when 1
DEFAULT_VLLM = "vllm serve"
_VERSION_RE = re.compile(r"^(vllm(?:[_-][a-z]+)?)-(\d+(?:\.\d+)*)[^/]*\.dist-info$", re.IGNORECASE)


@dataclass
class ServeOptions:
    model: str
    vllm_args: list[str]
    vllm_cmd: str = DEFAULT_VLLM
    drain_timeout: float = 30.0
    teardown_timeout: float = 20.0
    allow_abort: bool = False
    devices: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    force: bool = False
    name: str | None = None
    state_dir: str | None = None  # resolved (statedir): None only where serve refuses to run
    ready_timeout: float = 900.0
    detach: bool = False
    kill_after: float = 10.0
    deep_preflight: DeepOptions | None = None  # `--preflight deep`
    collective_preflight: bool = False  # `--preflight collective`
    collective_auto: bool = True  # run it after an unclean last run (off: an explicit --preflight)
    collective_timeout: float = 30.0
    quiet: bool = False
    port: int | None = None  # --port/--host given before MODEL (passed on to vLLM once)
    bind: str | None = None  # --host: the address vLLM binds
    # the liveness watch once ready (core/watch.py): seconds between checks, of /health
    # failing without a break, of running requests with no token counted; stop or report
    health_interval: float = 5.0
    unhealthy_after: float = 30.0
    stall_after: float = 300.0
    on_unhealthy: str = "stop"  # stop | report
    # serve's own client certificate and key, for a server that asks for one (mutual TLS)
    probe_cert: str | None = None
    probe_key: str | None = None


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    notes: list[str]
    port: int | None  # None with --uds: vLLM then listens on its unix socket only
    bind: str | None
    bdfs: list[str]
    shutdown_timeout: int | None
    version: str | None
    #: how the server listens (serve/reach.py); its API keys are held here, in memory only
    reach: ServerReach = field(default_factory=ServerReach)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def vllm_version(cmd: list[str]) -> str | None:
    """vLLM's version from the package metadata beside the interpreter that runs `cmd`.

    No import of vllm (seconds, and it may initialise the GPU): just the dist-info name.
    """
    interp = interpreter_of(cmd)
    if interp is None:
        return None
    prefix = os.path.dirname(os.path.dirname(interp))
    for pattern in ("lib/python3*/site-packages/vllm*.dist-info", "lib/python3*/dist-packages/vllm*.dist-info"):
        for path in sorted(glob.glob(os.path.join(prefix, pattern))):
            m = _VERSION_RE.match(os.path.basename(path))
            if m:
                return m.group(2)
    return None


def _parse_env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise UsageError(f"--env {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _shutdown_timeout(opts: ServeOptions, vllm_args: list[str], version: str | None,
                      notes: list[str]) -> tuple[list[str], int | None]:
    """vLLM's args without --shutdown-timeout, and the timeout to pass (None: none)."""
    supports_flag = version is None or _version_tuple(version) >= FLAG_VERSION
    args, given, had_flag = strip_flag(vllm_args, "--shutdown-timeout")
    wanted = vllm_shutdown_timeout(opts.drain_timeout, opts.teardown_timeout)
    shutdown_timeout: int | None = wanted
    if had_flag:
        if given is None or not (given.isascii() and given.isdigit()):
            raise UsageError(f"--shutdown-timeout {given!r}: expected whole seconds")
        n = int(given)
        if n == 0 and opts.allow_abort:
            shutdown_timeout = 0
            notes.append("--shutdown-timeout 0 kept (--allow-abort): in-flight requests are aborted")
        elif n == 0:
            notes.append(
                f"replaced --shutdown-timeout 0 (abort) with {wanted}s: on XPU an abort skips Level "
                "Zero/oneCCL teardown and the next server hangs (use --allow-abort to keep it)"
            )
        elif n < MIN_SHUTDOWN_TIMEOUT:
            notes.append(f"raised --shutdown-timeout {n} to the {MIN_SHUTDOWN_TIMEOUT}s minimum")
            shutdown_timeout = MIN_SHUTDOWN_TIMEOUT
        else:
            shutdown_timeout = n
            if n != wanted:
                notes.append(
                    f"--shutdown-timeout {n} given to vLLM replaces serve's {wanted}s "
                    f"(--drain-timeout {opts.drain_timeout:g} + --teardown-timeout "
                    f"{opts.teardown_timeout:g}): vLLM drains and tears down within {n}s"
                )
    if not supports_flag:
        notes.append(
            f"vLLM {version} predates --shutdown-timeout (0.18): not passing it; shutdown waits "
            "for idle before signalling"
        )
        shutdown_timeout = None
    return args, shutdown_timeout


def _worker_timeout(env: dict[str, str], teardown: float, notes: list[str]) -> None:
    """VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS from the teardown budget, unless the user set it
    (kept; said when it does not fit the budget)."""
    wanted = worker_shutdown_timeout(teardown)
    given = env.get(WORKER_TIMEOUT_VAR)
    if given is None:
        env[WORKER_TIMEOUT_VAR] = str(wanted)
        return
    value = given.strip()
    if not (value.isascii() and value.isdigit()):
        notes.append(f"{WORKER_TIMEOUT_VAR}={safe(given, 40)} kept (yours), but vLLM reads whole "
                     f"seconds; serve would pass {wanted}")
    elif int(value) > wanted:
        notes.append(f"{WORKER_TIMEOUT_VAR}={int(value)} kept (yours): with vLLM's "
                     f"{VLLM_SIGTERM_GRACE} s SIGTERM wait it exceeds the --teardown-timeout "
                     f"budget of {teardown:g}s (serve would pass {wanted}); vLLM's own deadline "
                     "may SIGKILL the workers before they finish")


def _refuse_survivability(devices: list[Device], chosen: bool) -> None:
    """A card in survivability mode runs nothing (only a firmware flash brings it back):
    refused before vLLM starts, --force or not."""
    bad = [d for d in devices if d.survivability is not None]
    if not bad:
        return
    names = ", ".join(f"{d.index if d.index is not None else '-'} ({d.bdf}, {d.survivability})"
                      for d in bad)
    pick = "" if chosen else "; choose the other cards with --devices"
    raise XpuctlError(f"device {names} is in survivability mode: nothing runs on it until its "
                      f"firmware is flashed (see `xpuctl doctor`){pick}")


def _environment(opts: ServeOptions, host: Host, environ: dict[str, str],
                 run_id: str, notes: list[str]) -> tuple[dict[str, str], list[str]]:
    """vLLM's environment and the BDFs of the run's devices."""
    devices, _ = scan_devices(host)
    env = dict(environ)
    for key in notify.VARIABLES:  # the service manager talks to serve, never to vLLM
        env.pop(key, None)
    bdfs: list[str] = []
    mask: str | None = None
    if opts.devices:
        chosen = select_devices(devices, device_specs(opts.devices))
        _refuse_survivability(chosen, chosen=True)
        for d in chosen:
            if not d.is_intel or d.index is None:
                raise UsageError(f"device {d.bdf} is not an Intel GPU (vendor {d.vendor_id})")
        bdfs = [d.bdf for d in chosen]
        mask = ",".join(str(d.index) for d in chosen)
        env["ZE_AFFINITY_MASK"] = mask
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.update(_parse_env(opts.env))
    _worker_timeout(env, opts.teardown_timeout, notes)
    if mask is not None and env.get("ZE_AFFINITY_MASK") == mask:
        # serve's indices are in PCI order (host/devices.number_devices); Level Zero's are in
        # driver order unless told otherwise
        order = env.setdefault(PCI_ORDER_VAR, "1")
        if order.strip() != "1":
            notes.append(f"{PCI_ORDER_VAR}={safe(order, 40)} kept (yours), but --devices gives "
                         f"ZE_AFFINITY_MASK={mask} in PCI order: Level Zero may pick other cards")
    elif not opts.devices:
        seen = [d for d in devices if d.is_intel and d.nodes]  # what Level Zero enumerates
        seen = _masked(seen, env, notes)
        _refuse_survivability(seen, chosen=False)
        bdfs = [d.bdf for d in seen]
    env["XPUCTL_RUN_ID"] = run_id
    env["SPT_NOENV"] = "1"  # keep environ readable after setproctitle (the run tag!)
    if host.root:
        env["XPUCTL_ROOT"] = host.root
    return env, bdfs


def _masked(seen: list[Device], env: dict[str, str], notes: list[str]) -> list[Device]:
    """The cards vLLM sees: those `ZE_AFFINITY_MASK` of its environment names (the caller's,
    `--env`, or Ray's), by index in enumeration order (PCI order here, as serve numbers
    them; said when the environment leaves Level Zero in driver order); every card without
    one. A mask that names none of them, or that cannot be read, leaves every card."""
    value = env.get("ZE_AFFINITY_MASK")
    if value is None:
        return seen
    indices = mask_indices(value)
    picked = [d for d in seen if d.index is not None and d.index in (indices or [])]
    if not indices or not picked:
        if indices is None or indices:
            notes.append(f"ZE_AFFINITY_MASK={safe(value, 40)} names no card of this host: the "
                         "run's devices are every card")
        return seen
    if env.get(PCI_ORDER_VAR, "").strip() != "1":
        notes.append(f"ZE_AFFINITY_MASK={safe(value, 40)} without {PCI_ORDER_VAR}=1: Level "
                     "Zero numbers the cards in driver order; serve takes them in PCI order "
                     "(the usual match)")
    return picked


def plan_launch(opts: ServeOptions, host: Host, environ: dict[str, str], run_id: str) -> LaunchPlan:
    vllm_args = merge_shared(list(opts.vllm_args), "--port", None if opts.port is None else str(opts.port))
    vllm_args = merge_shared(vllm_args, "--host", opts.bind)
    cmd = shlex.split(opts.vllm_cmd)
    if not cmd:
        raise UsageError("--vllm is empty")
    if shutil.which(cmd[0]) is None:
        raise UsageError(f"--vllm: {cmd[0]!r} not found on PATH")
    notes: list[str] = []
    version = vllm_version(cmd)
    args, shutdown_timeout = _shutdown_timeout(opts, vllm_args, version, notes)
    argv = [*cmd, opts.model, *args]
    if shutdown_timeout is not None:
        argv += ["--shutdown-timeout", str(shutdown_timeout)]
    port, bind = port_from_argv(args)
    env, bdfs = _environment(opts, host, environ, run_id, notes)
    reach = server_reach(args, env)
    # with --uds vLLM binds no TCP port (a --port beside it is ignored): the run has none, and
    # a server on 8000 is never taken for it
    return LaunchPlan(argv, env, notes, None if reach.uds else port or 8000, bind, bdfs,
                      shutdown_timeout, version, reach)


def ray_python(plan: LaunchPlan) -> str:
    """The Python a Ray child runs for this launch: XPUCTL_RAY_PYTHON, else vLLM's own (it
    has ray)."""
    from xpuctl.ray import bridge

    return bridge.ray_python(plan.env, interpreter_of(plan.argv))
