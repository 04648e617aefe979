"""The environment a command runs in, built once in the CLI callback and injectable in tests."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from xpuctl.host import Host


@dataclass
class AppContext:
    host: Host
    debug: bool = False
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    _out: Any = None
    _err: Any = None

    @property
    def out(self) -> Any:
        """rich Console on stdout (created on first use: rich is slow to import)."""
        if self._out is None:
            from rich.console import Console

            # Not a terminal (a pipe, a log): wide enough that nothing useful is cut.
            width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
            self._out = Console(highlight=False, soft_wrap=False, width=width)
        return self._out

    @property
    def err(self) -> Any:
        if self._err is None:
            from rich.console import Console

            self._err = Console(stderr=True, highlight=False)
        return self._err

    @property
    def stdout_tty(self) -> bool:
        return sys.stdout.isatty()

    @property
    def stderr_tty(self) -> bool:
        return sys.stderr.isatty()
