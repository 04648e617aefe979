"""`xpuctl shutdown`'s flow: from a request to an outcome, below the CLI.

Find the trees the request names, then either say what would be stopped (`--dry-run`, or
nothing found) or mark their run records `stopping`, run the ladder with every signal in the
audit log, and mark the records `stopped` or `failed`. The CLI parses, calls `run` once,
renders the outcome and maps it to an exit code.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from xpuctl.actions.signals import can_signal
from xpuctl.core.model import EMPTY_ENV
from xpuctl.core.waits import Wait
from xpuctl.errors import NotFoundError, UsageError
from xpuctl.host.seam import Host
from xpuctl.shutdown import ladder, plan
from xpuctl.shutdown.logtail import LogTail
from xpuctl.shutdown.targets import ServerTree
from xpuctl.state import audit


class Request(NamedTuple):
    """What to stop and how (the command's arguments)."""

    name: str | None = None
    pid: int | None = None
    port: int | None = None
    devices: tuple[str, ...] = ()  # --device specs, resolved against the host
    all_: bool = False
    timeout: float | None = None  # None: each tree's exit budget
    kill_after: float = 10.0
    release_timeout: float = 30.0
    dry_run: bool = False
    since: float | None = None  # time.monotonic() when the command started: the resolve time
    environ: Mapping[str, str] = EMPTY_ENV  # the command's environment (where Ray is)

    @property
    def names_only_a_run(self) -> bool:
        """NAME alone: no --pid, --port, --device or --all (the run's recorded top may be
        signalled before the full scan)."""
        return (self.name is not None and self.pid is None and self.port is None
                and not self.devices and not self.all_)

    @property
    def names_something(self) -> bool:
        return bool(self.name is not None or self.pid is not None or self.port is not None
                    or self.devices or self.all_)


class Found(NamedTuple):
    """The trees are found and their records marked: the ladder begins (told before its first
    event)."""

    trees: int
    resolve_s: float | None  # from the command's start to here (None: start unknown)


class Planned(NamedTuple):
    """`--all` without `--yes`: what it will stop, told before it asks."""

    trees: list[ServerTree]
    members: dict[int, list[int]]  # each tree's processes by top pid, as they are now
    skipped: list[str]  # reads that did not answer


@dataclass
class Outcome:
    trees: list[ServerTree]
    # each tree's processes by top pid: the ladder's when it ran, else as they are now
    members: dict[int, list[int]]
    result: ladder.StopResult | None = None  # None: a dry run, or nothing to stop
    resolve_s: float | None = None
    skipped: list[str] = field(default_factory=list)  # a dry run's reads that did not answer
    audit: audit.Sink | None = None  # the ladder's audit log (None when nothing was sent)
    declined: bool = False  # --all's plan was not approved: nothing was sent

    @property
    def leftovers(self) -> bool:
        return self.result is not None and self.result.verdict == "leftovers"


def check(request: Request, host: Host) -> None:
    """UsageError (exit 2) for a request that names nothing, or one that would signal through
    a root whose /proc is not the live one (a dry run may look)."""
    if not request.names_something:
        raise UsageError("say which server to stop: NAME, --pid, --port, --device or --all")
    if not can_signal(host) and not request.dry_run:
        raise UsageError("shutdown needs the live /proc (a root whose proc is the real /proc)")


def run(host: Host, request: Request, state_dir: str | None,
        on_event: Callable[[Found | ladder.Event], None] | None,
        approve: Callable[[Planned], bool] | None = None,
        on_wait: Callable[[Wait | None], None] | None = None) -> Outcome:
    """Stop what `request` names (NotFoundError, exit 3, when NAME, --pid or --port match
    nothing). `on_event` hears `Found` once, then each step of the ladder; `on_wait`, what
    the ladder waits for and until when (ladder.stop). `--all` stops
    every server of the host: unless `approve` is None (--yes), it is shown the plan first,
    and nothing is sent (`declined`) when it says no."""
    check(request, host)
    early = (plan.recorded_top(host, state_dir, request.name)
             if request.name is not None and request.names_only_a_run and not request.dry_run
             else None)
    if early is not None:
        return _run_early(host, request, state_dir, on_event, early, on_wait)
    trees = plan.find_targets(host, state_dir, request.name, request.pid, request.port,
                              list(request.devices), request.all_, request.environ)
    if request.dry_run or not trees:
        return Outcome(trees, plan.planned_members(host, trees), skipped=ladder.skipped_lines(host))
    if approve is not None and request.all_:
        planned = Planned(trees, plan.planned_members(host, trees), ladder.skipped_lines(host))
        if not approve(planned):
            return Outcome(trees, planned.members, skipped=planned.skipped, declined=True)
    unclean = unclean_ends(trees)  # as the records were before this stop
    mark_records(state_dir, trees, state="stopping")
    # From our own start to the first signal: start-up plus finding the trees. On the
    # critical path of every restart, and the first thing to look at when a drain began late.
    resolve_s = _since(request)
    with audit.recording(state_dir, "shutdown") as log:
        return _stop(host, request, state_dir, on_event, trees, unclean, resolve_s, log,
                     on_wait=on_wait)


def _since(request: Request) -> float | None:
    return time.monotonic() - request.since if request.since is not None else None


def _stop(host: Host, request: Request, state_dir: str | None,
          on_event: Callable[[Found | ladder.Event], None] | None, trees: list[ServerTree],
          unclean: dict[str, str], resolve_s: float | None, log: audit.Sink,
          signalled: dict[int, bool] | None = None,
          tails: dict[str, LogTail] | None = None,
          on_wait: Callable[[Wait | None], None] | None = None) -> Outcome:
    """The end both ways share, inside the audit log `log`: tell `Found`, run the ladder
    (`signalled`, `tails`: what the early way did before it), mark the records ended."""
    if on_event is not None:
        on_event(Found(len(trees), resolve_s))
    result = ladder.stop(host, trees, timeout=request.timeout, kill_after=request.kill_after,
                         release_timeout=request.release_timeout, on_event=on_event,
                         signalled=signalled, tails=tails, on_wait=on_wait)
    mark_ended(state_dir, trees, result.verdict, unclean)
    return Outcome(trees, result.members, result, resolve_s, audit=log)


def _run_early(host: Host, request: Request, state_dir: str | None,
               on_event: Callable[[Found | ladder.Event], None] | None,
               early: ServerTree,
               on_wait: Callable[[Wait | None], None] | None = None) -> Outcome:
    """NAME's recorded top is still the process serve launched (pid and start ticks, checked
    again through a pidfd when the signal is sent): SIGTERM it first, then scan for the rest
    of the tree (members, devices, port) while vLLM drains. The identity check is what makes
    the signal safe; the scan only finds what else to wait for."""
    from xpuctl import pausepoint

    trees = [early]
    unclean = unclean_ends(trees)
    mark_records(state_dir, trees, state="stopping")
    pausepoint.reached("shutdown-found")
    # vLLM's drain lines begin at the signal: read its log from before it
    tails = {early.log_path: LogTail(early.log_path)} if early.log_path else {}
    with audit.recording(state_dir, "shutdown") as log:
        signalled = early.top.send(host, signal.SIGTERM)
        resolve_s = _since(request)
        try:
            found = plan.find_targets(host, state_dir, request.name, None, None, [], False,
                                      request.environ)
        except NotFoundError:
            found = []  # the top is gone already and left nothing carrying its run id
        trees = [plan.with_top(t, early.top, early.never_ready) for t in found] or trees
        return _stop(host, request, state_dir, on_event, trees, unclean, resolve_s, log,
                     signalled={early.top.pid: signalled}, tails=tails, on_wait=on_wait)


def unclean_ends(trees: list[ServerTree]) -> dict[str, str]:
    """Run name -> why, for the runs being stopped whose end was already unclean before this
    stop: their record says so (`lastrun.unclean_end`), or their API server is gone and left
    orphans (vLLM #55510). Stopping what they left does not make that end clean: the next
    launch on their devices still needs the collective check (docs/collective.md)."""
    from xpuctl.state.lastrun import unclean_end

    out: dict[str, str] = {}
    for t in trees:
        if t.record is None:
            continue
        why = unclean_end(t.record, top_alive=not t.orphan)
        if why is None and t.orphan:
            why = "its API server was gone, its other processes left as orphans"
        if why is not None:
            out[t.record.name] = why
    return out


def mark_ended(state_dir: str | None, trees: list[ServerTree], verdict: str,
               unclean: dict[str, str]) -> None:
    """The records of the runs stopped: "stopped", or "failed" when leftovers stayed or the
    run's end was unclean before this stop (`unclean_ends`; its reason kept, else said)."""
    from xpuctl.state import runs

    clean = [t for t in trees if t.record is None or t.record.name not in unclean]
    mark_records(state_dir, clean, state="stopped" if verdict != "leftovers" else "failed")
    for t in trees:
        if t.record is None or t.record.name not in unclean:
            continue
        now = runs.read_record(state_dir, t.record.name) if state_dir else None
        said = now.reason if now is not None and now.run_id == t.record.run_id else None
        why = f"ended uncleanly before the shutdown: {unclean[t.record.name]}"
        mark_records(state_dir, [t], state="failed", reason=said or t.record.reason or why)


def mark_records(state_dir: str | None, trees: list[ServerTree], **changes: Any) -> None:
    """Note a stop in the records of the runs being stopped ("stopping", then "stopped" or
    "failed"); a record that cannot be written does not stop the shutdown."""
    from xpuctl.state import runs

    if "state" in changes and changes["state"] != "stopping":
        changes.setdefault("stopped_at", time.time())
    if changes.get("state") == "stopping":  # who: a stopper SIGKILLed midway stops nothing
        from xpuctl.actions.signals import own_identity

        changes.setdefault("stopping_by", own_identity())
    if state_dir is None:
        return
    for t in trees:
        if t.record is not None:
            try:
                runs.update_record(state_dir, t.record, **changes)
            except OSError:
                pass
