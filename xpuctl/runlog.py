"""A run's log, behind `xpuctl logs` (the command is cli/logs.py): print it (found through
its run record), optionally following it.

Following ends when the run is over: neither its supervisor nor its vLLM top process is
alive any more (identity checked by start time, so a recycled pid does not keep it going).
A log that is truncated is read again from its start; a log that is replaced (rotated:
renamed, or deleted and re-created) is read to its end and then the new file is followed,
as `tail -F` does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import BinaryIO

from xpuctl.state.regular import open_regular

CHUNK = 1 << 16


def start_of_last_lines(fh: BinaryIO, n: int, end: int) -> int:
    """Offset where the last `n` lines of the first `end` bytes begin (a final line without
    a newline counts as a line). Reads backwards in blocks: a big log is not read whole."""
    if n <= 0:
        return end
    pos = end
    seen = 0
    # a trailing newline ends the last line; it does not start another
    if end > 0:
        fh.seek(end - 1)
        if fh.read(1) == b"\n":
            pos = end - 1
    while pos > 0:
        step = min(CHUNK, pos)
        fh.seek(pos - step)
        block = fh.read(step)
        idx = len(block)
        while True:
            idx = block.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == n:
                return pos - step + idx + 1
        pos -= step
    return 0


def _open(path: str) -> BinaryIO:
    """The log, a regular file (NotRegularError for a FIFO or a link: never read, so never
    blocked on nor read without end)."""
    return os.fdopen(open_regular(path), "rb")


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def copy(path: str, lines: int | None, follow: bool, alive: Callable[[], bool],
         emit: Callable[[bytes], None], note: Callable[[str], None], poll: float = 0.2) -> None:
    """Send the log (its last `lines` lines, or all of it) to `emit` in chunks; with
    `follow`, keep sending what is appended until `alive()` is False, then the rest.

    `note` gets what the reader should know (truncated, replaced, not there yet)."""
    fh: BinaryIO | None = None
    waited = False
    while fh is None:
        try:
            fh = _open(path)
        except FileNotFoundError:
            if not follow or not alive():
                raise
            if not waited:
                note(f"waiting for {path} to appear")
                waited = True
            time.sleep(poll)
    try:
        end = os.fstat(fh.fileno()).st_size
        fh.seek(start_of_last_lines(fh, lines, end) if lines is not None else 0)
        while True:
            data = fh.read(CHUNK)
            if data:
                emit(data)
                continue
            if not follow:
                return
            # at the end: decide before the last read, so nothing written meanwhile is lost
            running = alive()
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            mine = os.fstat(fh.fileno())
            if now is not None and not _same_file(now, mine):
                rest = fh.read()
                if rest:
                    emit(rest)
                fh.close()
                fh = _open(path)
                note(f"{path} was replaced; following the new file")
                continue
            if mine.st_size < fh.tell():
                note(f"{path} was truncated; reading it from the start")
                fh.seek(0)
                continue
            if not running:
                rest = fh.read()
                if rest:
                    emit(rest)
                return
            time.sleep(poll)
    finally:
        fh.close()


class LineWriter:
    """The sink for a terminal: whole lines, each escaped by `escape` (host text: vLLM's log
    lines may carry control sequences), handed to `write` as one block without its final
    newline (safetext.emit adds it); a final partial line on `close`."""

    def __init__(self, write: Callable[[str], None], escape: Callable[[bytes], str]) -> None:
        self.write = write
        self.escape = escape
        self.partial = b""

    def __call__(self, data: bytes) -> None:
        data = self.partial + data
        *whole, self.partial = data.split(b"\n")
        if whole:
            self.write("\n".join(self.escape(line) for line in whole))

    def close(self) -> None:
        if self.partial:
            self.write(self.escape(self.partial))
            self.partial = b""
