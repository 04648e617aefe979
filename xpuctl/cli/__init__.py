"""The command line: `group` (the xpuctl group, lazy loading), `guard` (errors to exit
codes), `options` (the shared option declarations), `context` (what a command runs with),
and one module per command, named after it.

`main` is the installed entry point. It loads the modules with the garbage collector paused
and leaves without the interpreter's teardown (`leave`)."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

__all__ = ["app", "leave", "main"]


def main() -> None:
    import gc

    # No cyclic collections while the modules load: imports make many objects and no cycles
    # worth collecting, and each collection walks them all. The group turns the collector on
    # again once the command is loaded (Group.get_command).
    gc.disable()
    from xpuctl.cli.group import main as run

    try:
        run()
    except SystemExit as done:
        leave(done)


def leave(done: SystemExit) -> NoReturn:
    """Exit with `done`'s status as the interpreter would (exit handlers, then the standard
    streams flushed), but without its teardown: freeing every module and object one by one
    takes a doctor run about 25 ms, and the kernel frees them at once.

    Only when this is the process's last thread: the interpreter would wait for the others
    first, so then the exit is the interpreter's own. Output that can no longer be written
    (`xpuctl doctor | head -c1`: the reader went away) is dropped silently, and a run that
    was to exit 0 exits as the commands do for a broken pipe (guard). The statuses are the
    one mapping's (`errors.exit_code`)."""
    from xpuctl.errors import OutputLost, exit_code

    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        raise done
    status = exit_code(done)
    if done.code is not None and not isinstance(done.code, int):
        from xpuctl.output.safetext import emit

        emit(sys.stderr, str(done.code))  # sys.exit("text"): the interpreter prints it
    import atexit

    atexit._run_exitfuncs()  # what the interpreter runs first (the readers' own, finalizers)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError) as exc:
            if stream is sys.stdout and status == 0:
                status = exit_code(OutputLost(str(exc)))
    os._exit(status)


def __getattr__(name: str) -> Any:
    if name == "app":
        from xpuctl.cli.group import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
