"""The environment a command runs in, built once in the group's callback and injectable in
tests (`runner.invoke(app, [...], obj=AppContext(...))`), and what every command asks of it:
the host to read (this one, or a snapshot's) and its own age."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from xpuctl.host.seam import Host
from xpuctl.output.safetext import emit, safe

if TYPE_CHECKING:  # rich is imported on first use
    from rich.console import Console


class AppContext:
    __slots__ = ("_err", "_out", "debug", "environ", "host")

    def __init__(self, host: Host, debug: bool = False, environ: dict[str, str] | None = None,
                 _out: Console | None = None, _err: Console | None = None) -> None:
        self.host = host
        self.debug = debug
        self.environ = dict(os.environ) if environ is None else environ
        self._out = _out  # rich Consoles, made on first use (or injected by tests)
        self._err = _err

    @property
    def out(self) -> Console:
        """rich Console on stdout (created on first use: rich is slow to import). It escapes
        every text it prints and reads no markup (safetext.console)."""
        if self._out is None:
            from xpuctl.output.safetext import console

            # Not a terminal (a pipe, a log): wide enough that nothing useful is cut.
            width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
            self._out = console(soft_wrap=False, width=width)
        return self._out

    @property
    def err(self) -> Console:
        if self._err is None:
            from xpuctl.output.safetext import console

            self._err = console(stderr=True)
        return self._err

    @property
    def stdout_tty(self) -> bool:
        return sys.stdout.isatty()

    @property
    def stderr_tty(self) -> bool:
        return sys.stderr.isatty()


def app_context(ctx: Any) -> AppContext:
    obj = ctx.obj
    assert isinstance(obj, AppContext)
    return obj


def open_source(ctx: Any, from_: str | None) -> tuple[Host, dict[str, str], Any]:
    """The host to read, the caller environment doctor judges, and recorded probe results:
    this host's (no recorded probes), or a snapshot's (unpacked until the command ends; it
    replaces --root and XPUCTL_ROOT)."""
    a = app_context(ctx)
    if from_ is None:
        return a.host, a.environ, None
    from xpuctl.archive.replay import open_snapshot

    opened = open_snapshot(from_)
    scan = opened.__enter__()
    ctx.call_on_close(lambda: opened.__exit__(None, None, None))
    m = scan.manifest
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(m.time))
    emit(sys.stderr, f"xpuctl: snapshot of {safe(m.host or '?')} taken {when} "
                     f"(xpuctl {safe(m.version)}, uid {m.uid}, {len(m.unreadable)} unreadable)")
    return scan.host, dict(m.caller_env), scan.probes  # probes: a --deep capture's results


def own_age_seconds() -> float | None:
    """Wall seconds since this process started (its /proc start time against CLOCK_BOOTTIME)."""
    from xpuctl.host.processes import stat_of
    from xpuctl.host.seam import CLK_TCK

    st = stat_of(Host("/", read_timeout=None), os.getpid())  # our own stat: it cannot block
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if st is None or boottime is None:
        return None
    return max(0.0, time.clock_gettime(boottime) - st.start_ticks / CLK_TCK)
