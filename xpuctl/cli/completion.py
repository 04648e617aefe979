"""`xpuctl completion SHELL`: the one way to get shell completion."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import Annotated

import typer

from xpuctl.cli.group import COMPLETE_VAR, command_app
from xpuctl.cli.guard import guard

app = command_app()


class Shell(StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


@app.command()
@guard
def completion(shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.")]) -> None:
    """Print the completion script for bash, zsh or fish.

    For example: `xpuctl completion bash > /etc/bash_completion.d/xpuctl`. The script is a
    shim: every TAB asks xpuctl itself, so candidates (devices, runs, commands) are always
    current. Same text as completions/ in the source tree.
    """
    from typer._completion_shared import get_completion_script

    sys.stdout.write(get_completion_script(prog_name="xpuctl", complete_var=COMPLETE_VAR, shell=shell.value))
    sys.stdout.write("\n")
