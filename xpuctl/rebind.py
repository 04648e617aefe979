"""`xpuctl reset --device N --rebind`: the kernel's recovery of a wedged device
(DRM_WEDGE_RECOVERY_REBIND), made safe.

plan (the device, its BDF and driver, the two writes) → refuse while anything holds the
device (unless --kill-holders stops what the reset rules allow) → confirm → write unbind →
wait (bounded) until its DRM nodes are gone → write bind → wait (bounded) until its render
node is back → doctor on that device (with --collective, the collective check first: one that
passes proves the device clean, as `doctor --collective` does). Only xe and i915 devices are
rebound; under `--root` the writes go below the root.

`run` is the flow (request in, outcome out, each step told through a callback as a record);
the CLI (cli/reset.py) renders the steps and the outcome and maps it to an exit code: 0 when
the device is back and clean, 1 with what is missing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from xpuctl.actions.driverbind import Write, driver_path, write_bdf
from xpuctl.core.model import EMPTY_ENV, Device, Report
from xpuctl.errors import UsageError
from xpuctl.host.devices import scan_devices
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host
from xpuctl.shutdown.ladder import Event, stop
from xpuctl.shutdown.targets import ServerTree, tree_from_scan
from xpuctl.state import audit
from xpuctl.sweep import find_holders

T = TypeVar("T")

DRIVERS = ("xe", "i915")
POLL = 0.05
VENDOR = "vendor-specific"  # DRM_WEDGE_RECOVERY_VENDOR's name in the wedged uevent


class Blocker(NamedTuple):
    pid: int
    command: str
    why_not: str | None  # None: --kill-holders stops it


class RebindPlan(NamedTuple):
    device: Device
    driver: str
    nodes: tuple[str, ...]  # its DRM nodes now (/dev/dri/...)
    holders: tuple[Blocker, ...]
    trees: tuple[ServerTree, ...]  # what --kill-holders stops first
    kill_holders: bool
    # the card's own word (card_verdict): the recovery the kernel log's wedged uevent asked
    # for (WEDGED=<method>), and Level Zero Sysman's health (ok … failed)
    wedge_method: str | None = None
    sysman_health: str | None = None

    @property
    def hopeless(self) -> str | None:
        """Why no rebind can bring the card back (what to do instead), else None."""
        if self.device.survivability is not None:
            return (f"the device is in survivability mode ({self.device.survivability}): a "
                    "rebind cannot bring it back, only a firmware flash can (see `xpuctl "
                    "doctor`)")
        if self.wedge_method is not None and VENDOR in self.wedge_method.split(","):
            return (f"the kernel declared it wedged with a vendor-specific recovery "
                    f"(WEDGED={self.wedge_method}): a rebind cannot bring it back; flash the "
                    "card's firmware (fwupd, or `xpu-smi updatefw`), then cold-reset the host")
        if self.sysman_health == "failed":
            return ("Level Zero Sysman says the card FAILED (zesDeviceGetHealthStatusExt, kept "
                    "across resets): a rebind cannot bring it back; take it out of service and "
                    "have it replaced")
        return None

    @property
    def unbind(self) -> str:
        """The file the unbind writes (a host path)."""
        return driver_path(self.driver, "unbind")

    @property
    def bind(self) -> str:
        return driver_path(self.driver, "bind")

    @property
    def refused(self) -> str | None:
        if self.hopeless is not None:
            return self.hopeless
        if not self.holders:
            return None
        if not self.kill_holders:
            return "held by " + ", ".join(f"pid {h.pid} ({h.command})" for h in self.holders)
        kept = [h for h in self.holders if h.why_not is not None]
        if kept:
            return "held by " + ", ".join(f"pid {h.pid} ({h.command}: {h.why_not})" for h in kept)
        return None


def card_verdict(host: Host, device: Device, environ: Mapping[str, str],
                 timeout: float = 10.0) -> tuple[str | None, str | None]:
    """The card's own word before a rebind: (the recovery its last wedged record asked for:
    the kernel log, since it was last initialised; Level Zero Sysman's health: its probe
    child alone, bounded). Either is None when it cannot be told."""
    from xpuctl.host.kernel import read_kernel
    from xpuctl.probes import runner

    log, _, _ = read_kernel(host, (device,))
    results = runner.start(dict(environ), timeout, names=("sysman",)).finish()
    health = next((d.health for r in results for d in r.devices if d.bdf == device.bdf), None)
    return (log.wedge_method(device.bdf) if log is not None else None), health


def make_plan(host: Host, bdfs: tuple[str, ...], kill_holders: bool) -> RebindPlan:
    if len(bdfs) != 1:
        raise UsageError("--rebind needs exactly one --device")
    if host.live and os.geteuid() != 0:
        raise UsageError("--rebind needs root (it writes the driver's unbind and bind files)")
    scan = take_scan(host, port=None, want_env=False, artifacts=False)
    dev = scan.device(bdfs[0])
    if dev is None:
        raise UsageError(f"device {bdfs[0]} is not visible")
    if dev.driver not in DRIVERS:
        raise UsageError(f"device {dev.bdf} has driver {dev.driver or 'none'}: --rebind "
                         f"rebinds {' and '.join(DRIVERS)} devices only")
    bdf = dev.bdf
    pids = sorted(set(scan.holders(bdf)) | set(scan.unknown_holders(bdf)))
    allowed = {h.pid: h for h in find_holders(host, scan, {bdf})}
    blockers: list[Blocker] = []
    trees: list[ServerTree] = []
    tops: set[int] = set()
    for pid in pids:
        p = scan.process(pid)
        command = p.command if p is not None else "?"
        if p is not None and p.role is not None:  # vLLM: only an orphaned tree may be stopped
            if p.embedded_in is not None:
                blockers.append(Blocker(pid, command, f"{p.embedded_in.describe()}: stop that "
                                        "process itself"))
                continue
            if not p.orphan:
                blockers.append(Blocker(pid, command, "a live vLLM server: use xpuctl shutdown"))
                continue
            blockers.append(Blocker(pid, command, None))
            tops.add(p.top or pid)
            continue
        h = allowed.get(pid)
        if h is None:
            blockers.append(Blocker(pid, command, "it did not answer: what it holds is unknown"))
            continue
        blockers.append(Blocker(pid, command, h.why_not))
        if h.why_not is None and h.tree is not None:
            trees.append(h.tree)
    for top in sorted(tops):
        tree = tree_from_scan(scan, top, host)
        if tree is not None:
            tree.orphan = True
            trees.append(tree)
    return RebindPlan(dev, dev.driver, dev.nodes, tuple(blockers), tuple(trees), kill_holders)


class RebindOutcome(NamedTuple):
    writes: tuple[Write, ...]
    gone: bool  # the nodes went after the unbind
    back: str | None  # its render node after the bind
    missing: tuple[str, ...]  # what is not as it should be
    after: Report | None


def _nodes_left(host: Host, plan: RebindPlan) -> list[str]:
    return [n for n in plan.nodes if host.exists(f"/sys/class/drm/{n.rsplit('/', 1)[-1]}")]


def _render_node(host: Host, bdf: str) -> str | None:
    devices, _ = scan_devices(host)
    return next((d.render_node for d in devices if d.bdf == bdf and d.render_node), None)


def _until(pred: Callable[[], T], seconds: float) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(POLL)


class Request(NamedTuple):
    """The one device to rebind and how (the command's arguments)."""

    devices: tuple[str, ...] = ()  # --device specs (exactly one), resolved against the host
    dry_run: bool = False
    kill_holders: bool = False
    kill_after: float = 10.0
    timeout: float | None = None  # seconds to wait for the holders after SIGTERM
    bind_timeout: float = 30.0  # for the nodes to go after the unbind, to come after the bind
    collective: float | None = None  # the collective check's timeout (None: no check)
    environ: Mapping[str, str] = EMPTY_ENV  # the command's environment (the check's ranks')


class Planned(NamedTuple):
    """The plan, told before anything is done."""

    plan: RebindPlan


class Written(NamedTuple):
    """A write of the driver's unbind or bind file, done or not."""

    op: str  # unbind | bind
    bdf: str
    driver: str
    write: Write


class Back(NamedTuple):
    """The device's render node is back after the bind."""

    bdf: str
    node: str


class Checking(NamedTuple):
    """The collective check of the device begins (--collective)."""

    bdf: str


#: What `run` tells as it goes: the plan, the holders' stop (the ladder's steps), the
#: writes, the device back, the check begun.
Told = Planned | Event | Written | Back | Checking


def execute(host: Host, plan: RebindPlan, request: Request,
            tell: Callable[[Told], None]) -> RebindOutcome:
    """Stop the holders --kill-holders may stop, unbind, wait, bind, wait, check."""
    from xpuctl.diagnosis import CollectiveOptions, diagnose

    bdf = plan.device.bdf
    missing: list[str] = []
    bound = request.bind_timeout
    if plan.trees:
        stop(host, list(plan.trees), timeout=request.timeout, kill_after=request.kill_after,
             release_timeout=10.0, on_event=tell)
        scan = take_scan(host, port=None, want_env=False, artifacts=False)
        still = sorted(set(scan.holders(bdf)) | set(scan.unknown_holders(bdf)))
        if still:
            return RebindOutcome((), False, None, (
                f"still held by pid(s) {', '.join(map(str, still))}: not unbound",), None)
    unbind = write_bdf(host, plan.driver, "unbind", bdf, bound)
    tell(Written("unbind", bdf, plan.driver, unbind))
    if not unbind.done:
        return RebindOutcome((unbind,), False, None, (f"unbind: {unbind.detail}",), None)
    _until(lambda: not _nodes_left(host, plan), bound)
    left = _nodes_left(host, plan)
    gone = not left
    if left:
        missing.append(f"DRM node(s) {', '.join(left)} still there {bound:g} s after the unbind")
    bind = write_bdf(host, plan.driver, "bind", bdf, bound)
    tell(Written("bind", bdf, plan.driver, bind))
    if not bind.done:
        missing.append(f"bind: {bind.detail}")
        return RebindOutcome((unbind, bind), gone, None, tuple(missing), None)
    back = _until(lambda: _render_node(host, bdf), bound)
    if not back:
        missing.append(f"no render node for {bdf} {bound:g} s after the bind")
        return RebindOutcome((unbind, bind), gone, None, tuple(missing), None)
    tell(Back(bdf, back))
    if request.collective is not None:
        tell(Checking(bdf))
    after = diagnose(host, devices=[bdf], caller_env=dict(request.environ),
                     collective=(CollectiveOptions(request.collective)
                                 if request.collective is not None else None))
    missing.extend(f"{f.check}: {f.message}" for f in after.findings if f.severity == "fail")
    return RebindOutcome((unbind, bind), gone, back, tuple(missing), after)


@dataclass
class Outcome:
    plan: RebindPlan
    executed: RebindOutcome | None = None  # None: a dry run, refused, or not approved
    audit: audit.Sink | None = None  # the execution's audit log
    declined: bool = False  # the plan was not approved: nothing was written

    @property
    def missing(self) -> tuple[str, ...]:
        return self.executed.missing if self.executed is not None else ()


def run(host: Host, request: Request, state_dir: str | None, on_event: Callable[[Told], None],
        approve: Callable[[RebindPlan], bool] | None = None) -> Outcome:
    """Plan (`Planned`); unless it is a dry run or refused, ask `approve` (None: approved,
    --yes), then rebind with every write and signal in the audit log of `state_dir`
    (resolved), telling each step. A collective check that passed proves the device clean
    there (state/lastrun.py), as `doctor --collective` does."""
    from xpuctl.diagnosis import note_proven
    from xpuctl.host.devices import resolve_device_specs

    plan = make_plan(host, resolve_device_specs(host, list(request.devices)), request.kill_holders)
    method, health = card_verdict(host, plan.device, request.environ)
    plan = plan._replace(wedge_method=method, sysman_health=health)
    on_event(Planned(plan))
    out = Outcome(plan)
    if request.dry_run or plan.refused:
        return out
    if approve is not None and not approve(plan):
        out.declined = True
        return out
    with audit.recording(state_dir, "reset") as log:
        out.executed = execute(host, plan, request, on_event)
    out.audit = log
    checked = out.executed.after.scan.collective if out.executed.after is not None else None
    if checked is not None:
        note_proven(state_dir, checked)
    return out
