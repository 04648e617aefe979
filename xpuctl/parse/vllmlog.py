"""vLLM's own log lines: start-up phases and known oneCCL/vLLM failure signatures (text in, records out).

`PHASES` is the one table of start-up phases. `serve` shows the start as it happens from it,
the readiness diagnosis names the phase a start got stuck in from it, and doctor's
`last-run` check reads the phase a failed run reached from it: they cannot drift apart.

The markers are substrings of vLLM 0.32.0's lines (CPU build, seen here; XPU logs the same
lines with `backend=xccl`), in start-up order:

    Initializing a V1 LLM engine (v0.32.0) with config: ...
    world_size=1 rank=0 local_rank=0 distributed_init_method=... backend=gloo   (XPU: xccl)
    Starting to load model ...
    Loading weights took 0.00 seconds
    ... GiB for KV cache ... / init engine (profile, create kv cache, warmup model) took 1.83 s
    Starting vLLM server on http://0.0.0.0:18555

A version whose lines match nothing stays in "starting" (with its last line shown).
"""

from __future__ import annotations

import re
from typing import NamedTuple


class LogSignature(NamedTuple):
    """A known oneCCL/vLLM failure signature found in a run's log."""

    key: str  # a key of `_SIGNATURES` (core.advice.BY_SIGNATURE), or xccl-stuck
    what: str
    line: str  # the log line carrying it ("" when it is the absence of progress)
    kind: str = "hang"  # hang: stopped making progress | crash: the start failed with an error


class Phase(NamedTuple):
    key: str
    label: str  # what the operator reads
    rank: int  # start-up order; a start only moves forward (ranks of several TP workers interleave)
    markers: tuple[str, ...]
    hint: str = ""  # added to the readiness diagnosis when a start is stuck here


STARTING = Phase("starting", "starting", 0, ())
PHASES: tuple[Phase, ...] = (
    Phase("engine", "engine start", 1, ("Initializing a V1 LLM engine",)),
    # one line names both world_size and the backend: the oneCCL row comes first
    Phase("oneccl", "oneCCL init (xccl)", 2, ("backend=xccl", "backend=ccl"),
          "the oneCCL warm-up all_reduce, where relaunch hangs sit (orphans or stale oneCCL "
          "files on the devices)"),
    Phase("distributed", "distributed init", 2, ("world_size=",)),
    Phase("loading", "loading model", 3, ("Starting to load model",)),
    Phase("profiling", "KV cache + warm-up", 4,
          ("Loading weights took", "Model loading took", "KV cache")),
    Phase("http", "API server start", 5,
          ("init engine (profile", "Starting vLLM server on", "Starting vLLM API server")),
)
READY = Phase("ready", "ready", 6, ())
BY_KEY = {p.key: p for p in (STARTING, *PHASES, READY)}


_PREFIX = re.compile(
    r"^(?:\((?P<who>[A-Za-z_][\w.-]*) pid=\d+\) )?"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
    r"\[(?P<src>[^\]:\s]+):(?P<lineno>\d+)\] "
)
#: the colours of vLLM's ColoredFormatter (vllm/logging_utils/formatter.py), when it is on
_SGR = re.compile(r"\x1b\[[0-9;]*m")


class LogLine(NamedTuple):
    """A line of vLLM's own logger: `(EngineCore_DP0 pid=7) ERROR 12-01 10:00:00 [core.py:123]
    message`. vLLM 0.32's format (vllm/logger.py `_FORMAT`: `(%(vllm_process_name)s
    pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`, dates
    `%m-%d %H:%M:%S`; older versions have no process tag; `fileinfo` is the file's name, or a
    shortened path such as `entrypoints/.../serving.py` at DEBUG). A traceback logged with it carries the same prefix
    on every line (NewLineFormatter)."""

    who: str | None  # the process tag: APIServer, EngineCore_DP0, Worker_TP1, ...
    level: str
    source: str  # the file that logged it, without its directories: core_client.py
    message: str


def parse_line(line: str) -> LogLine | None:
    """The line as vLLM's logger wrote it, or None: another program's text (oneCCL, torch,
    uvicorn's access log, a raw traceback)."""
    if "\x1b" in line:
        line = _SGR.sub("", line)
    m = _PREFIX.match(line)
    if m is None:
        return None
    return LogLine(m.group("who"), m.group("level"), m.group("src").rsplit("/", 1)[-1],
                   line[m.end():].rstrip())


#: files of vLLM that log what a client sent or got (`--enable-log-requests`: the sampling
#: parameters, stop strings included; `--enable-log-outputs`: the generated text):
#: vllm/entrypoints/serve/utils/request_logger.py (0.32; `entrypoints/logger.py` before)
_CLIENT_SOURCES = frozenset({"request_logger.py", "logger.py"})
#: their messages, whichever file logs them (request_logger.py: `Received request %s:
#: params: %s, lora_request: %s.`, `Generated response %s%s: output: %r, ...`, `Request %s
#: details: prompt: %r ...`, `Request %s JSON body: %s`)
_CLIENT_MESSAGES = ("Received request ", "Generated response ", "Request ")
#: uvicorn's access log (`INFO:     10.1.6.81:16983 - "POST /v1/... HTTP/1.1" 500 ...`,
#: vLLM #42362), under vLLM's process tag or not: the request line is the client's
_ACCESS = re.compile(r'^(?:\([A-Za-z_][A-Za-z0-9_]* pid=\d+\) )?[A-Z]+:\s+\S+ - "')


def client_text(line: str) -> bool:
    """A line that carries what a client of the server wrote (a request logged by vLLM, its
    output, an access log line): never evidence of anything about the server."""
    parsed = parse_line(line)
    if parsed is None:
        return _ACCESS.match(line) is not None
    return parsed.source in _CLIENT_SOURCES or parsed.message.startswith(_CLIENT_MESSAGES)


def log_lines(data: bytes) -> list[str]:
    """A log's bytes as lines, split at newlines only.

    vLLM's progress bars (tqdm) redraw with a carriage return, and `splitlines` would also
    split at CR, VT, FF, \\x1c-\\x1e, NEL and U+2028: one progress line would become many, a
    marker at its end a line of its own. A CR stays inside its line (shown as `\\r` by
    `safe`); a CRLF ending loses its CR. Bytes that are not UTF-8 are kept (surrogateescape).
    A final piece without a newline is a line too."""
    text = data.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def short_line(line: str) -> str:
    """A log line without vLLM's prefix (process tag, level, time, source), for a status
    line: `(EngineCore pid=7) INFO 12-01 10:00:03 [core.py:95] Initializing…` becomes
    `EngineCore: Initializing…`; warnings and errors keep their level."""
    m = _PREFIX.match(line)
    if not m:
        return line
    rest = line[m.end():]
    level = m.group("level")
    if level not in ("INFO", "DEBUG"):
        rest = f"{level} {rest}"
    return f"{m.group('who')}: {rest}" if m.group("who") else rest


def phase_of(line: str) -> Phase | None:
    """The phase a log line starts, or None (never a line that carries a client's text)."""
    if client_text(line):
        return None
    for phase in PHASES:
        for marker in phase.markers:
            if marker in line:
                return phase
    return None


def furthest_phase(lines: list[str]) -> Phase:
    """The latest phase the lines reached (STARTING when none matches)."""
    best = STARTING
    for line in lines:
        p = phase_of(line)
        if p is not None and p.rank > best.rank:
            best = p
    return best


# -- oneCCL and vLLM failure signatures ----------------------------------------


# (key, what, kind, pattern); each pattern was read in a real log, cited beside it and in
# the tests (tests/test_log_signatures.py) and docs/formats.md.
_SIGNATURES: tuple[tuple[str, str, str, re.Pattern[str]], ...] = (
    # vLLM #14612: `|CCL_ERROR| ze_fd_manager.cpp:214 fill_device_fds: condition fds[dev_idx] > 0
    # failed` then `open failed: fd: -1, errno: No such file or directory`; as the exception
    # vLLM raises: `RuntimeError: oneCCL: ze_fd_manager.cpp:214 fill_device_fds: EXCEPTION: open
    # failed: ...`; ipex-llm #12990: `oneCCL: ze_fd_manager.cpp:144 init_device_fds: EXCEPTION:
    # opendir failed: could not open device directory` (vLLM in docker)
    ("oneccl-device-fds", "a oneCCL crash opening the render nodes (ze_fd_manager)", "crash",
     re.compile(r"ze_fd_manager\.cpp:\d+ \w*device_fds\b|\b(?:fill|init)_device_fds\b.*"
                r"(?:EXCEPTION|failed)")),
    # vLLM #10109: `RuntimeError: oneCCL: exec.cpp:122 start_workers: EXCEPTION: failed to start
    # worker # 0`
    ("oneccl-workers", "a oneCCL crash starting its workers (start_workers)", "crash",
     re.compile(r"start_workers: EXCEPTION|failed to start worker")),
    # oneCCL's atl_ofi_helper.cpp (LOG_ERROR "fi_getinfo error: ret ", ret, ", providers ", ...);
    # seen with real oneCCL (field notes, 2026-12) and in a public runbook: `|CCL_ERROR|
    # atl_ofi_helper.cpp:1118 atl_ofi_get_prov_list: fi_getinfo error: ret -61, providers 0`,
    # then `failed to initialize ATL`. -61 is ENODATA: libfabric found no provider
    ("atl-init", ("a oneCCL crash starting its transport (ATL: libfabric found no provider, "
     "fi_getinfo -61): leaked libfabric shared-memory regions (/dev/shm/<pid>:<uid>:<n>) or a "
     "full /dev/shm, or an FI_PROVIDER this libfabric lacks"), "crash",
     re.compile(r"fi_getinfo error: ret -61\b|failed to initiali[sz]e ATL\b")),
    # oneCCL's internal_kvs.cpp kvs_init: LOG_ERROR("connection time (", t, ") >= limit (",
    # CONNECTION_TIMEOUT, ")"), CONNECTION_TIMEOUT = 120; seen with real oneCCL (field notes,
    # 2026-12): a fixed KVS port reused within 60 s of a SIGKILL is in TIME_WAIT
    ("kvs-timeout", ("a oneCCL crash: its KVS could not connect to its master in time "
     "(kvs_init connection time limit): a KVS port in TIME_WAIT after a killed run, or an "
     "unreachable master"), "crash",
     re.compile(r"kvs_init: connection time \(\d+\) >= limit \(\d+\)")),
    # the issue's own lines (issue 22 §4): `Segfault encountered` (torch's signal handler)
    ("segfault", "a segmentation fault", "crash",
     re.compile(r"Segfault encountered|Segmentation fault|\bSIGSEGV\b")),
    ("ipc-handle", "a Level Zero IPC handle error (zeMemOpenIpcHandle)", "hang",
     re.compile(r"zeMemOpenIpcHandle")),
    # issue 22 §4: `|CCL_ERROR| internal_kvs.cpp:... kvs_set_value: condition
    # can_use_internal_kvs() failed`; oneCCL #209: a KVS that never connects (create_comm_id)
    ("kvs", "a oneCCL KVS (bootstrap) error", "hang",
     re.compile(r"(?i)internal_kvs|can_use_internal_kvs|\bkvs_(?:set|get|init)\w*|"
                r"\bkvs\b.*\b(?:error|fail\w*|timed? ?out|refused|connect\w*)\b")),
    ("device-lost", "a lost device (UR_RESULT_ERROR_DEVICE_LOST)", "hang",
     re.compile(r"UR_RESULT_ERROR_DEVICE_LOST|ZE_RESULT_ERROR_DEVICE_LOST")),
    # vLLM #27313, #51986 (shm_broadcast.py): `No available shared memory broadcast block found
    # in 60 seconds. This typically happens when some processes are hanging ...`: a worker
    # stopped answering its engine
    ("shm-broadcast", ("vLLM's shm-broadcast hang: a worker that stopped answering its engine "
     "(no shared memory broadcast block in 60 s)"), "hang",
     re.compile(r"No available shared memory broadcast block found in \d+ seconds")),
    # any other oneCCL exception vLLM raises (`RuntimeError: oneCCL: FILE.cpp:N FUNC:
    # EXCEPTION: ...`, the form of vLLM #14612 and #10109 above): the start crashed
    ("oneccl-exception", "a oneCCL crash (an exception in oneCCL)", "crash",
     re.compile(r"oneCCL: \S+\.(?:cpp|hpp|c):\d+ \w+: EXCEPTION")),
)


def crashed(signatures: list[LogSignature] | tuple[LogSignature, ...]) -> bool:
    """Did the start end in an error (a crash) rather than stop making progress?"""
    return any(s.kind == "crash" for s in signatures)


def first_crash(signatures: list[LogSignature] | tuple[LogSignature, ...]) -> LogSignature | None:
    """The crash that ended a start (the first in the log), or None."""
    return next((s for s in signatures if s.kind == "crash"), None)


def hang_signatures(lines: list[str], ever_ready: bool) -> list[LogSignature]:
    """Known oneCCL/vLLM signatures in a run's log, the first line of each; crashes first.

    A start that never became ready and got no further than `backend=xccl` counts too: that
    is the warm-up all_reduce that hangs forever after an unclean stop; unless the log shows
    a crash, which is why it went no further."""
    out: list[LogSignature] = []
    seen: set[str] = set()
    for line in lines:
        if client_text(line):
            continue  # a request's text (a stop string, an output) is not the server's
        for key, what, kind, rx in _SIGNATURES:
            if rx.search(line):  # a line is its first signature (the specific before the general)
                if key not in seen:
                    seen.add(key)
                    out.append(LogSignature(key, what, line.strip(), kind))
                break
    out.sort(key=lambda s: s.kind != "crash")  # stable: log order within each kind
    if not ever_ready and not crashed(out) and furthest_phase(lines).key == "oneccl":
        out.insert(0, LogSignature("xccl-stuck", "start-up stuck after backend=xccl", ""))
    return out
