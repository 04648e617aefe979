"""What the renderers read of records that live above them: the shapes (Protocols) of a
stop's steps and result, a server tree, reset's plan and execution, rebind's plan and outcome,
an audit log.

Those records belong to the layers that make them (`shutdown/`, `reset`, `rebind`,
`state/audit`) and hold what output must not import (processes to signal, run records,
locks), so output names only the fields it shows. mypy checks each record against its shape
where a command hands it over. Pure records live in `core/model.py` and are imported as they
are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from xpuctl.core.model import Artifact, Device, Report


class Step(Protocol):
    """One step of a stop's timeline (shutdown/ladder.Event)."""

    @property
    def t(self) -> float: ...  # seconds since the stop began
    @property
    def phase(self) -> str: ...
    @property
    def detail(self) -> str: ...


class Stopped(Protocol):
    """What a stop did (shutdown/ladder.StopResult)."""

    @property
    def events(self) -> Sequence[Step]: ...
    @property
    def verdict(self) -> str: ...  # clean | escalated | leftovers
    @property
    def survivors(self) -> Sequence[int]: ...
    @property
    def holders(self) -> Sequence[int]: ...
    @property
    def stuck(self) -> Sequence[tuple[int, str | None]]: ...  # D-state holders, their wchan
    @property
    def port_busy(self) -> Sequence[int]: ...


class Signalled(Protocol):
    """A process a stop signals (actions/signals.Target)."""

    @property
    def pid(self) -> int: ...


class Tree(Protocol):
    """A server (or the orphaned remains of one) to stop (shutdown/targets.ServerTree)."""

    @property
    def name(self) -> str: ...
    @property
    def top(self) -> Signalled: ...
    @property
    def role(self) -> str | None: ...
    @property
    def orphan(self) -> bool: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def devices(self) -> tuple[str, ...]: ...
    @property
    def port(self) -> int | None: ...
    @property
    def shutdown_timeout(self) -> int | None: ...


class Holder(Protocol):
    """A process that holds a device and is not vLLM (reset.Holder, rebind.Blocker)."""

    @property
    def pid(self) -> int: ...
    @property
    def command(self) -> str: ...
    @property
    def why_not(self) -> str | None: ...  # why it may not be stopped; None: it may


class ResetHolder(Holder, Protocol):
    @property
    def devices(self) -> tuple[str, ...]: ...


class ResetPlan(Protocol):
    """What reset will do (reset.Plan)."""

    @property
    def orphan_trees(self) -> Sequence[Tree]: ...
    @property
    def orphan_pids(self) -> Sequence[int]: ...
    @property
    def files(self) -> Sequence[Artifact]: ...
    @property
    def pending_files(self) -> Sequence[Artifact]: ...  # removed once the orphans are gone
    @property
    def skipped_files(self) -> Sequence[tuple[Artifact, str]]: ...
    @property
    def device_reset(self) -> Sequence[str]: ...
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def holders(self) -> Sequence[ResetHolder]: ...
    @property
    def empty(self) -> bool: ...


class Removed(Protocol):
    """A file reset removed or kept (actions/cleanup.Removal)."""

    @property
    def path(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def removed(self) -> bool: ...
    @property
    def reason(self) -> str: ...  # why it was kept ("already gone": nothing to say)


class ResetDone(Protocol):
    """What reset's execution did, and the check after it (reset.Execution)."""

    @property
    def stopped(self) -> Stopped | None: ...
    @property
    def removed(self) -> Sequence[Removed]: ...
    @property
    def device_reset(self) -> Sequence[tuple[str, bool, str]]: ...  # (bdf, done, detail)
    @property
    def after(self) -> Report: ...


class RebindPlan(Protocol):
    """What `reset --rebind` will do (rebind.RebindPlan)."""

    @property
    def device(self) -> Device: ...
    @property
    def driver(self) -> str: ...
    @property
    def nodes(self) -> Sequence[str]: ...  # its DRM nodes before the unbind
    @property
    def holders(self) -> Sequence[Holder]: ...
    @property
    def kill_holders(self) -> bool: ...
    @property
    def refused(self) -> str | None: ...
    @property
    def hopeless(self) -> str | None: ...  # why no rebind can help (firmware, replacement)
    @property
    def wedge_method(self) -> str | None: ...  # the kernel log's WEDGED=<method>
    @property
    def sysman_health(self) -> str | None: ...  # Sysman's health extension
    @property
    def unbind(self) -> str: ...  # the driver's unbind file (a host path)
    @property
    def bind(self) -> str: ...


class DriverWrite(Protocol):
    """One write of a driver's unbind or bind file (actions/driverbind.Write)."""

    @property
    def path(self) -> str: ...
    @property
    def done(self) -> bool: ...
    @property
    def detail(self) -> str: ...


class Rebound(Protocol):
    """What `reset --rebind` did (rebind.RebindOutcome)."""

    @property
    def writes(self) -> Sequence[DriverWrite]: ...
    @property
    def gone(self) -> bool: ...  # the DRM nodes went after the unbind
    @property
    def back(self) -> str | None: ...  # the render node after the bind
    @property
    def missing(self) -> Sequence[str]: ...  # what is not as it should be
    @property
    def after(self) -> Report | None: ...


class AuditLog(Protocol):
    """How writing a command's audit log went (state/audit.Sink)."""

    @property
    def path(self) -> str | None: ...
    @property
    def lost(self) -> int: ...  # lines not written
    @property
    def error(self) -> str | None: ...  # the first reason
    @property
    def told(self) -> bool: ...  # the loss was already said
