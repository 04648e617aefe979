"""Parsers for /proc/<pid>/{stat,status,cmdline,environ,maps} and /proc/stat (bytes in, data out)."""

from __future__ import annotations

from typing import NamedTuple


class ProcStat(NamedTuple):
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    threads: int
    start_ticks: int


def parse_stat(data: bytes) -> ProcStat | None:
    """Parse /proc/<pid>/stat; None when truncated or garbled.

    `comm` may hold spaces and parentheses, so its end is the *last* ')'.
    """
    open_ = data.find(b"(")
    close = data.rfind(b")")
    if open_ < 0 or close < open_:
        return None
    rest = data[close + 2 :].split()
    # rest[0] is field 3 (state); starttime is field 22 -> rest[19]
    if len(rest) < 20:
        return None
    try:
        return ProcStat(
            comm=data[open_ + 1 : close].decode("utf-8", "surrogateescape"),
            state=rest[0].decode("ascii", "replace")[:1],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            threads=int(rest[17]),
            start_ticks=int(rest[19]),
        )
    except ValueError:
        return None


def parse_status_uid(text: str) -> int | None:
    """Real uid from /proc/<pid>/status (`Uid:\treal\teffective\tsaved\tfs`)."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            parts = line[4:].split()
            if parts and parts[0].isascii() and parts[0].isdigit():
                return int(parts[0])
            return None
    return None


def parse_status_nspid(text: str) -> tuple[str, ...]:
    """The `NSpid:` ids of /proc/<pid>/status, outermost namespace first (one entry in the
    initial PID namespace; () on kernels before 4.1, which have no such line)."""
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return tuple(line.split(":", 1)[1].split())
    return ()


def parse_cmdline(data: bytes) -> list[str]:
    """argv from /proc/<pid>/cmdline.

    setproctitle writes the title over argv and pads with NULs (or spaces on some versions),
    so trailing empties are dropped; a title padded with spaces is trimmed.
    """
    if not data:
        return []
    # surrogateescape: a byte that is not UTF-8 is kept reversibly (JSON writes it as \udcXX,
    # the terminal shows \xNN: safetext.safe)
    args = data.decode("utf-8", "surrogateescape").split("\0")
    while args and args[-1] == "":
        args.pop()
    if len(args) == 1:
        args[0] = args[0].rstrip(" ")
    return args


#: The most of a command line any output shows (ps, doctor, JSON, findings): a process can
#: have megabytes of argv, and 20 such made `ps --json` print 37 MiB.
ARGV_SHOWN_BYTES = 4096


def argv_bytes(argv: tuple[str, ...] | list[str]) -> int:
    """The length of argv as /proc/<pid>/cmdline gives it: each word and its NUL."""
    return sum(len(w.encode("utf-8", "surrogateescape")) + 1 for w in argv)


def shown_argv(argv: tuple[str, ...] | list[str], total: int = 0,
               cap: int = ARGV_SHOWN_BYTES) -> tuple[tuple[str, ...], int]:
    """(the words shown, the bytes cut): argv within `cap` bytes as /proc/<pid>/cmdline
    counts them (the last word maybe cut inside), and how many bytes of the whole, `total`
    (0: argv is the whole), are not shown. The cut never splits a UTF-8 sequence."""
    whole = max(total, argv_bytes(argv))
    if whole <= cap:
        return tuple(argv), whole - argv_bytes(argv)
    out: list[str] = []
    used = 0
    for word in argv:
        raw = word.encode("utf-8", "surrogateescape")
        if used + len(raw) + 1 <= cap:
            out.append(word)
            used += len(raw) + 1
            continue
        part = _utf8_prefix(raw, cap - used)
        if part:
            out.append(part.decode("utf-8", "surrogateescape"))
            used += len(part)
        break
    return tuple(out), whole - used


def _utf8_prefix(raw: bytes, n: int) -> bytes:
    """raw[:n], shortened so as not to end inside a UTF-8 sequence."""
    if n <= 0:
        return b""
    end = n
    i = end - 1
    while i > end - 4 and i > 0 and raw[i] & 0xC0 == 0x80:
        i -= 1
    lead = raw[i]
    if lead >= 0xC0:
        size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if i + size > end:
            end = i
    return raw[:end]


def shown_command(argv: tuple[str, ...] | list[str], total: int = 0) -> str:
    """argv as one line for people, capped like `shown_argv`, with `…[+N bytes]` when cut."""
    words, cut = shown_argv(argv, total)
    line = " ".join(words)
    return f"{line}…[+{cut} bytes]" if cut else line


def parse_environ(data: bytes) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env.setdefault(
                key.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
            )
    return env


def parse_maps_paths(text: str) -> set[str]:
    """The file paths mapped in /proc/<pid>/maps (as the kernel shows them)."""
    paths: set[str] = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5]
            if path.endswith(" (deleted)"):
                continue
            paths.add(path)
    return paths


def maps_library(text: str, stem: str) -> bool:
    """Does /proc/<pid>/maps map a shared library named `stem.so*` (`libccl` matches
    `/opt/.../libccl.so.1`, also one deleted since it was mapped)?"""
    want = f"/{stem}.so"
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and want in parts[5]:
            name = parts[5].removesuffix(" (deleted)").rsplit("/", 1)[-1]
            if name == want[1:] or name.startswith(want[1:] + "."):
                return True
    return False


def parse_boot_time(text: str) -> float | None:
    """`btime` from /proc/stat: boot time in seconds since the epoch."""
    for line in text.splitlines():
        if line.startswith("btime"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isascii() and parts[1].isdigit():
                return float(parts[1])
    return None
