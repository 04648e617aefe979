"""vLLM's own lines for an engine that died under a running server (text in, a record out).

vLLM can exit 0 after its engine dies (vLLM #48966): the API server logs a normal uvicorn
shutdown and the process ends with status 0. Its log still says what happened; these are
the lines that do (substrings of vLLM's messages, with the source file that logs them):

- `Worker proc VllmWorker-0 died unexpectedly, shutting down executor.`
  (v1/executor/multiproc_executor.py; vLLM #48966)
- `EngineCore encountered a fatal error.` (v1/engine/core.py; vLLM #17276, #48966)
- `Engine core proc EngineCore_0 died unexpectedly, shutting down client.`
  (v1/engine/core_client.py; vLLM #32468 and #27549 spell it `EngineCore_DP0`)
- `[shutdown] MPClient: engine core exited unexpectedly` (v1/engine/core_client.py, the
  engine monitor thread of vLLM 0.33)
- `vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.`
  (a request that was running when the engine died; vLLM #51013)

A signal that asked vLLM itself to stop shows in its log too: the single API server's handler
(`vllm/entrypoints/launchers/launcher.py`, `serve_http`, vLLM 0.33) logs
`[shutdown] API server: shutdown triggered` when SIGTERM or SIGINT reaches it (docs/vllm.md,
"Signals and shutdown"). `stop_triggered` finds that line.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class EngineDeath(NamedTuple):
    """The first line of a run's log that says its engine died, and what it says."""

    what: str  # what died, in words: "a worker died", "EngineCore failed", ...
    line: str


_DEATHS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a worker died", re.compile(r"Worker proc \S+ died unexpectedly")),
    ("EngineCore failed", re.compile(r"EngineCore encountered a fatal error")),
    ("EngineCore died", re.compile(r"Engine core proc \S+ died unexpectedly"
                                   r"|engine core exited unexpectedly")),
    ("the engine was dead", re.compile(r"EngineDeadError")),
)


def engine_death(lines: list[str]) -> EngineDeath | None:
    """The first line that says the engine died (the cause comes before its consequences),
    or None when the log does not say."""
    for line in lines:
        for what, rx in _DEATHS:
            if rx.search(line):
                return EngineDeath(what, line.strip())
    return None


_STOP_TRIGGERED = "[shutdown] API server: shutdown triggered"


def stop_triggered(line: str) -> bool:
    """The line where vLLM's API server says a signal asked it to stop."""
    return _STOP_TRIGGERED in line
