"""The environment a command runs in, built once in the CLI callback and injectable in tests."""

from __future__ import annotations

import os
import sys
from typing import Any

from xpuctl.host.seam import Host


class AppContext:
    __slots__ = ("host", "debug", "environ", "_out", "_err")

    def __init__(self, host: Host, debug: bool = False, environ: dict[str, str] | None = None,
                 _out: Any = None, _err: Any = None) -> None:
        self.host = host
        self.debug = debug
        self.environ = dict(os.environ) if environ is None else environ
        self._out = _out  # rich Consoles, made on first use (or injected by tests)
        self._err = _err

    @property
    def out(self) -> Any:
        """rich Console on stdout (created on first use: rich is slow to import). It escapes
        every text it prints and reads no markup (safetext.console)."""
        if self._out is None:
            from xpuctl.output.safetext import console

            # Not a terminal (a pipe, a log): wide enough that nothing useful is cut.
            width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
            self._out = console(soft_wrap=False, width=width)
        return self._out

    @property
    def err(self) -> Any:
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
