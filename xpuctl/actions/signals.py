"""Launch, signal, wait: the only code that sends signals.

Identity is (pid, start time in clock ticks). Every signal goes through `Target.send`, which
opens a pidfd, re-checks the start time *after* opening it (so the pidfd is known to name
the same process), then signals through the pidfd: a recycled pid can never be hit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import time
from collections.abc import Iterable
from typing import NamedTuple

from xpuctl import pausepoint
from xpuctl.host.processes import same_process, stat_of, still_running
from xpuctl.host.seam import Host
from xpuctl.state import audit

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants reparent to us (and stay findable) instead of PID 1."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """preexec_fn: the child gets `sig` when the thread that forked it dies."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


class Target(NamedTuple):
    """A process we may signal: pid plus the start time that proves it is still the same."""

    pid: int
    start_ticks: int
    label: str = ""

    def alive(self, host: Host) -> bool:
        """Same process, still running (a zombie counts as gone: it holds nothing)."""
        return same_process(host, self.pid, self.start_ticks) is not None

    def send(self, host: Host, sig: int) -> bool:
        """Signal the process if it is still the one we identified. True when sent.

        Every attempt, sent or not, is one line in the audit log (when a command records),
        written right after it and before anything else is done."""
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:
            self._audit(sig, "not sent: no such process")
            return False
        try:
            st = stat_of(host, self.pid)
            if st is None and any(b.path == f"/proc/{self.pid}/stat" for b in host.blocked_reads()):
                self._audit(sig, f"not sent: /proc/{self.pid}/stat did not answer")
                return False
            if st is None or st.start_ticks != self.start_ticks:
                self._audit(sig, "not sent: the pid no longer names this process")
                return False
            if st.state == "Z":
                self._audit(sig, "not sent: already exited (zombie)")
                return False
            if sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT) and st.state == "T":
                self._signal(fd, signal.SIGCONT)
            self._signal(fd, sig)
            return True
        except OSError as exc:
            if exc.errno in (errno.ESRCH, errno.EPERM):
                return False
            raise
        finally:
            os.close(fd)

    def _signal(self, fd: int, sig: int) -> None:
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError as exc:
            self._audit(sig, f"not sent: {exc.strerror or exc}")
            raise
        self._audit(sig, "sent")
        pausepoint.reached("signal-sent")

    def _audit(self, sig: int, result: str) -> None:
        audit.signal(self.pid, self.start_ticks, self.label, sig, result)


def own_identity() -> list[int]:
    """[pid, start ticks] of this process: how a run record names who is stopping it."""
    st = stat_of(Host(read_timeout=None), os.getpid())  # our own stat cannot block: no reader
    return [os.getpid(), st.start_ticks if st is not None else 0]


def survivors(host: Host, targets: Iterable[Target]) -> list[Target]:
    """The targets still alive (`Target.alive`), checked in one call to the host's reader."""
    targets = list(targets)
    alive = still_running(host, [(t.pid, t.start_ticks) for t in targets])
    return [t for t, ok in zip(targets, alive, strict=True) if ok]


def target_of(host: Host, pid: int, label: str = "", start_ticks: int | None = None) -> Target | None:
    """`pid` as a Target while it runs (and, given `start_ticks`, is still that process)."""
    st = same_process(host, pid, start_ticks)
    return Target(pid, st.start_ticks, label) if st is not None else None


def wait_gone(host: Host, targets: Iterable[Target], timeout: float, interval: float = 0.05) -> list[Target]:
    """Wait until every target is gone or `timeout` passes; return the survivors.

    Uses pidfds (readable once the process exits) so an exit is seen at once, with a
    /proc check as the source of truth (a zombie is gone).
    """
    pending = survivors(host, targets)
    deadline = time.monotonic() + timeout
    fds: dict[int, int] = {}  # pid -> pidfd
    try:
        for t in pending:
            try:
                fds[t.pid] = os.pidfd_open(t.pid)
            except OSError:
                pass
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # only the pidfds of processes still pending: an exited one stays readable
            live_fds = [fds[t.pid] for t in pending if t.pid in fds]
            if live_fds:
                poller = select.poll()
                for fd in live_fds:
                    poller.register(fd, select.POLLIN)
                poller.poll(int(min(interval, left) * 1000))
            else:
                time.sleep(min(interval, left))
            reap_children()
            pending = survivors(host, pending)
        return pending
    finally:
        for fd in fds.values():
            os.close(fd)


#: Exit codes of children reaped by `reap_children`, by pid.
EXITED: dict[int, int] = {}


def reap_children() -> list[tuple[int, int]]:
    """Reap every exited child (orphans reparent to us as subreaper): [(pid, exit code)].

    The exit code is negative for a signal, like Popen.returncode; it is kept in EXITED.
    """
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        code = os.waitstatus_to_exitcode(status)
        EXITED[pid] = code
        reaped.append((pid, code))
    return reaped


def can_signal(host: Host) -> bool:
    """Signals only make sense when the scanned /proc is the one we live in."""
    return host.proc_is_live
