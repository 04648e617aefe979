"""vLLM's output copied: into the run log (one write a line) and to the terminal, each line
handed to the start-up tracker and the watch's line reader; the last lines kept for a failed
run's record."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import IO

from xpuctl.state.regular import open_regular


def open_log(log_path: str) -> int | None:
    """The run log, opened once for the run's life (appended; a regular file only: a FIFO
    there would block serve). None when it cannot be opened: the run goes on unlogged."""
    try:
        return open_regular(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return None


class Pump(threading.Thread):
    """Copy vLLM's output to the log file, keeping the last lines, and hand each line to
    `on_line` (the start-up tracker) and `echo` (foreground: the terminal)."""

    def __init__(self, stream: IO[bytes], log_fd: int | None, on_line: Callable[[str], None],
                 echo: Callable[[str], None] | None) -> None:
        super().__init__(daemon=True, name="xpuctl-log")
        self.stream = stream
        self.log_fd = log_fd
        self.on_line = on_line
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=200)

    def write(self, raw: bytes) -> None:
        """One write(2) onto the log (O_APPEND): vLLM's lines and xpuctl's never mix inside
        a line. A full or read-only disk loses the line, never the run. (The descriptor
        stays open until serve exits: xpuctl's own lines may still come after vLLM's.)"""
        if self.log_fd is None:
            return
        try:
            os.write(self.log_fd, raw)
        except OSError:
            pass

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            if not raw.endswith(b"\n"):
                raw += b"\n"
            self.write(raw)
            text = raw.decode("utf-8", "surrogateescape").rstrip("\n")
            self.tail.append(text)
            if self.echo is not None:  # the log keeps the exact bytes; the terminal, escapes
                self.echo(text)
            self.on_line(text)
