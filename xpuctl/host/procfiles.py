"""The files of one process a scan reads beside its stat and fds: its command line (redacted,
`read_argv`), what a scan reads of a process it describes (`Facts`), and any file that may be
gone or unreadable (`read_optional`). The pass (host/processes.py) reads them ahead for the
processes it finds holding a device or running vLLM; the scan reads them of the others."""

from __future__ import annotations

from xpuctl.host.seam import Host
from xpuctl.parse import redact
from xpuctl.parse.procfs import parse_cmdline, parse_status_uid

#: The most of a command line read and kept; a longer one is counted (ARGV_COUNT_BYTES at
#: most) and cut. The kernel caps one word at 128 KiB, not the whole.
ARGV_READ_BYTES = 64 << 10
ARGV_COUNT_BYTES = 256 << 20
FDINFO_LIMIT = 64 << 10
CGROUP_LIMIT = 64 << 10

#: What a scan reads of each process it describes (a vLLM process or a device holder): its
#: uid (/proc/<pid>/status; None: unreadable), the kept variables of its environment when the
#: scan asks for them (redact.kept_environ; else None), and its /proc/<pid>/cgroup (None:
#: unreadable).
Facts = tuple[int | None, dict[str, str] | None, str | None]


def read_argv(host: Host, pid: int) -> tuple[list[str], int]:
    """(argv, the whole argv's length in bytes) of a process; ([], 0) when it is gone,
    unreadable or a kernel thread.

    At most ARGV_READ_BYTES are read and kept (enough for the roles and vLLM's options;
    what is shown is capped lower still, parse.procfs.shown_argv); a longer command line
    is read through to count it, nothing more kept. Secret values are replaced
    (parse.redact.argv: `--api-key X`), so no output can show them; the length is the
    redacted command line's."""
    path = f"/proc/{pid}/cmdline"
    try:
        data = host.read_bytes(path, ARGV_READ_BYTES + 1)
        whole = len(data)
        if whole > ARGV_READ_BYTES:
            whole = max(whole, host.size_by_reading(path, ARGV_COUNT_BYTES))
            data = data[:ARGV_READ_BYTES]
    except OSError:
        return [], 0
    words = parse_cmdline(data)
    argv = redact.argv(words)
    # the length as redacted: what each word's redaction added (a trailing NUL padding of
    # setproctitle's is no word, so never a secret option's value)
    grown = sum(_nbytes(r) - _nbytes(w) for w, r in zip(words, argv, strict=True) if r is not w)
    return argv, whole + grown


def _nbytes(word: str) -> int:
    return len(word.encode("utf-8", "surrogateescape"))


def read_cmdline(host: Host, pid: int) -> list[str]:
    """argv of a process (read_argv's); [] when it is gone, unreadable or a kernel thread."""
    return read_argv(host, pid)[0]


def read_facts(host: Host, pid: int, env: bool) -> Facts:
    """The `Facts` of a process, read now."""
    raw = read_optional(host, f"/proc/{pid}/status", 1 << 16)
    uid = parse_status_uid(raw.decode("utf-8", "replace")) if raw is not None else None
    kept = None
    if env:
        data = read_optional(host, f"/proc/{pid}/environ")
        kept = redact.kept_environ(data) if data else {}
    cgroup = read_optional(host, f"/proc/{pid}/cgroup", CGROUP_LIMIT)
    return uid, kept, cgroup.decode("utf-8", "surrogateescape") if cgroup is not None else None


def read_optional(host: Host, path: str, limit: int = 1 << 20) -> bytes | None:
    """The file's bytes, or None when it cannot be read."""
    try:
        return host.read_bytes(path, limit)
    except OSError:
        return None
