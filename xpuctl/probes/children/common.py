"""The skeleton every deep probe child shares: run the probe, and print its result, or what
went wrong, as one JSON line on stdout (ASCII, so no host text can reach a terminal raw),
written whole to the pipe the parent reads. Never a traceback on stdout."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

#: How to get torch with XPU, said wherever torch is missing or is not the XPU build: PyTorch's
#: own XPU wheel index (PyTorch's "Getting Started on Intel GPU" notes). Not PyPI's torch
#: (`pip install torch`, or an extra that names it): on Linux x86_64 that is the CUDA build.
TORCH_XPU_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/xpu"


def emit(result: dict[str, Any]) -> None:
    data = ("\n" + json.dumps(result, ensure_ascii=True) + "\n").encode("ascii")
    while data:
        data = data[os.write(1, data):]


def run(probe: Callable[[], dict[str, Any]], failed: Callable[[str], dict[str, Any]]) -> None:
    """A probe child's main: `probe()`'s result, or `failed(why)` when it raised."""
    try:
        out = probe()
    except Exception as exc:
        out = failed(f"{type(exc).__name__}: {exc}")
    emit(out)
