"""New lines of a run's log during a shutdown: vLLM's own shutdown phases for the timeline."""

from __future__ import annotations

import os

from xpuctl.parse.vllmlog import client_text, log_lines

_LOG_MARKERS = ("[shutdown]", "XPUWorker shutdown", "force killing", "sending SIGKILL", "sending SIGTERM")


class LogTail:
    """Reads a log from its size at creation on; `new_phases` returns the complete new lines
    that carry a shutdown marker. Lines end at newlines only: a progress line redrawn with
    CRs stays one line (shown with `\\r` by `safe`)."""


    def __init__(self, path: str | None) -> None:
        self.path = path
        self.offset = 0
        if path:
            try:
                self.offset = os.path.getsize(path)
            except OSError:
                self.path = None

    def new_phases(self) -> list[str]:
        if not self.path:
            return []
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(1 << 20)
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        out = []
        for line in log_lines(data[:cut]):  # exact in JSON; escaped when shown
            if line.startswith("xpuctl:"):
                continue  # the supervisor's own lines (a detached run logs here too)
            if client_text(line):
                continue  # a request's stop string or output is not one of vLLM's phases
            if any(m in line for m in _LOG_MARKERS):
                idx = line.find("[shutdown]")
                out.append((line[idx:] if idx >= 0 else line.split("] ", 1)[-1]).strip())
        return out
