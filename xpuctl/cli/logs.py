"""`xpuctl logs NAME`: print a run's log, optionally following it."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from xpuctl.cli.context import app_context
from xpuctl.cli.group import command_app
from xpuctl.cli.guard import guard
from xpuctl.cli.options import StateDirOpt, complete_run
from xpuctl.errors import XpuctlError
from xpuctl.output.safetext import emit, passthrough, safe

app = command_app()


@app.command()
@guard
def logs(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Run name (see `xpuctl ps`).", autocompletion=complete_run)],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run is over (Ctrl-C stops).")] = False,
    lines: Annotated[
        int | None,
        typer.Option("--lines", "-n", min=0, metavar="N", help="Only the last N lines.", show_default="all"),
    ] = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Print a run's log (vLLM's output and, for --detach, the supervisor's lines).

    On a terminal every line is escaped (control characters shown as \\x1b...). Into a pipe
    or a file the log's bytes are copied unchanged, but for secrets of a known shape (vLLM
    logs its own arguments, an API key among them): those read <redacted> everywhere.

    Exit 0; 1: its record is damaged or unreadable (the line names it); 3: no run of that
    name.
    """
    from xpuctl import runlog as run_logs
    from xpuctl.state import runs
    from xpuctl.state.live import run_alive
    from xpuctl.state.regular import NotRegularError

    a = app_context(ctx)
    from xpuctl.errors import NotFoundError
    from xpuctl.state.statedir import resolve_state_dir

    sdir = resolve_state_dir(a.host, state_dir, a.environ)
    if sdir is None:
        raise NotFoundError(f"no run named {name!r}: under --root only the runs of a named "
                            "state directory (--state-dir) are read")
    sdir, rec = runs.find_record(sdir, name)

    def alive() -> bool:
        fresh = runs.read_record(sdir, name)
        return run_alive(a.host, fresh if fresh is not None and fresh.run_id == rec.run_id else rec)

    def note(msg: str) -> None:
        emit(sys.stderr, f"xpuctl: {msg}")

    tty = a.stdout_tty
    out = _sink(tty)
    try:
        run_logs.copy(rec.log_path, lines, follow, alive, out, note)
    except FileNotFoundError:
        raise XpuctlError(f"run {safe(name)!r} has no log at {safe(rec.log_path)}") from None
    except NotRegularError as exc:
        raise XpuctlError(f"run {safe(name)!r}: its log {safe(rec.log_path)} {exc.strerror}; "
                          "not read") from None
    except OSError as exc:  # logs/ that is a file, a log we may not read
        raise XpuctlError(f"run {safe(name)!r}: its log {safe(rec.log_path)} cannot be read: "
                          f"{safe(exc.strerror or str(exc))}") from None
    finally:
        out.close()


def _scrubbed(line: bytes) -> bytes:
    """One log line with every secret of a known shape redacted (parse/redact.py): vLLM's
    `non-default args: {'api_key': [...]}` line among them. Other bytes are kept as they are."""
    from xpuctl.parse import redact

    text = line.decode("utf-8", "surrogateescape")
    clean = redact.scrub(text)
    return line if clean == text else clean.encode("utf-8", "surrogateescape")


def _sink(tty: bool) -> Any:
    """Where the log's lines go: escaped on a terminal, copied into a pipe or a file; whole
    lines both ways, each scrubbed of secrets first."""
    from xpuctl import runlog as run_logs

    if tty:
        return run_logs.LineWriter(lambda text: emit(sys.stdout, text),
                                   lambda line: safe(_scrubbed(line)))
    return _Copy()


class _Copy:
    """Into a pipe or a file: the log's bytes as they are, whole lines (the last one as it
    ends, newline or not), each scrubbed of secrets."""

    def __init__(self) -> None:
        self.partial = b""

    def __call__(self, data: bytes) -> None:
        *whole, self.partial = (self.partial + data).split(b"\n")
        if whole:
            passthrough(sys.stdout.buffer, b"".join(_scrubbed(line) + b"\n" for line in whole))

    def close(self) -> None:
        if self.partial:
            passthrough(sys.stdout.buffer, _scrubbed(self.partial))
            self.partial = b""
