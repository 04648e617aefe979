"""vLLM's own lines for an engine that died under a running server (text in, a record out).

vLLM can exit 0 after its engine dies (vLLM #48966): the API server logs a normal uvicorn
shutdown and the process ends with status 0. Its log still says what happened; these are
the lines that do (the beginnings of vLLM's messages, with the file that logs them):

- `Worker proc VllmWorker-0 died unexpectedly, shutting down executor.`
  (v1/executor/multiproc_executor.py; vLLM #48966); with Ray, `RayWorkerProc rank=[1] died
  unexpectedly, shutting down executor.` (v1/executor/ray_executor_v2.py, vLLM 0.32)
- `EngineCore encountered a fatal error.` (v1/engine/core.py; vLLM #17276, #48966)
- `Engine core proc EngineCore_0 died unexpectedly, shutting down client.`
  (v1/engine/core_client.py; vLLM #32468 and #27549 spell it `EngineCore_DP0`)
- `[shutdown] MPClient: engine core exited unexpectedly; starting cleanup`
  (v1/engine/core_client.py, the engine monitor thread of vLLM 0.32 and 0.33, a WARNING)
- `vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.`
  (a request that was running when the engine died; vLLM #51013)

A signal that asked vLLM itself to stop shows in its log too: the single API server's handler
(`vllm/entrypoints/launchers/launcher.py`, `serve_http`, vLLM 0.33) logs
`[shutdown] API server: shutdown triggered` when SIGTERM or SIGINT reaches it (docs/vllm.md,
"Signals and shutdown"). `stop_triggered` finds that line.

Only vLLM's own logger lines count (parse/vllmlog.py `parse_line`: its prefix and the
`[file.py:N]` of the file that logs the line), and only when the message *begins* with the
words: a client's text inside another line (a stop string in request_logger.py's `Received
request ...: params: SamplingParams(..., stop=['EngineDeadError'])`, a generated output, an
access log line) is never evidence. `EngineDeadError` counts as the exception line of a
traceback vLLM logs at ERROR (`(APIServer pid=1) ERROR 05-12 01:48:42 [api_router.py:72]
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. ...`, vLLM #42362;
the logging file varies: async_llm.py, serving_chat.py, api_router.py).

`EngineDeath.line` is the line as it may be shown: vLLM's line escaped and capped
(output/safetext.py), so a record, `STATUS=` and `xpuctl health` quote it safely.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from xpuctl.output.safetext import safe
from xpuctl.parse.vllmlog import LogLine, parse_line

#: the longest line of vLLM's quoted in a reason
QUOTE = 400


class EngineDeath(NamedTuple):
    """The first line of a run's log that says its engine died, and what it says."""

    what: str  # what died, in words: "a worker died", "EngineCore failed", ...
    line: str  # vLLM's line, escaped and capped at QUOTE (safe to show as it is)


# (what, the start of the message, the files that log it (None: any), the levels it has)
_DEATHS: tuple[tuple[str, re.Pattern[str], frozenset[str] | None, frozenset[str] | None], ...] = (
    ("a worker died", re.compile(r"Worker proc \S+ died unexpectedly"),
     frozenset({"multiproc_executor.py"}), None),
    ("a worker died", re.compile(r"RayWorkerProc rank=.{1,200}? died unexpectedly"),
     frozenset({"ray_executor_v2.py"}), None),
    ("EngineCore failed", re.compile(r"EngineCore encountered a fatal error"),
     frozenset({"core.py"}), None),
    ("EngineCore died", re.compile(r"Engine core proc \S+ died unexpectedly"
                                   r"|\[shutdown\] MPClient: engine core exited unexpectedly"),
     frozenset({"core_client.py"}), None),
    ("the engine was dead", re.compile(r"vllm\.v1\.engine\.exceptions\.EngineDeadError: "),
     None, frozenset({"ERROR", "CRITICAL"})),
)


def _said(log: LogLine) -> str | None:
    for what, rx, sources, levels in _DEATHS:
        if (rx.match(log.message) and (sources is None or log.source in sources)
                and (levels is None or log.level in levels)):
            return what
    return None


def engine_death(lines: list[str]) -> EngineDeath | None:
    """The first line that says the engine died (the cause comes before its consequences),
    or None when the log does not say."""
    for line in lines:
        log = parse_line(line)
        what = None if log is None else _said(log)
        if what is not None:
            return EngineDeath(what, safe(line.strip(), QUOTE))
    return None


def stop_triggered(line: str) -> bool:
    """The line where vLLM's API server says a signal asked it to stop (launcher.py's
    `[shutdown] API server: shutdown triggered`, its own logger line)."""
    log = parse_line(line)
    return (log is not None and log.source == "launcher.py"
            and log.message.startswith("[shutdown] API server: shutdown triggered"))
