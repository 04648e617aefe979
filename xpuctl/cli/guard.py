"""Errors become one line on stderr here, and their exit codes come from the one mapping
(`errors.exit_code`).

Inside a command (`guard`): an `XpuctlError` prints one line on stderr and exits with its
code; Ctrl-C exits 130 (also at a prompt: `group_exit_code`); a closed stdout
(`xpuctl ps | head`) exits 1 quietly; anything unexpected prints one line and exits 70,
unless `--debug` (or XPUCTL_DEBUG=1) asks for the traceback. Around the whole command line
(`group_exit_code`): every usage error (an unknown option or command, a bad value, a missing
argument) is one line on stderr and exit 2, never typer's boxed panel.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from xpuctl.errors import UsageError, XpuctlError, exit_code
from xpuctl.output.safetext import emit, neutral, safe

F = TypeVar("F", bound=Callable[..., Any])


def debug_requested(ctx: Any = None) -> bool:
    """`--debug` as the group parsed it (Group.globals_first: only where it is xpuctl's, before
    the command's arguments end; after serve's MODEL it is vLLM's), or XPUCTL_DEBUG=1. Never
    the word anywhere in argv."""
    if ctx is None or getattr(ctx, "obj", None) is None:
        from typer._click.globals import get_current_context

        ctx = get_current_context(silent=True)
    obj = getattr(ctx, "obj", None)
    return bool(getattr(obj, "debug", False)) or os.environ.get("XPUCTL_DEBUG") == "1"


def fail(message: str, code: int) -> typer.Exit:
    # one line, control characters escaped; the host text inside went through `safe` where
    # the message was made (escaping its backslashes again would double them)
    emit(sys.stderr, f"xpuctl: error: {neutral(message)}")
    return typer.Exit(int(code))


def guard(fn: F) -> F:
    """Map a command's errors to exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = debug_requested(kwargs.get("ctx") or (args[0] if args else None))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except XpuctlError as exc:
            if debug:
                raise
            raise fail(str(exc), exit_code(exc)) from None
        except KeyboardInterrupt as exc:
            if debug:
                raise
            sys.stderr.write("xpuctl: interrupted\n")
            raise typer.Exit(exit_code(exc)) from None
        except BrokenPipeError as exc:
            # `xpuctl ps | head`: the reader went away; not an error worth a message
            try:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (replaces stdout until exit)
            except OSError:
                pass
            raise typer.Exit(exit_code(exc)) from None
        except Exception as exc:
            if debug:
                raise
            raise fail(
                f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)",
                exit_code(exc),
            ) from None

    return wrapper  # type: ignore[return-value]  # functools.wraps gives a _Wrapped; typer reads the signature through __wrapped__


def confirm(refusal: str) -> bool:
    """The one question of a destructive command (reset, shutdown --all), asked once its plan
    is shown: "Proceed? [y/N]" on the terminal. No terminal to ask: UsageError(`refusal`),
    exit 2 (scripts pass --yes). A "no" is False: the caller exits 1 with nothing changed;
    Ctrl-C (130) and end of input (1) leave through `group_exit_code`."""
    if not sys.stdin.isatty():
        raise UsageError(refusal)
    return bool(typer.confirm("Proceed?", default=False))


def one_line(text: str) -> str:
    return safe(" ".join(text.split()))


def usage_line(exc: Any) -> str:
    """`xpuctl: error: no such option: --bogus (see 'xpuctl doctor -h')`."""
    msg = one_line(exc.format_message()).rstrip(".")
    if msg[:1].isupper() and msg[1:2].islower():
        msg = msg[0].lower() + msg[1:]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{one_line(ctx.command_path)} -h')" if ctx is not None else ""
    return f"xpuctl: error: {msg}{hint}"


def group_exit_code(run: Callable[[], Any]) -> Any:
    """Run the command line (click in standalone_mode=False, so its errors come back here)
    and turn what escapes it into one line and an exit code."""
    from typer._click import exceptions as click_errors

    try:
        return run()
    except click_errors.NoArgsIsHelpError as exc:
        exc.show()  # bare `xpuctl`: the help (our own constant text), and exit 2
        return exit_code(exc)
    except click_errors.UsageError as exc:
        emit(sys.stderr, usage_line(exc))
        return exit_code(exc)
    except typer.Abort as exc:
        # click turns both a Ctrl-C and an end of input at a prompt into Abort; the
        # KeyboardInterrupt it replaced is still its __context__
        if isinstance(exc.__context__, KeyboardInterrupt):
            sys.stderr.write("\nxpuctl: interrupted\n")
            return exit_code(exc.__context__)
        sys.stderr.write("\nxpuctl: aborted (no answer)\n")
        return exit_code(EOFError())
    except click_errors.ClickException as exc:
        emit(sys.stderr, f"xpuctl: error: {one_line(exc.format_message())}")
        return exit_code(exc)
