"""The `xpuctl` group: global options, and the commands, each loaded only when it is run.

`COMMANDS` names each command's module and the one-line help the command list shows, so
`xpuctl --version`, `xpuctl --help`, completing a command name, or running one command
imports nothing of the others (click's lazy-group pattern). A test keeps each line equal
to its command's own docstring.

To add a command: write `xpuctl/cli/NAME.py` with `app = command_app()` and one
`@app.command()` function that parses, calls one function of the core, renders through
`xpuctl.output`, and maps the result to an exit code; then add it to `COMMANDS`.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from xpuctl import __version__
from xpuctl.cli.guard import fail, group_exit_code
from xpuctl.cli.paramtypes import Seconds
from xpuctl.errors import ExitCode
from xpuctl.host.reads.protocol import DEFAULT_BOUND
from xpuctl.output.safetext import emit
from xpuctl.parse.seconds import READ_BOUND_SPAN

COMPLETE_VAR = "_XPUCTL_COMPLETE"

# name -> (module, the line in the command list); the order is the list's
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("xpuctl.cli.doctor", "Read-only health check: who holds the GPU, orphans, memory, stale IPC/shm, ports."),
    "ps": ("xpuctl.cli.ps", "xpuctl's runs and the vLLM process trees on this host."),
    "devices": ("xpuctl.cli.devices", "Intel GPUs (Level Zero order) and other DRM devices, with holders and memory."),
    "serve": ("xpuctl.cli.serve", "Launch vLLM with a forced drain timeout and supervise it."),
    "shutdown": ("xpuctl.cli.shutdown", "Drain and stop a vLLM server, escalate step by step, verify the GPU is released."),
    "reset": ("xpuctl.cli.reset", "Clean stuck oneCCL/vLLM state before a relaunch: stop orphans, remove stale files."),
    "logs": ("xpuctl.cli.logs", "Print a run's log (vLLM's output and, for --detach, the supervisor's lines)."),
    "health": ("xpuctl.cli.health", "Whether a run is healthy, as its supervisor's watch last found it (for liveness probes)."),
    "snapshot": ("xpuctl.cli.snapshot", "Capture what doctor reads into a .tar.gz for support."),
    "completion": ("xpuctl.cli.completion", "Print the completion script for bash, zsh or fish."),
}


def command_app() -> typer.Typer:
    """The Typer app of one command: plain help (click's), whose defaults and brackets are
    text, never rich markup; errors are the group's (`guard.group_exit_code`)."""
    return typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


class Group(TyperGroup):
    """Loads a command's module when the command is run (or its help is asked for)."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        loaded: dict[str, Any] = self.__dict__.setdefault("_loaded", {})
        if cmd_name in loaded:  # built once (globals_first asks before click does)
            return loaded[cmd_name]
        module = importlib.import_module(COMMANDS[cmd_name][0])
        command = loaded[cmd_name] = typer.main.get_command(module.app)
        from xpuctl.host.reads.process import freeze_start_up  # every command reads the host

        # Paused while the modules loaded (xpuctl.cli.main); the command may run long. What
        # the imports made lives until exit: frozen, no collection walks it again (the
        # first ones after loading took a doctor run 5-10 ms, and a forked reader copies
        # every page a collection touches).
        freeze_start_up()
        gc.enable()
        return command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """The command list from `COMMANDS`, each line whole (click would import every
        command to ask, and cut its help at 45 characters)."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])

    def shell_complete(self, ctx: Any, incomplete: str) -> list[Any]:
        """Command names (and the group's options) without loading any command."""
        from typer._click.shell_completion import CompletionItem

        names = [CompletionItem(name, help=short) for name, (_, short) in COMMANDS.items()
                 if name.startswith(incomplete) and not incomplete.startswith("-")]
        return names + [i for i in super().shell_complete(ctx, incomplete)
                        if i.value.startswith("-")]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """The group's own options are taken after the command too (`xpuctl doctor --root X`
        is `xpuctl --root X doctor`, as kubectl takes its global flags): `globals_first`."""
        return list(super().parse_args(ctx, self.globals_first(ctx, args)))

    def globals_first(self, ctx: Any, args: list[str]) -> list[str]:
        """`args` with the group's options that follow the command moved before it.

        The group's options are its own params (no second list); help stays with the
        command. After the command, an option of the command's own of the same name is the
        command's; a value of the command's options is skipped, never read as an option;
        `--` ends the options; and a positional argument ends them when the command takes
        no options after its arguments (serve: everything after MODEL is vLLM's, `--debug`
        there included). Anything not recognised is left where it is, for click to judge."""
        help_names = set(ctx.help_option_names)
        mine = _options(self.params, help_names)
        at = _command_at(args, mine)
        if at is None:
            return args
        command = self.get_command(ctx, args[at])
        if command is None:
            return args
        theirs = _options(command.params, help_names)
        interspersed = command.context_settings.get("allow_interspersed_args",
                                                    command.allow_interspersed_args)
        moved: list[str] = []
        rest: list[str] = []
        i = at + 1
        while i < len(args):
            arg = args[i]
            name, eq, _ = arg.partition("=")
            if arg == "--" or (not arg.startswith("-") and not interspersed) or arg == "-":
                rest += args[i:]
                break
            if arg.startswith("-") and name in theirs:
                n = 1 if eq or not theirs[name] else 2
                rest += args[i:i + n]
            elif arg.startswith("--") and name in mine:
                n = 1 if eq or not mine[name] else 2
                if i + n > len(args):  # no value: click says so, of the group's option
                    return [*args[:at], *moved, arg]
                moved += args[i:i + n]
            else:
                n = 1
                rest.append(arg)
            i += n
        return [*args[:at], *moved, args[at], *rest]

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        if os.environ.get(complete_var or COMPLETE_VAR):
            # typer's word order for the shims in completions/ (`complete_bash`, not click's
            # `bash_complete`): scripts in click's order would silently complete nothing
            from typer._completion_classes import completion_init

            completion_init()
        args = ray_value_optional(list(sys.argv[1:] if args is None else args))
        rv = group_exit_code(lambda: super(Group, self).main(
            args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
            windows_expand_args=windows_expand_args, **extra))
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else ExitCode.OK)  # a command's return value: none


def _options(params: list[Any], skip: set[str]) -> dict[str, bool]:
    """Option name -> whether it takes a value, for these click params (a flag, a counter
    or a --x/--no-x pair takes none)."""
    out: dict[str, bool] = {}
    for p in params:
        if getattr(p, "param_type_name", "") != "option":
            continue
        valued = not (p.is_flag or p.count)
        for name in (*p.opts, *p.secondary_opts):
            if name not in skip:
                out[name] = valued
    return out


def _command_at(args: list[str], mine: dict[str, bool]) -> int | None:
    """Where the command's name is: the first argument that is not one of the group's
    options or its value (None: no command, or an option the group does not know first)."""
    i = 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if not args[i].startswith("-"):
            return i
        if name not in mine:
            return None
        i += 1 if eq or not mine[name] else 2
    return None


def ray_value_optional(args: list[str]) -> list[str]:
    """`--ray` alone (last, or before another option) means RAY_ADDRESS or auto: click has no
    option with an optional value, so it gets an empty one."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--":
            return out + args[i + 1:]
        if arg == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("")
    return out


def exit_epilog(width: int = 78) -> str:
    """The exit codes for `xpuctl --help`, made from `errors.MEANINGS` (the README's table is
    the same table: a test holds them equal). `\b` keeps click from reflowing it."""
    import textwrap

    from xpuctl.errors import MEANINGS

    lines = ["Exit codes (the same for every command):", "", "\b"]
    for code, meaning in MEANINGS.items():
        lines += textwrap.wrap(meaning, width, initial_indent=f"{int(code):>3}  ",
                               subsequent_indent=" " * 5, break_on_hyphens=False)
    return "\n".join(lines)


app = typer.Typer(
    name="xpuctl",
    cls=Group,
    help="Intel XPU serving hygiene around vLLM: serve, shutdown, doctor, reset.\n\n"
    "The options below go before or after the command (xpuctl doctor --root DIR); after "
    "serve's MODEL everything is vLLM's.",
    epilog=exit_epilog(),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        emit(sys.stdout, f"xpuctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    root: Annotated[
        str | None,
        typer.Option(
            "--root", metavar="DIR",
            envvar="XPUCTL_ROOT",
            help="Read /proc, /sys, /dev, /tmp under this directory (a fake host or a snapshot).",
            show_default=False,
        ),
    ] = None,
    read_timeout: Annotated[
        float,
        typer.Option(
            "--read-timeout", click_type=Seconds(*READ_BOUND_SPAN), envvar="XPUCTL_READ_TIMEOUT",
            help="Bound of every read of another process's files and of device sysfs: one that "
            "does not answer in time (a wedged process or device) is reported, never waited for.",
        ),
    ] = DEFAULT_BOUND,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    from xpuctl.cli.context import AppContext
    from xpuctl.host.seam import Host

    if isinstance(ctx.obj, AppContext):
        return
    if root is not None and not os.path.isdir(root):
        raise fail(f"--root {root}: not a directory", ExitCode.USAGE)
    ctx.obj = AppContext(host=Host(root or "/", read_timeout=read_timeout), debug=debug)


def main() -> None:
    # Last net under the sinks (safetext): a character the stream cannot encode (a stray
    # surrogate, or non-ASCII on an ASCII locale) is written as a backslash escape, never as
    # a raw byte (what surrogateescape, the default in a C/UTF-8-mode locale, would do) and
    # never as an exit-70 UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        try:
            # a TextIOWrapper; anything else raises AttributeError, caught below
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    app(prog_name="xpuctl")
