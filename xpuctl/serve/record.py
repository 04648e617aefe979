"""The run as the supervisor keeps it: what its jobs share (vLLM's process, its output, the
watch, the signals counted), and its record kept true: every change of the run written at once
(a record that cannot be written stops nothing: said once), and what another xpuctl wrote
there (a `shutdown` that is stopping the run)."""

from __future__ import annotations

import subprocess
import threading
import time

from xpuctl.actions.signals import Target, own_identity
from xpuctl.core.runrecords import Health
from xpuctl.host.notify import Notifier
from xpuctl.host.seam import Host
from xpuctl.output import progress
from xpuctl.output.safetext import safe
from xpuctl.serve.budget import worst_stop_seconds
from xpuctl.serve.launch import LaunchPlan, ServeOptions
from xpuctl.serve.pump import Pump
from xpuctl.serve.reach import Prober
from xpuctl.serve.watch import LineWatch, Observer, Watcher
from xpuctl.state import audit
from xpuctl.state.runs import (
    PinnedRuns,
    RunRecord,
    StateDirChangedError,
    stop_abandoned,
    update_record,
)


class RecordKeeper:
    """The run's state, shared by the supervisor's jobs (serve/supervise.py hands this one
    object to each), and its run record kept true."""

    def __init__(self, host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                 state_dir: str, view: progress.View, foreground: bool,
                 notifier: Notifier | None = None) -> None:
        self.host = host
        self.opts = opts
        self.plan = plan
        self.rec = rec
        self.state_dir = state_dir
        self.view = view
        self.foreground = foreground
        self.signals = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: Pump | None = None
        self.t0 = time.monotonic()
        self.tracker = progress.Tracker(self.t0)
        self.track_lock = threading.Lock()
        self.ready = False
        self.pinned: PinnedRuns | None = None
        self.pin_error: OSError | None = None
        try:  # the state directory as it is now: records go there, or nowhere
            self.pinned = PinnedRuns(state_dir)
        except OSError as exc:
            self.pin_error = exc
        self.lost: set[str] = set()  # the record faults already said (once each)
        self.notify = notifier if notifier is not None else Notifier({})
        self.lines = LineWatch()
        self.watcher: Watcher | None = None
        self.observer: Observer | None = None
        # the server reached the way it is configured (TLS, a unix socket, its API key)
        self.prober = Prober(plan.reach, opts.probe_cert, opts.probe_key, self.say)
        self.url = self.prober.url
        self.started = False  # vLLM said "Application startup complete."
        self.stop_budget = worst_stop_seconds(opts.drain_timeout, opts.teardown_timeout,
                                              opts.kill_after)

    def say(self, msg: str) -> None:
        self.view.say(msg)

    def last_lines(self) -> list[str]:
        """vLLM's last lines of output so far (the pump's tail; none before the launch)."""
        return list(self.pump.tail) if self.pump is not None else []

    def set(self, **changes: object) -> None:
        """Note `changes` in the run record. A record that cannot be written (a full or
        read-only disk, a state directory deleted or replaced) stops nothing: the run is
        supervised and stopped as on a writable one, and the fault is said once."""
        try:
            if self.pinned is None:
                for k, v in changes.items():
                    setattr(self.rec, k, v)
                assert self.pin_error is not None
                raise self.pin_error
            update_record(self.state_dir, self.rec, pinned=self.pinned, **changes)
        except OSError as exc:
            self._record_lost(exc)

    def _record_lost(self, exc: OSError) -> None:
        """Say once (per kind) that the record is not being written: on the terminal (or in
        a detached run's log), and in the run log. A storage fault also covers the audit
        lines that are lost with it: the end of serve does not say it again."""
        kind = ("changed" if isinstance(exc, StateDirChangedError)
                else "locked" if isinstance(exc, TimeoutError) else "failed")
        if kind in self.lost:
            return
        self.lost.add(kind)
        sdir, name, why = safe(self.state_dir), safe(self.rec.name), safe(exc.strerror or str(exc))
        if kind == "changed":
            msg = (f"xpuctl: warning: state directory {sdir} was {why} while {name} ran: its "
                   "record is no longer written (a run there may take its name); the run is "
                   "still supervised and stopped as usual")
        elif kind == "locked":  # a stopped or stuck xpuctl holds the record's lock
            msg = (f"xpuctl: warning: the record of {name} was not updated ({why}); the run "
                   "is still supervised and stopped as usual")
        else:
            msg = (f"xpuctl: warning: state directory {sdir} cannot be written ({why}): the "
                   f"record of {name} (and its audit lines) are not kept; the run is still "
                   "supervised and stopped as usual")
            sink = audit.active()
            if sink is not None:
                sink.told = True
        self.say(msg)
        if self.foreground and self.pump is not None:
            self.pump.write(msg.encode("utf-8", "backslashreplace") + b"\n")

    def record_health(self, health: Health) -> None:
        try:
            self.set(health=health)
        except OSError as exc:  # a check that cannot be recorded: `xpuctl health` says stale
            self.say(f"xpuctl: could not record the run's health: {safe(str(exc))}")

    def _alive(self, pid: int, ticks: int) -> bool:
        return Target(pid, ticks).alive(self.host)

    def stopper(self) -> RunRecord | None:
        """The record, when another xpuctl (a shutdown) marked the run "stopping" (read from
        the run's own state directory only: one made since holds no word of it)."""
        from xpuctl.state.runs import read_record

        if self.pinned is None or self.pinned.changed():
            return None
        disk = read_record(self.state_dir, self.rec.name, self.pinned)
        if disk and disk.run_id == self.rec.run_id and disk.state == "stopping" \
                and disk.stopping_by != own_identity():
            return disk
        return None

    def stopped_by_other(self) -> bool:
        """A live `xpuctl shutdown` is stopping the run (it owns the ladder)."""
        disk = self.stopper()
        return disk is not None and not stop_abandoned(disk, self._alive)
