"""The command line: `group` (the xpuctl group, lazy loading), `guard` (errors to exit
codes), `options` (the shared option declarations), `context` (what a command runs with),
and one module per command, named after it."""

from xpuctl.cli.group import app, main

__all__ = ["app", "main"]
