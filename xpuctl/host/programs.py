"""The programs xpuctl starts on this machine: which Python a command runs.

Not read through the seam: the vLLM command and Ray's Python are this machine's, whatever
`--root` says about the host being inspected.
"""

from __future__ import annotations

import os
import re
import shutil

_PYTHON = re.compile(r"^python[\d.]*$")


def interpreter_of(argv: list[str]) -> str | None:
    """The Python a command runs: argv[0] when it is a python, else the python of the `#!`
    line of the script it names (`vllm` is a console script of the venv that has vLLM, and
    often ray); None for anything else."""
    if not argv:
        return None
    prog = shutil.which(argv[0]) or argv[0]
    if _PYTHON.match(os.path.basename(prog)):
        return prog
    try:
        with open(prog, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode("utf-8", "replace").split()
    if parts and os.path.basename(parts[0]) == "env" and len(parts) > 1:
        parts = parts[1:]
    if parts and _PYTHON.match(os.path.basename(parts[0])):
        return shutil.which(parts[0]) or parts[0]
    return None
